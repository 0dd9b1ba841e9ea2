"""reasoning-gym datasets as a built-in environment: `--env reasoning_gym:<dataset>` (issue 43).

`--env-args` are the dataset's own config, passed to `reasoning_gym.create_dataset(<dataset>,
**env_args)` (its fields: `size`, `seed` and the dataset's own). A composite takes reasoning-gym's
`CompositeConfig` shape: `reasoning_gym:composite` with
``{"datasets": [{"name": "gcd", "weight": 1, "config": {...}}, ...], "size": 100, "seed": 0}``.
Tandem reads a few keys of its own, removed before the config reaches reasoning-gym:

* ``eval_size`` (64) and ``eval_seed`` (``seed + 1000003``): the eval split is a second dataset
  built with the same config and that seed; eval questions that also occur in train are dropped,
  so the splits are disjoint. Without a ``seed`` Tandem uses 0 (reasoning-gym would draw a random
  one), so a restarted sampler rebuilds the same examples.
* ``system_prompt`` (``"default"``): a name in reasoning-gym's ``SYSTEM_PROMPTS`` (``default``,
  ``direct``, ``simple``, ``DeepSeekZero``, ``chain_of_draft``) or the text itself; ``""`` for
  none. The prompt is that text, a blank line and the question, as reasoning-gym's eval sends
  them (system message, then the question).
* ``answer_format`` (``"tags"``): how the answer is read from the completion. ``tags`` is
  reasoning-gym's own evaluation: ``reasoning_gym.utils.extract_answer``, the text of the last
  ``<answer>...</answer>``, and no tags score 0. ``plain``: the whole completion, stripped, is
  the answer; for a model that cannot write tags (the tiny demo model, docs/demo.md).
* ``max_tokens`` (512): the sampling default; the sampler's setting wins.

The reward ``correct`` (weight 1.0) is the dataset's own ``score_answer(answer, entry)``, which
gives partial credit where reasoning-gym does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, is_dataclass
from typing import Any

from services.sampler.rollouts.envs.base import Completion, Environment, Example, Reward, Split

EXTRA = "pip install 'tandem[reasoning-gym]'"
EVAL_SEED_OFFSET = 1_000_003
ANSWER_FORMATS = ("tags", "plain")


def _import() -> Any:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ValueError(f"reasoning-gym is not installed ({exc.name or exc}): {EXTRA}") from None
    return reasoning_gym


def dataset_names() -> list[str]:
    """Every dataset reasoning-gym registers, sorted."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _unknown(name: str) -> ValueError:
    names = dataset_names()
    close = [n for n in names if name and (name in n or n in name)][:5]
    shown = ", ".join(close or names[:8])
    return ValueError(f"reasoning-gym has no dataset {name!r} ({len(names)} exist, e.g. {shown}; list them all with "
                      "python -c 'import reasoning_gym.factory as f; print(sorted(f.DATASETS))')")


def _fields(name: str) -> list[str]:
    from dataclasses import fields

    from reasoning_gym.factory import DATASETS

    return [f.name for f in fields(DATASETS[name][1])]


def _composite_specs(config: dict[str, Any]) -> dict[str, Any]:
    """CompositeConfig wants DatasetSpec objects; JSON gives dicts (as its YAML loader converts)."""
    from reasoning_gym.composite import DatasetSpec

    specs = config.get("datasets")
    if not isinstance(specs, list) or not specs:
        raise ValueError('composite needs "datasets": [{"name": ..., "weight": ..., "config": {...}}, ...]')
    out = []
    for spec in specs:
        if isinstance(spec, dict):
            unknown = set(spec) - {"name", "weight", "config"}
            if unknown:
                raise ValueError(f"composite dataset spec keys are name, weight, config; not {sorted(unknown)}")
            spec = DatasetSpec(name=spec.get("name", ""), weight=spec.get("weight", 1.0), config=dict(spec.get("config") or {}))
        out.append(spec)
    return {**config, "datasets": out}


def _eval_config(dataset: str, config: dict[str, Any], seed: int, size: int) -> dict[str, Any]:
    config = {**config, "seed": seed, "size": size}
    if dataset == "composite":  # a sub-dataset with a seed of its own moves with the eval seed too
        config["datasets"] = [
            {**spec, "config": {**spec["config"], "seed": spec["config"]["seed"] + EVAL_SEED_OFFSET}}
            if isinstance(spec, dict) and isinstance(spec.get("config"), dict) and "seed" in spec["config"] else spec
            for spec in config["datasets"]]
    return config


def _plain(value: Any) -> Any:
    """An entry made JSON-friendly enough to log; the entry itself is kept for scoring."""
    return asdict(value) if is_dataclass(value) and not isinstance(value, type) else value


class ReasoningGymEnv(Environment):
    """One reasoning-gym dataset (or a composite), scored by the dataset's own `score_answer`."""

    def __init__(self, dataset: str, *, eval_size: int = 64, eval_seed: int | None = None,
                 system_prompt: str = "default", answer_format: str = "tags", max_tokens: int = 512,
                 **config: Any) -> None:
        rg = _import()
        from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

        if dataset not in dataset_names():
            raise _unknown(dataset)
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format must be one of {', '.join(ANSWER_FORMATS)}; got {answer_format!r}")
        self.name = f"reasoning_gym:{dataset}"
        self.answer_format = answer_format
        self._extract = extract_answer
        self.system_prompt = SYSTEM_PROMPTS.get(system_prompt, system_prompt)
        config = dict(config)
        config.setdefault("seed", 0)
        seed, eval_size = int(config["seed"]), int(eval_size)
        eval_seed = seed + EVAL_SEED_OFFSET if eval_seed is None else int(eval_seed)
        if eval_size < 1:
            raise ValueError(f"eval_size must be at least 1, got {eval_size}")
        if eval_seed == seed:
            raise ValueError("eval_seed must differ from seed: the eval split would repeat the train split")

        def build(cfg: dict[str, Any]) -> Any:
            if dataset == "composite":
                cfg = _composite_specs(cfg)
            try:
                return rg.create_dataset(dataset, **cfg)
            except TypeError as exc:  # a misspelt config key: say which there are
                raise ValueError(f"{exc}; its config fields are {', '.join(_fields(dataset))}, and Tandem's "
                                 "eval_size, eval_seed, system_prompt, answer_format, max_tokens") from None
            except AssertionError as exc:  # reasoning-gym validates its configs with assert
                raise ValueError(f"invalid config: {exc or 'an assertion in its validate()'}") from None

        self.train_dataset = build(config)
        self.eval_dataset = build(_eval_config(dataset, config, eval_seed, eval_size))
        train = [self._example("train", i, e) for i, e in enumerate(self.train_dataset)]
        seen = {e.info["question"] for e in train}
        eval_ = [self._example("eval", i, e) for i, e in enumerate(self.eval_dataset)
                 if e["question"] not in seen]
        if not train:
            raise ValueError(f"{dataset}: the train split is empty (size {len(self.train_dataset)})")
        if not eval_:
            raise ValueError(f"{dataset}: every eval question also occurs in train (the config allows too few "
                             "distinct questions for disjoint splits)")
        self._examples: dict[Split, list[Example]] = {"train": train, "eval": eval_}
        self.rewards = (Reward("correct", self._correct, 1.0),)
        self.sampling = {"max_tokens": int(max_tokens)}

    def _example(self, split: Split, index: int, entry: dict[str, Any]) -> Example:
        question = str(entry["question"])
        digest = hashlib.sha256(question.encode()).hexdigest()[:8]
        prompt = f"{self.system_prompt.rstrip()}\n\n{question}\n" if self.system_prompt else question
        return Example(prompt_id=f"{self.name}/{split}/{index}-{digest}", prompt=prompt,
                       answer=_plain(entry.get("answer")), info={"question": question, "entry": entry})

    def examples(self, split: Split) -> Sequence[Example]:
        if split not in self._examples:
            raise ValueError(f"unknown split {split!r}: use 'train' or 'eval'")
        return self._examples[split]

    def extract(self, text: str) -> str | None:
        """The answer as reasoning-gym's evaluation reads it (`answer_format` tags), or the text."""
        if self.answer_format == "plain":
            return text.strip()
        return self._extract(text)

    def _score_split(self, example: Example) -> Any:
        return self.eval_dataset if example.prompt_id.startswith(f"{self.name}/eval/") else self.train_dataset

    def _correct(self, example: Example, completion: Completion) -> float:
        # Synchronous: some scorers do real work (parsing, simulation); the sampler runs plain
        # reward functions in its worker threads.
        answer = self.extract(completion.text)
        try:
            return float(self._score_split(example).score_answer(answer, example.info["entry"]))
        except Exception:  # noqa: BLE001 - a scorer that chokes on an answer scores it 0, as in reasoning-gym's eval
            return 0.0
