"""The built-in environments: datasets, splits, rewards, the numeric checker, loading."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from services.sampler.rollouts.envs import Completion, Environment, load_environment
from services.sampler.rollouts.envs.math import DEFAULT_PATH, MathEnv, extract_answer, numbers_match
from services.sampler.rollouts.envs.toy import ToyEnv


def completion(text: str) -> Completion:
    # Token ids and logprobs do not matter to the rewards; the text does.
    return Completion(
        text=text,
        prompt_token_ids=[1, 2, 3],
        token_ids=list(range(len(text))),
        logprobs=[0.0] * len(text),
        finish_reason="length",
    )


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------- toy: dataset


def test_toy_is_deterministic_per_seed():
    a, b, c = ToyEnv(seed=3), ToyEnv(seed=3), ToyEnv(seed=4)
    for split in ("train", "eval"):
        assert a.examples(split) == b.examples(split)
        assert [e.prompt for e in a.examples(split)] != [e.prompt for e in c.examples(split)]


def test_toy_prompt_ids_unique_stable_and_splits_disjoint():
    env = ToyEnv(num_train=500, num_eval=50)
    train, eval_ = env.examples("train"), env.examples("eval")
    assert (len(train), len(eval_)) == (500, 50)
    ids = [e.prompt_id for e in [*train, *eval_]]
    assert len(set(ids)) == len(ids)
    assert all(e.prompt_id == f"toy/train/{e.info['number']}" for e in train)
    assert all(e.prompt_id == f"toy/eval/{e.info['number']}" for e in eval_)
    assert not {e.prompt for e in train} & {e.prompt for e in eval_}
    # Growing the train split keeps every existing prompt and the whole eval split.
    bigger = ToyEnv(num_train=800, num_eval=50)
    assert bigger.examples("eval") == eval_
    assert bigger.examples("train")[:500] == train


def test_toy_prompt_and_answer_by_hand():
    env = ToyEnv()
    for example in [*env.examples("train")[:50], *env.examples("eval")]:
        number = example.prompt.removeprefix("even or odd? ")
        assert example.prompt == f"even or odd? {number}"
        assert example.answer == ("e" if number[-1] in "02468" else "o")
    # Both answers are common, so answering one letter always is worth only about 0.5.
    evens = sum(e.answer == "e" for e in env.examples("train")) / len(env.examples("train"))
    assert 0.4 < evens < 0.6


def test_toy_rejects_bad_sizes_and_coerces_string_args():
    with pytest.raises(ValueError, match="num_train"):
        ToyEnv(num_train=95, num_eval=10, max_digits=2)
    with pytest.raises(ValueError, match="max_digits"):
        ToyEnv(max_digits=0)
    env = ToyEnv(num_train="20", num_eval="5", seed="1")  # as env_args may deliver them
    assert len(env.examples("train")) == 20
    assert env.sampling["max_tokens"] == 4
    with pytest.raises(ValueError, match="split"):
        env.examples("test")


# ---------------------------------------------------------------- toy: rewards


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("o", 1.0),
        ("o\n", 1.0),
        (" o", 1.0),  # a tokenizer may put a space first
        ("odd", 1.0),
        ("o7#x", 1.0),  # credit from the first character: no EOS needed
        ("e", 0.0),
        ("O", 0.0),
        ("7", 0.0),  # echoing the digit, as an untrained tied model does
        ("xo", 0.0),
        ("", 0.0),
        ("   ", 0.0),
    ],
)
async def test_toy_reward_for_odd_number(text, expected):
    env = ToyEnv()
    example = next(e for e in env.examples("eval") if e.prompt.endswith("7"))
    total, by_name = await env.score(example, completion(text))
    assert by_name == {"correct": expected}
    assert total == expected


async def mean_reward(env: Environment, policy) -> float:
    examples = [*env.examples("train"), *env.examples("eval")]
    totals = [(await env.score(e, completion(policy(e))))[0] for e in examples]
    assert all(0.0 <= t <= 1.0 for t in totals)
    return sum(totals) / len(totals)


async def test_toy_random_character_policy_scores_low():
    env = ToyEnv()
    rng = random.Random(1234)
    printable = [chr(c) for c in range(32, 127)]
    score = await mean_reward(env, lambda e: "".join(rng.choice(printable) for _ in range(4)))
    assert score <= 0.2
    # Echoing the last prompt character (what an untrained tied-embedding model does greedily).
    assert await mean_reward(env, lambda e: e.prompt[-1]) == 0.0
    # Collapsing to one letter is far from the >= 0.8 a trained model should reach.
    assert 0.4 < await mean_reward(env, lambda e: "e") < 0.6
    assert await mean_reward(env, lambda e: "e" if int(e.prompt[-1]) % 2 == 0 else "o") == 1.0


# ---------------------------------------------------------------- math: dataset


def test_math_sample_file_loads_with_disjoint_stable_splits():
    env = MathEnv()
    train, eval_ = env.examples("train"), env.examples("eval")
    assert 40 <= len(train) + len(eval_) <= 60 and len(eval_) >= 8
    ids = [e.prompt_id for e in [*train, *eval_]]
    assert len(set(ids)) == len(ids) and all(i.startswith("math/") for i in ids)
    assert not {e.prompt for e in train} & {e.prompt for e in eval_}
    assert MathEnv(path=str(DEFAULT_PATH)).examples("eval") == eval_
    first = json.loads(DEFAULT_PATH.read_text().splitlines()[0])
    example = next(e for e in [*train, *eval_] if e.prompt_id == f"math/{first['id']}")
    assert first["question"] in example.prompt and "Answer: <number>" in example.prompt
    assert example.answer == first["answer"]


def test_math_every_sample_answer_parses():
    for line in DEFAULT_PATH.read_text().splitlines():
        row = json.loads(line)
        assert numbers_match(extract_answer(f"Answer: {row['answer']}"), float(row["answer"])), row


def test_math_split_by_hash_when_rows_have_none(tmp_path):
    rows = [json.dumps({"question": f"What is {i} plus 1?", "answer": i + 1}) for i in range(200)]
    env = MathEnv(path=write_jsonl(tmp_path / "a.jsonl", rows), eval_fraction=0.25)
    eval_ids = {e.prompt_id for e in env.examples("eval")}
    assert 30 <= len(eval_ids) <= 70  # about a quarter of 200
    assert len(env.examples("train")) + len(eval_ids) == 200
    # Reordering the file moves no problem across splits and renames none.
    shuffled = MathEnv(path=write_jsonl(tmp_path / "b.jsonl", rows[::-1]), eval_fraction=0.25)
    assert {e.prompt_id for e in shuffled.examples("eval")} == eval_ids


# ---------------------------------------------------------------- math: rewards


@pytest.mark.parametrize(
    ("text", "correct", "fmt"),
    [
        ("14 trays x 12 rolls = 168 rolls.\nAnswer: 168", 1.0, 1.0),
        ("Answer: 168.", 1.0, 1.0),
        ("Answer: 1,680", 0.0, 1.0),  # well formed but wrong
        ("14 x 12 = 168", 1.0, 0.0),  # right number, not in the requested form
        ("Answer: 168\nCheck: 14 x 12", 1.0, 1.0),  # the marked answer wins over later numbers
        ("Answer: 167\nor maybe 168", 0.0, 1.0),
        ("The answer is 168", 1.0, 0.0),
        ("I do not know.", 0.0, 0.0),
        ("", 0.0, 0.0),
    ],
)
async def test_math_rewards(text, correct, fmt):
    env = MathEnv()
    example = next(e for e in env.examples("train") if e.prompt_id == "math/m001")
    assert example.answer == "168"
    total, by_name = await env.score(example, completion(text))
    assert by_name == {"correct": correct, "format": fmt}
    assert total == pytest.approx(correct + 0.1 * fmt)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("Answer: 1,200", 1200.0),
        ("so the tank holds 1,234,567.5 litres", 1234567.5),
        ("Answer: -7", -7.0),
        ("Answer: \u22127", -7.0),  # a typographic minus
        ("It costs $8.55.", 8.55),
        ("Answer: -$45", -45.0),
        ("Answer: 24.0", 24.0),
        ("Answer: 3/4", 0.75),
        ("about .5 of it", 0.5),
        ("#### 42", 42.0),
        ("\\boxed{12}", 12.0),
        ("A 25% rise", 25.0),
        ("1,2,3", 3.0),  # a list, not a thousands separator
        ("version v2 gives 9", 9.0),
        ("no digits here", None),
    ],
)
def test_extract_answer(text, value):
    assert extract_answer(text) == (None if value is None else pytest.approx(value))


def test_numbers_match_tolerance_and_fractions():
    assert numbers_match(extract_answer("0.75"), extract_answer("3/4"))
    assert numbers_match(24.0, 24)
    assert numbers_match(0.333333, 1 / 3)
    assert not numbers_match(0.33, 1 / 3)
    assert not numbers_match(-7, 7)
    assert numbers_match(0.0, 0)
    assert not numbers_match(None, 0)


# ---------------------------------------------------------------- math: bad files


@pytest.mark.parametrize(
    ("lines", "bad_line", "message"),
    [
        (
            ['{"id": "a", "question": "q?", "answer": 1}', '{"id": "b", "question": '],
            2,
            "invalid JSON",
        ),
        (['{"id": "a", "question": "q?"}'], 1, "missing field"),
        (['{"id": "a", "answer": 3}'], 1, "question"),
        (['{"id": "a", "question": "q?", "answer": "forty"}'], 1, "'answer' must be a number"),
        (
            [
                '{"id": "a", "question": "q?", "answer": 1}',
                '{"id": "a", "question": "r?", "answer": 2}',
            ],
            2,
            "duplicate id",
        ),
        (['{"id": "a", "question": "q?", "answer": 1, "split": "dev"}'], 1, "split"),
        (["[1, 2]"], 1, "JSON object"),
        (['{"id": "a", "question": "q?", "answer": 1}', "", "not json"], 3, "invalid JSON"),
    ],
)
def test_math_bad_jsonl_names_file_and_line(tmp_path, lines, bad_line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError, match=message) as info:
        MathEnv(path=path)
    assert f"{path}:{bad_line}:" in str(info.value)


def test_math_missing_or_empty_file(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        MathEnv(path=missing)
    with pytest.raises(ValueError, match="no problems"):
        MathEnv(path=write_jsonl(tmp_path / "empty.jsonl", ["", "  "]))


# ---------------------------------------------------------------- loading


def test_load_environment_by_builtin_name_and_import_path(tmp_path):
    toy = load_environment("toy", num_train=10, num_eval=4)
    assert isinstance(toy, ToyEnv) and len(toy.examples("train")) == 10
    assert isinstance(load_environment("math"), MathEnv)
    path = write_jsonl(
        tmp_path / "p.jsonl", ['{"id": "x", "question": "1+1?", "answer": 2, "split": "eval"}']
    )
    custom = load_environment("services.sampler.rollouts.envs.math:MathEnv", path=str(path))
    assert [e.prompt_id for e in custom.examples("eval")] == ["math/x"]
    assert load_environment("services.sampler.rollouts.envs.toy:ToyEnv", seed=5).examples("eval") == ToyEnv(
        seed=5
    ).examples("eval")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no-such-env", "unknown environment"),
        ("no_such_package.module:Env", "cannot load"),
        ("services.sampler.rollouts.envs.toy:NoSuchFactory", "cannot load"),
        ("random:Random", "not an Environment"),
    ],
)
def test_load_environment_errors(name, message):
    with pytest.raises(ValueError, match=message):
        load_environment(name)
