"""Math word problems over a local JSONL file, scored by numeric answer checking.

File format: one JSON object per line (blank lines are skipped)::

    {"id": "m001", "question": "A baker fills 14 trays ...", "answer": "168", "split": "train"}

* ``question`` (string) and ``answer`` (a number, or a string such as ``"1,200"``,
  ``"-7"``, ``"0.25"``, ``"3/4"``, ``"$12.50"``) are required.
* ``id`` is optional; without it the id is a hash of the question, so it survives
  reordering the file. Ids must be unique: the ``prompt_id`` is ``"math/<id>"``, which
  does not depend on the split, so changing ``eval_fraction`` never renames a prompt.
* ``split`` is optional (``"train"``, ``"eval"``, or ``"test"`` as an alias of eval);
  rows without one are assigned by a hash of their id (``eval_fraction`` of them to eval),
  which is deterministic and independent of file order.

The prompt asks for the final answer on its own line as ``Answer: <number>``. Rewards:
``correct`` (weight 1.0) compares the marked answer -- or, without a mark, the last number
in the completion -- with the reference at a relative tolerance; ``format`` (weight 0.1)
is 1 when the completion marks an answer the requested way.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

from services.sampler.rollouts.envs.base import Completion, Environment, Example, Reward, Split

DEFAULT_PATH = Path(__file__).with_name("data") / "math_sample.jsonl"

PROMPT_TEMPLATE = (
    "Solve the math problem. Think step by step, then write the final answer "
    "on its own line as 'Answer: <number>'.\n\n"
    "Question: {question}\n"
)

# One number as people write it: optional sign and $, thousands commas, decimals, a/b.
# The comma group needs exactly three digits so a list such as "1,2,3" is three numbers.
_NUM = r"[-−]?\$?\s?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:/\d+(?:\.\d+)?)?"
# Not inside a word or right after a decimal point ("v2", the "5" of ".5" on its own).
_NUMBER_RE = re.compile(r"(?<![\w.])" + _NUM)
# "Answer: 42", "the answer is $42", "#### 42" and \boxed{42}; the last such mark wins.
_MARK_RE = re.compile(
    r"(?:\banswer\s*(?:is|:|=)\s*|####\s*|\\boxed\{\s*)(" + _NUM + ")", re.IGNORECASE
)
# Exactly what the prompt asks for: a line "Answer: <number>" (a trailing period is fine).
_FORMAT_RE = re.compile(
    r"^[ \t]*answer[ \t]*:[ \t]*" + _NUM + r"[ \t]*\.?[ \t]*$", re.IGNORECASE | re.MULTILINE
)


def parse_number(text: str) -> float | None:
    """The value of one number token ("1,234.5", "-$3", "3/4", "−2"), or None."""
    s = (
        text.strip()
        .replace("−", "-")
        .replace("$", "")
        .replace(",", "")
        .replace(" ", "")
        .rstrip("%")
    )
    try:
        if "/" in s:
            num, _, den = s.partition("/")
            value = Fraction(num) / Fraction(den)  # ZeroDivisionError for "1/0"
            return float(value)
        return float(s)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(text: str) -> float | None:
    """The marked answer if there is one, else the last number in the text, else None."""
    marks = _MARK_RE.findall(text)
    for candidate in reversed(marks):
        value = parse_number(candidate)
        if value is not None:
            return value
    for match in reversed(_NUMBER_RE.findall(text)):
        value = parse_number(match)
        if value is not None:
            return value
    return None


def numbers_match(predicted: float | None, reference: float, rel_tol: float = 1e-4) -> bool:
    # abs_tol so that a reference of 0 is not impossible to hit with "0.0".
    return predicted is not None and math.isclose(
        predicted, reference, rel_tol=rel_tol, abs_tol=1e-9
    )


def _split_of(row_id: str, eval_fraction: float) -> Split:
    # A hash, not the row number: adding or reordering rows never moves others across splits.
    bucket = int(hashlib.sha256(row_id.encode()).hexdigest()[:8], 16) / 0x100000000
    return "eval" if bucket < eval_fraction else "train"


def load_problems(path: Path, eval_fraction: float) -> dict[Split, list[dict[str, Any]]]:
    """Parse and validate the JSONL file; every error names the file and line."""
    if not path.is_file():
        raise FileNotFoundError(f"math environment: dataset file not found: {path}")
    splits: dict[Split, list[dict[str, Any]]] = {"train": [], "eval": []}
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})") from None
            if not isinstance(row, dict):  # a data error, so ValueError like the others
                raise ValueError(  # noqa: TRY004
                    f"{where}: expected a JSON object, got {type(row).__name__}"
                )
            missing = [k for k in ("question", "answer") if k not in row]
            if missing:
                raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
            question = row["question"]
            if not isinstance(question, str) or not question.strip():
                raise ValueError(f"{where}: 'question' must be a non-empty string")
            value = (
                parse_number(str(row["answer"])) if not isinstance(row["answer"], bool) else None
            )
            if value is None or not math.isfinite(value):
                raise ValueError(f"{where}: 'answer' must be a number, got {row['answer']!r}")
            row_id = str(row.get("id") or hashlib.sha256(question.encode()).hexdigest()[:12])
            if row_id in seen:
                raise ValueError(f"{where}: duplicate id {row_id!r} (first on line {seen[row_id]})")
            seen[row_id] = lineno
            split = row.get("split")
            if split is None:
                split = _split_of(row_id, eval_fraction)
            elif split == "test":
                split = "eval"
            elif split not in ("train", "eval"):
                raise ValueError(
                    f"{where}: 'split' must be 'train', 'eval' or 'test', got {split!r}"
                )
            splits[split].append(
                {"id": row_id, "question": question, "answer": str(row["answer"]), "value": value}
            )
    if not splits["train"] and not splits["eval"]:
        raise ValueError(f"{path}: no problems in the file")
    return splits


class MathEnv(Environment):
    """Grade-school word problems; the completion must end with 'Answer: <number>'."""

    name = "math"

    def __init__(
        self,
        path: str | Path | None = None,
        eval_fraction: float = 0.2,
        rel_tol: float = 1e-4,
        format_weight: float = 0.1,
        max_tokens: int = 256,
    ) -> None:
        self.path = Path(path) if path else DEFAULT_PATH
        self.rel_tol = float(rel_tol)
        problems = load_problems(self.path, float(eval_fraction))
        self._examples: dict[Split, list[Example]] = {
            split: [self._example(p) for p in rows] for split, rows in problems.items()
        }
        self.rewards = (
            Reward("correct", self._correct, 1.0),
            Reward("format", self._format, float(format_weight)),
        )
        # A base model otherwise runs on into a new "Question:"; the sampler's settings win.
        self.sampling = {"max_tokens": int(max_tokens), "stop": ["\nQuestion:"]}

    def _example(self, problem: dict[str, Any]) -> Example:
        return Example(
            prompt_id=f"{self.name}/{problem['id']}",
            prompt=PROMPT_TEMPLATE.format(question=problem["question"]),
            answer=problem["answer"],
            info={"question": problem["question"], "value": problem["value"]},
        )

    def examples(self, split: Split) -> Sequence[Example]:
        if split not in self._examples:
            raise ValueError(f"unknown split {split!r}: use 'train' or 'eval'")
        return self._examples[split]

    async def _correct(self, example: Example, completion: Completion) -> float:
        return float(
            numbers_match(extract_answer(completion.text), example.info["value"], self.rel_tol)
        )

    async def _format(self, example: Example, completion: Completion) -> float:
        return float(_FORMAT_RE.search(completion.text) is not None)
