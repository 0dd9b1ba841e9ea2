"""Sampling strategies with fixed seeds: replay, batch reuse, dynamic sampling, curriculum,
custom strategies by import path, and cadence."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import httpx
import redis
import pytest

from tests.support.driver import drive
from tests.support.servers import REPO

ENV = "tests.support.envs:CountEnv"


def pool_meta(redis_url: str, namespace: str) -> dict[str, dict]:
    client = redis.Redis.from_url(redis_url)
    raw = client.hgetall(f"tandem:{namespace}:replay:meta")
    client.close()
    return {k.decode(): json.loads(v) for k, v in raw.items()}


@pytest.mark.parametrize("sampling", ["uniform", "recency", "advantage"])
async def test_replay_respects_reuse_and_age_bounds(make_sampler, redis_url, sampling):
    sampler = make_sampler(strategy="replay", replay_sampling=sampling, replay_ratio=0.5, max_reuse=3,
                           max_age=3, prompts_per_step=4, num_generations=2, seed=7)
    ns = sampler.settings.namespace
    batches = await drive(sampler.url, 12, train_seconds=0.01)
    served = Counter()
    replayed = 0
    for step, batch in enumerate(batches):
        samples = batch["samples"]
        assert len(samples) == 8
        for s in samples:
            assert 1 <= s["use_count"] <= 3
            assert step - s["policy_version"] <= 3, (step, s["policy_version"])
            assert s["policy_version"] <= step
        groups = {s["group_id"]: s["use_count"] for s in samples}
        for gid, uses in groups.items():
            served[gid] += 1
            assert served[gid] == uses, "use_count must count the times the group was served"
        replayed += batch["stats"]["replay_groups"]
    assert max(served.values()) <= 3
    assert replayed > 0, "the pool was never drawn from"
    for meta in pool_meta(redis_url, ns).values():
        assert meta["use_count"] < 3


async def test_replay_is_reproducible_with_a_fixed_seed(make_sampler, namespace):
    # k = 0 makes every policy version a function of the step (with k >= 1 it depends on
    # whether the trainer published before generation started), so the pool evolves the same.
    runs = []
    for suffix in ("a", "b"):
        sampler = make_sampler(namespace=namespace + suffix, strategy="replay", replay_ratio=0.5, max_staleness=0,
                               max_reuse=2, max_age=4, seed=11, prompts_per_step=4, num_generations=2)
        batches = await drive(sampler.url, 8)
        runs.append([[(s["group_id"], s["use_count"], s["completion_token_ids"]) for s in b["samples"]]
                     for b in batches])
    assert runs[0] == runs[1]


async def test_replay_capacity_and_newest_per_prompt_retention(make_sampler, redis_url):
    sampler = make_sampler(strategy="replay", replay_ratio=0.5, max_reuse=4, max_age=10, replay_capacity=5,
                           replay_retention="newest_per_prompt", prompts_per_step=4, num_generations=2,
                           env_args={"size": 6})
    await drive(sampler.url, 10)
    pool = pool_meta(redis_url, sampler.settings.namespace)
    assert 0 < len(pool) <= 5
    prompts = [m["prompt_id"] for m in pool.values()]
    assert len(prompts) == len(set(prompts)), "one group per prompt under newest_per_prompt"


async def test_batch_reuse_serves_identical_pairs(make_sampler):
    sampler = make_sampler(num_iterations=2, max_staleness=1)
    batches = await drive(sampler.url, 6, train_seconds=0.01)
    strip = lambda b: [{k: v for k, v in s.items() if k != "use_count"} for s in b["samples"]]  # noqa: E731
    for g in range(3):
        first, second = batches[2 * g], batches[2 * g + 1]
        assert strip(first) == strip(second)
        assert {s["use_count"] for s in first["samples"]} == {1}
        assert {s["use_count"] for s in second["samples"]} == {2}
        assert second["stats"]["reused_from_step"] == 2 * g
        # Staleness is counted against the step that serves the sample.
        step = 2 * g + 1
        expected = sum(step - s["policy_version"] for s in second["samples"]) / len(second["samples"])
        assert second["stats"]["staleness_mean"] == pytest.approx(expected)
    assert len({json.dumps(strip(batches[0])), json.dumps(strip(batches[2]))}) == 2


async def test_batch_reuse_adjusts_the_409_rule(make_sampler):
    sampler = make_sampler(num_iterations=2, max_staleness=0)
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        # Step 1 reuses step 0's samples, so it needs no newer weights than step 0.
        assert (await http.get("/batch", params={"step": 1, "timeout": 20})).status_code == 200
        # Step 2 is a new generation and needs version 2 with k = 0.
        response = await http.get("/batch", params={"step": 2, "timeout": 1})
        assert response.status_code == 409
        assert response.json()["detail"]["required_version"] == 2


async def test_dynamic_sampling_refills_full_batches(make_sampler):
    sampler = make_sampler(env="tests.support.envs:HalfFlatEnv", filter_zero_variance=True, max_oversample=4,
                           prompts_per_step=4, num_generations=4, seed=3)
    batches = await drive(sampler.url, 4)
    dropped = 0
    for batch in batches:
        assert len(batch["samples"]) == 16
        by_group: dict[str, list[float]] = {}
        for s in batch["samples"]:
            by_group.setdefault(s["group_id"], []).append(s["reward"])
        assert len(by_group) == 4
        assert all(max(r) > min(r) for r in by_group.values()), "a zero-variance group was kept"
        assert batch["stats"]["filter_exhausted"] is False
        dropped += batch["stats"]["groups_dropped"]
    assert dropped > 0
    status = httpx.get(sampler.url + "/status").json()
    assert status["dynamic_sampling"]["groups_dropped"] >= dropped
    assert 0 < status["dynamic_sampling"]["drop_rate"] < 1


async def test_dynamic_sampling_terminates_when_nothing_has_variance(make_sampler):
    sampler = make_sampler(env="tests.support.envs:ConstEnv", filter_zero_variance=True, max_oversample=1.5,
                           prompts_per_step=4, num_generations=2)
    batches = await drive(sampler.url, 2)
    for batch in batches:
        assert len(batch["samples"]) == 8  # the batch shape holds
        assert batch["stats"]["filter_exhausted"] is True
        assert batch["stats"]["groups_generated"] == 4 + 6  # 4 slots + floor(1.5 * 4) extra
        assert {s["advantage"] for s in batch["samples"]} == {0.0}


async def test_curriculum_switches_stage_at_the_configured_step(make_sampler):
    curriculum = [{"until_step": 3, "lessons": {ENV: 1.0}},
                  {"lessons": {"tests.support.envs:LetterEnv": 1.0}}]
    sampler = make_sampler(curriculum=curriculum, seed=5)
    batches = await drive(sampler.url, 6)
    for step, batch in enumerate(batches):
        prefixes = {s["prompt_id"].split("/")[0] for s in batch["samples"]}
        assert prefixes == ({"count"} if step < 3 else {"letter"}), (step, prefixes)
    status = httpx.get(sampler.url + "/status").json()["curriculum"]
    assert status["stage"] == 1 and status["weights"] == {"tests.support.envs:LetterEnv": 1.0}
    eval_id = httpx.post(sampler.url + "/eval", json={"num_examples": 2}).json()["eval_id"]
    result = httpx.get(f"{sampler.url}/eval/{eval_id}", params={"timeout": 30}).json()
    assert result["status"] == "done"
    assert set(result["result"]["lessons"]) == {ENV, "tests.support.envs:LetterEnv"}


async def test_curriculum_mixes_lessons_by_weight(make_sampler):
    curriculum = [{"lessons": {ENV: 3.0, "tests.support.envs:LetterEnv": 1.0}}]
    sampler = make_sampler(curriculum=curriculum, prompts_per_step=8, num_generations=1, seed=1)
    batches = await drive(sampler.url, 10)
    counts = Counter(s["prompt_id"].split("/")[0] for b in batches for s in b["samples"])
    assert counts["count"] > counts["letter"] > 0
    assert counts["count"] + counts["letter"] == 80


async def test_a_custom_strategy_plugs_in_by_import_path(make_sampler):
    sampler = make_sampler(strategy="tests.support.strategies:TaggedFresh")
    batches = await drive(sampler.url, 2)
    assert {s["tag"] for s in batches[1]["samples"]} == {"custom-1"}
    assert httpx.get(sampler.url + "/status").json()["strategy"]["name"] == "tagged"


async def test_exactly_one_sampler_iteration_per_optimizer_step(make_sampler, standin):
    sampler = make_sampler(prompts_per_step=3, num_generations=5, max_staleness=1)
    batches = await drive(sampler.url, 5, train_seconds=0.02)
    for batch in batches:
        groups = Counter(s["group_id"] for s in batch["samples"])
        assert len(groups) == 3 and set(groups.values()) == {5}
        assert len({s["prompt_id"] for s in batch["samples"]}) == 3
    # Version 5 is published, so max_staleness 1 lets batch 6 be built too; batch 7 needs
    # version 6. Counted once batch 6 is sealed, its requests are never counted without it.
    assert httpx.get(sampler.url + "/batch", params={"step": 6, "timeout": 30}, timeout=40).status_code == 200
    sealed = httpx.get(sampler.url + "/status").json()["steps"]["sealed_steps"]
    assert sealed == list(range(7))  # at most k = 1 batch ahead of the trainer
    # One completion request (n = num_generations) per group per generated batch.
    requests = httpx.get(standin.url + "/_standin/stats").json()["requests"]
    assert requests == 3 * len(sealed)


def test_inconsistent_cadence_is_refused_naming_the_numbers():
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "sampler", "--prompts-per-step", "8", "--num-generations", "4",
         "--per-device-batch-size", "5", "--grad-accum-steps", "2", "--world-size", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    for number in ("5", "2", "3", "30", "8", "4", "32"):
        assert number in result.stderr
    assert "per_device_batch_size" in result.stderr
