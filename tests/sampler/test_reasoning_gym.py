"""reasoning-gym built in (issue 43, point 4): `--env reasoning_gym:<dataset>` with the dataset's
config in `--env-args`, scored by the dataset's own `score_answer` on the answer reasoning-gym's
evaluation extracts (the last <answer>...</answer>). Uses the real package; the sampler tests
run a whole sampler on the stand-in with scripted replies."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from services.sampler.rollouts.envs import Completion, EnvironmentLoadError, load_environment
from tests.support.driver import batch_samples

pytest.importorskip("reasoning_gym")  # a guard only: `make install` installs the extra

pytestmark = pytest.mark.timeout(120)

GCD = {"size": 40, "seed": 0, "eval_size": 16}
COMPOSITE = {"size": 30, "seed": 1, "eval_size": 12, "datasets": [
    {"name": "gcd", "weight": 1, "config": {}},
    {"name": "letter_counting", "weight": 2, "config": {"min_words": 3, "max_words": 5}},
]}


def completion(text: str) -> Completion:
    return Completion(text=text, prompt_token_ids=[1], token_ids=[1], logprobs=[0.0], finish_reason="stop")


def score(env, example, text: str) -> float:
    return env.rewards[0].fn(example, completion(text))


# ---------------------------------------------------------------- the environment


def test_the_prompt_is_reasoning_gyms_instruction_and_question_and_the_answer_is_read_from_tags():
    from reasoning_gym.utils import SYSTEM_PROMPTS

    env = load_environment("reasoning_gym:gcd", **GCD)
    example = env.examples("train")[0]
    entry = example.info["entry"]
    assert example.prompt == f"{SYSTEM_PROMPTS['default'].rstrip()}\n\n{entry['question']}\n"
    assert example.answer == entry["answer"]
    right, wrong = entry["answer"], str(int(entry["answer"]) + 1)
    assert score(env, example, f"I think... <answer>{right}</answer>") == 1.0
    assert score(env, example, f"<answer> {right} </answer>") == 1.0
    assert score(env, example, f"<answer>{wrong}</answer>") == 0.0
    # Only the last tagged answer counts; text outside the tags never does.
    assert score(env, example, f"{right} <answer>{wrong}</answer> {right}") == 0.0
    assert score(env, example, f"<answer>{wrong}</answer> then <answer>{right}</answer>") == 1.0
    assert score(env, example, right) == 0.0  # no tags: no answer
    plain = load_environment("reasoning_gym:gcd", **GCD, answer_format="plain", system_prompt="")
    assert plain.examples("train")[0].prompt == entry["question"]
    assert score(plain, plain.examples("train")[0], f" {right}\n") == 1.0


def test_same_examples_twice_and_disjoint_splits():
    a, b = load_environment("reasoning_gym:gcd", **GCD), load_environment("reasoning_gym:gcd", **GCD)
    for split in ("train", "eval"):
        assert [(e.prompt_id, e.prompt, e.answer) for e in a.examples(split)] == \
               [(e.prompt_id, e.prompt, e.answer) for e in b.examples(split)]
    train, eval_ = a.examples("train"), a.examples("eval")
    assert len(train) == 40 and 0 < len(eval_) <= 16
    ids = [e.prompt_id for e in [*train, *eval_]]
    assert len(set(ids)) == len(ids)
    assert not {e.prompt for e in train} & {e.prompt for e in eval_}
    # Without a seed Tandem still fixes one (reasoning-gym alone would draw a random seed).
    unseeded = [load_environment("reasoning_gym:gcd", size=5, eval_size=4) for _ in range(2)]
    assert unseeded[0].examples("train") == unseeded[1].examples("train")
    other = load_environment("reasoning_gym:gcd", **{**GCD, "seed": 7})
    assert [e.prompt for e in other.examples("train")] != [e.prompt for e in train]


def test_a_composite_config_mixes_datasets_and_scores_each_with_its_own_scorer():
    env = load_environment("reasoning_gym:composite", **COMPOSITE)
    train = env.examples("train")
    sources = {e.info["entry"]["metadata"]["source_dataset"] for e in train}
    assert sources == {"gcd", "letter_counting"}
    for example in [*train, *env.examples("eval")]:
        assert score(env, example, f"<answer>{example.answer}</answer>") == 1.0
        assert score(env, example, "<answer>not a number</answer>") == 0.0
    again = load_environment("reasoning_gym:composite", **COMPOSITE)
    assert [e.prompt for e in again.examples("eval")] == [e.prompt for e in env.examples("eval")]


@pytest.mark.parametrize(("name", "args", "needles"), [
    ("reasoning_gym:gcdd", {}, ["reasoning-gym has no dataset 'gcdd'", "e.g. gcd", "sorted(f.DATASETS)"]),
    ("reasoning_gym:gcd", {"sizee": 3}, ["'sizee'", "min_numbers", "eval_size"]),
    ("reasoning_gym:composite", {"size": 5}, ['composite needs "datasets"']),
    ("reasoning_gym:gcd", {"answer_format": "xml"}, ["answer_format must be one of tags, plain"]),
])
def test_bad_settings_are_refused_in_one_line(name, args, needles):
    with pytest.raises(EnvironmentLoadError) as info:
        load_environment(name, **args)
    line = str(info.value)
    assert "\n" not in line and line.startswith(f"environment {name!r}: "), line
    for needle in needles:
        assert needle in line, line


# ---------------------------------------------------------------- through `tandem sampler`


def sampler_command(tmp_path: Path, env: str, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "services.cli", "sampler", "--env", env, "--run-dir", str(tmp_path / "run"),
            "--inference-urls", "http://127.0.0.1:9"]
    environ = dict(os.environ)
    if pythonpath:
        environ["PYTHONPATH"] = os.pathsep.join([pythonpath, environ.get("PYTHONPATH", "")])
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=environ)
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "run").exists()
    return lines[0]


def test_an_unknown_dataset_stops_the_sampler_in_one_line(tmp_path: Path):
    line = sampler_command(tmp_path, "reasoning_gym:no_such_dataset")
    assert line.startswith("tandem sampler: environment 'reasoning_gym:no_such_dataset': reasoning-gym has no "
                           "dataset 'no_such_dataset'"), line


def test_without_the_package_the_sampler_names_the_extra(tmp_path: Path):
    # A stand-in for an uninstalled package, first on the path: importing it fails as a missing one does.
    shadow = tmp_path / "shadow" / "reasoning_gym"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'reasoning_gym'\", name='reasoning_gym')\n")
    line = sampler_command(tmp_path, "reasoning_gym:gcd", pythonpath=str(shadow.parent))
    assert line == ("tandem sampler: environment 'reasoning_gym:gcd': reasoning-gym is not installed "
                    "(reasoning_gym): pip install 'tandem[reasoning-gym]'"), line




@pytest.mark.parametrize("reply", ["<answer>1</answer>", "1 <answer>0</answer> 1"])
async def test_rewards_through_the_sampler_are_the_datasets_scores(make_sampler, standin, reply):
    """gcd's answer is "1" for about a quarter of its questions: the reply "<answer>1</answer>"
    scores 1.0 on exactly those and 0.0 on the rest; with the "1" outside the tags, 0.0 on all."""
    env = load_environment("reasoning_gym:gcd", **GCD)
    answers = {e.prompt_id: e.answer for e in env.examples("train")}
    httpx.post(standin.url + "/_standin/configure", json={"reply": reply}).raise_for_status()
    sampler = make_sampler(env="reasoning_gym:gcd", env_args=GCD, prompts_per_step=8, num_generations=2,
                           max_tokens=64)
    samples = await batch_samples(sampler.url)
    assert len(samples) == 16
    for s in samples:
        right = reply == "<answer>1</answer>" and answers[s.prompt_id] == "1"
        assert s.reward == (1.0 if right else 0.0) and s.rewards == {"correct": s.reward}, (s.prompt_id, s.reward)
    if reply == "<answer>1</answer>":
        assert {s.reward for s in samples} == {0.0, 1.0}, "the batch holds both kinds of question"
