"""Non-finite numbers never travel: NaN or infinite rewards never reach a batch or an eval
mean, null or non-finite behaviour logprobs never reach the loss; each is counted and logged."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI, Request, Response
from prometheus_client.parser import text_string_to_metric_families

from services.sampler.rollouts.envs.base import Example
from services.sampler.fleet.inference_pool import OK, InferencePool
from services.sampler.rollouts.completions import parse_completions
from services.sampler.rollouts.rollout import Rollouts, nonfinite_rewards
from shared.http_client import HttpClient
from tests.sampler.nonfinite_envs import NanEnv
from tests.support.driver import drive
from tests.support.servers import UvicornThread

NAN_ENV = "tests.sampler.nonfinite_envs:NanEnv"


def metric(url: str, name: str, **labels: str) -> float:
    """The `_total` sample of counter `name` with these labels (a subset match); 0 if absent."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name + "_total" and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def finite(value: float) -> bool:
    return isinstance(value, float) and math.isfinite(value)


# ---------------------------------------------------------------- rewards, end to end


async def test_nan_rewards_never_reach_a_batch(make_sampler, caplog):
    caplog.set_level(logging.WARNING, logger="tandem.sampler")
    sampler = make_sampler(env=NAN_ENV, prompts_per_step=4, num_generations=4, seed=5)
    batches = await drive(sampler.url, 3)
    dropped = 0
    for batch in batches:
        samples = batch["samples"]
        assert len(samples) == 16  # the batch shape holds
        assert len({s["group_id"] for s in samples}) == 4
        for s in samples:
            assert finite(s["reward"]) and finite(s["advantage"]), s
            assert all(finite(v) for v in s["rewards"].values()), s
            assert int(s["prompt_id"].rsplit("/", 1)[1]) % 3 != 0, "a prompt with a broken reward was kept"
        stats = batch["stats"]
        assert finite(stats["reward_mean"]) and finite(stats["reward_std"])
        assert all(finite(v) for v in stats["rewards_mean"].values())
        dropped += stats["groups_nonfinite"]
    assert dropped > 0, "no prompt with a broken reward was drawn: pick another seed"

    url = sampler.url
    assert metric(url, "tandem_sampler_nonfinite_rewards", env="nan", split="train") >= 4 * dropped
    assert metric(url, "tandem_sampler_nonfinite_groups_dropped", env="nan") >= dropped
    status = httpx.get(f"{url}/status", timeout=10).json()
    assert status["nonfinite"]["rewards"]["nan"]["train"] >= 4 * dropped
    assert status["nonfinite"]["groups_dropped"]["nan"] >= dropped
    assert status["dynamic_sampling"]["groups_nonfinite"] >= dropped

    warnings = [r.getMessage() for r in caplog.records
                if r.name == "tandem.sampler.rollout" and r.levelno == logging.WARNING]
    assert len(warnings) >= dropped  # one per dropped group
    message = warnings[0]
    assert "environment 'nan'" in message and "prompt count/train/" in message
    assert "nan" in message.split("rewards are not finite", 1)[1] or "inf" in message
    assert "Fix the environment's reward function" in message


def test_a_reward_function_that_only_returns_nan_fails_the_build_clearly(make_sampler):
    sampler = make_sampler(env="tests.sampler.nonfinite_envs:AllNanEnv", prompts_per_step=2, num_generations=2,
                           max_oversample=0.5)
    deadline = time.monotonic() + 20
    error = None
    while time.monotonic() < deadline:
        error = httpx.get(f"{sampler.url}/status", timeout=10).json()["steps"]["last_error"]
        if error:
            break
        time.sleep(0.1)
    assert error and "non-finite rewards" in error and "allnan" in error, error
    assert "fix the reward function" in error
    # Never a batch with NaNs in it.
    assert httpx.get(f"{sampler.url}/batch", params={"step": 0, "timeout": 0}, timeout=10).status_code == 204
    assert metric(sampler.url, "tandem_sampler_nonfinite_rewards", env="allnan", split="train") > 0


def test_an_eval_leaves_nonfinite_rewards_out_of_its_means(make_sampler, caplog):
    caplog.set_level(logging.WARNING, logger="tandem.sampler")
    sampler = make_sampler(env=NAN_ENV)
    with httpx.Client(base_url=sampler.url, timeout=60) as http:
        eval_id = http.post("/eval", json={"num_examples": 6}).json()["eval_id"]
        record = http.get(f"/eval/{eval_id}", params={"timeout": 30}).json()
    assert record["status"] == "done", record
    result = record["result"]
    # Eval examples 0 (NaN) and 3 (inf) are left out; 1, 2, 4, 5 score 1 + 0.5 (greedy "01234567").
    assert result["num_examples"] == 6 and result["nonfinite_rewards"] == 2
    assert result["reward_mean"] == 1.5 and result["reward_std"] == 0.0
    assert result["rewards_mean"] == {"digit": 1.0, "score": 1.0}
    assert [e["reward"] for e in result["examples"]] == [None, 1.5, 1.5, None, 1.5, 1.5]
    assert metric(sampler.url, "tandem_sampler_nonfinite_rewards", env="nan", split="eval") == 2
    warnings = [r.getMessage() for r in caplog.records if r.name == "tandem.sampler.evals"]
    assert len(warnings) == 1
    assert "prompt count/eval/0" in warnings[0] and "prompt count/eval/3" in warnings[0]
    assert "nan" in warnings[0] and "inf" in warnings[0] and "reward function" in warnings[0]


def test_nonfinite_rewards_finds_totals_and_parts():
    rewards = [1.0, float("nan"), 0.5, 2.0, float("-inf")]
    parts = [{"a": 1.0}, {"a": 1.0}, {"a": float("inf")}, {}, {"a": 0.0}]
    assert nonfinite_rewards(rewards, parts) == [1, 2, 4]
    assert nonfinite_rewards([0.0, -9999.0], [{"a": 0.0}, {"a": -9999.0}]) == []


# ---------------------------------------------------------------- logprobs


def _choice(index, logprobs):
    return {"index": index, "text": "x" * len(logprobs), "token_ids": list(range(5, 5 + len(logprobs))),
            "prompt_token_ids": [1, 2], "logprobs": {"token_logprobs": logprobs}, "finish_reason": "stop"}


def test_null_and_nonfinite_logprobs_are_masked_not_read_as_zero():
    body = {"choices": [
        _choice(0, [-0.5, None, -0.25]),
        # Non-finite floats, as a JSON decoder that accepts NaN and Infinity would hand them over.
        _choice(1, [float("nan"), -1.0, float("inf"), float("-inf")]),
        _choice(2, [-0.1, -9999.0]),  # vLLM's -inf is a finite -9999.0: it passes
    ]}
    first, second, third = parse_completions(body, served_version=0)
    assert first.logprobs == [-0.5, 0.0, -0.25] and first.loss_mask == [1, 0, 1]
    assert second.logprobs == [0.0, -1.0, 0.0, 0.0] and second.loss_mask == [0, 1, 0, 0]
    assert third.logprobs == [-0.1, -9999.0] and third.loss_mask is None
    for completion in (first, second, third):
        assert all(type(x) is float and math.isfinite(x) for x in completion.logprobs)


def _fake_vllm(logprobs: list) -> FastAPI:
    """A /v1/completions server whose every choice has these token logprobs."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": [{"id": "fake"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        n = (await request.json()).get("n", 1)
        body = {"choices": [_choice(i, logprobs) for i in range(n)]}
        return Response(json.dumps(body), media_type="application/json")

    return app


@pytest.fixture
def bad_logprob_server() -> Iterator[UvicornThread]:
    # Over HTTP only null can arrive: the sampler's JSON decoder (orjson) refuses NaN and Infinity.
    server = UvicornThread(_fake_vllm([-0.5, None, None, -0.25])).start()
    yield server
    server.stop()


def _rollouts(url: str, env=None) -> Rollouts:
    pool = InferencePool([url], max_concurrency=4, request_timeout=10, retries=0,
                         http=HttpClient(max_connections=4, timeout=10))
    for server in pool.servers:
        pool.set_version(server.url, 0)
        pool.set_state(server, OK)
    return Rollouts(env or NanEnv(), pool, prompts_per_step=1, num_generations=2, sampling={}, seed=0,
                    advantage="grpo", model_name=None)


async def test_bad_logprobs_are_masked_in_samples_counted_and_logged(bad_logprob_server, caplog):
    caplog.set_level(logging.WARNING, logger="tandem.sampler")
    url = bad_logprob_server.url
    rollouts = _rollouts(url)
    try:
        completions = await rollouts.generate("count 1", n=2)
        assert [c.loss_mask for c in completions] == [[1, 0, 0, 1]] * 2
        assert rollouts.nonfinite.logprobs == {url: 4}
        # The mask travels into the samples, with finite logprobs.
        group = await rollouts.group(Example("count/train/1", "count 1", answer=1), "s0-g0", min_version=0, seed=1)
        assert group.invalid is None
        for sample in group.samples("nan"):
            assert sample["loss_mask"] == [1, 0, 0, 1]
            assert sample["completion_logprobs"] == [-0.5, 0.0, 0.0, -0.25]
        assert rollouts.nonfinite.logprobs == {url: 8}
        assert rollouts.nonfinite.snapshot()["logprobs_masked"] == {url: 8}
    finally:
        await rollouts.pool.http.aclose()
    warnings = [r.getMessage() for r in caplog.records if r.name == "tandem.sampler.rollout"]
    assert len(warnings) == 1, warnings  # at most one a minute per server
    assert url in warnings[0] and "4 of 8 token logprobs" in warnings[0] and "loss_mask 0" in warnings[0]


async def test_a_group_with_a_nan_reward_is_marked_and_cannot_become_samples(bad_logprob_server, caplog):
    caplog.set_level(logging.WARNING, logger="tandem.sampler")
    rollouts = _rollouts(bad_logprob_server.url)
    try:
        group = await rollouts.group(Example("count/train/6", "count 6", answer=6), "s0-g3", min_version=0, seed=1)
    finally:
        await rollouts.pool.http.aclose()
    assert group.invalid and "2 of 2 rewards are not finite" in group.invalid
    assert group.advantages == [0.0, 0.0]
    assert rollouts.nonfinite.rewards == {("nan", "train"): 2}
    assert rollouts.nonfinite.groups == {"nan": 1}
    with pytest.raises(ValueError, match="cannot become samples"):
        group.samples("nan")
    [warning] = [r.getMessage() for r in caplog.records
                 if r.name == "tandem.sampler.rollout" and "reward" in r.getMessage()]
    assert "environment 'nan', prompt count/train/6 (group s0-g3)" in warning
    assert "reward nan" in warning and "'score': nan" in warning
