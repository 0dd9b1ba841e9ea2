"""A whole sampler running multi-turn environments on the stand-in: batches seal with one sample
per trajectory (valid `Sample`s, masks and logprobs aligned), an environment that fails for some
prompts costs refills, never a batch, and is counted in /status, /metrics and the dashboard's
data; POST /eval runs whole conversations."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from shared.wire import Sample
from tests.support.driver import hold_second_turns, publish_between_turns

pytestmark = pytest.mark.timeout(90)


async def test_multi_turn_batches_seal_with_one_sample_per_trajectory(make_sampler):
    sampler = make_sampler(env="tests.support.envs:EchoDialogue", env_args='{"max_turns": 3}', max_tokens=4)
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        body = (await http.get("/batch", params={"step": 0, "timeout": 30})).json()
        status = (await http.get("/status")).json()
    assert len(body["samples"]) == 16
    for raw in body["samples"]:
        sample = Sample.model_validate(raw)
        assert len(sample.loss_mask) == len(sample.completion_token_ids) == len(sample.completion_logprobs)
        text = bytes(sample.completion_token_ids).decode()
        assert text.count("<|im_start|>user\nnext ") == 2  # two environment turns between three model turns
        assert sum(sample.loss_mask) <= 12 and sample.reward == 3.0
    counts = status["environments"]["echo_dialogue"]
    # Turns are counted as they happen, trajectories when they end: the next batch's trajectories
    # may be mid-conversation when /status answers (== failed now and then for that reason).
    assert counts["trajectories"] >= 16 and counts["turns"] >= 3 * counts["trajectories"]
    assert status["env_workers"]["size"] == 4


async def test_an_environment_failing_for_some_prompts_costs_refills_not_batches(make_sampler):
    # Odd prompts always fail: their groups are dropped after the retries and refilled.
    sampler = make_sampler(env="tests.support.envs:EchoDialogue", env_args='{"fail": "odd", "max_turns": 2}',
                           max_tokens=4, env_retries=1, max_oversample=8)
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        for step in range(2):
            body = (await http.get("/batch", params={"step": step, "timeout": 30})).json()
            assert len(body["samples"]) == 16
            assert all(int(s["prompt_id"].rsplit("/", 1)[1]) % 2 == 0 for s in body["samples"])
        status = (await http.get("/status")).json()
        metrics = (await http.get("/metrics")).text
    counts = status["environments"]["echo_dialogue"]
    assert counts["groups_dropped"] >= 1 and counts["trajectory_retries"] >= counts["groups_dropped"]
    assert "env broke on echo/train/" in counts["last_error"]
    dropped = next(line for line in metrics.splitlines()
                   if line.startswith('tandem_sampler_env_groups_dropped_total{env="echo_dialogue"}'))
    assert float(dropped.split()[-1]) == counts["groups_dropped"]


async def test_eval_runs_whole_conversations(make_sampler):
    sampler = make_sampler(env="tests.support.envs:EchoDialogue", env_args='{"max_turns": 3}', max_tokens=4)
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        eval_id = (await http.post("/eval", json={"num_examples": 3})).json()["eval_id"]
        result = (await http.get(f"/eval/{eval_id}", params={"timeout": 30})).json()
    assert result["status"] == "done", result
    assert result["result"]["num_examples"] == 3 and result["result"]["reward_mean"] == 3.0  # three turns each


async def test_an_environment_that_always_fails_stops_the_build_with_its_error_not_the_sampler(make_sampler):
    sampler = make_sampler(env="tests.support.envs:EchoDialogue", env_args='{"fail": "always"}', max_tokens=4,
                           env_retries=0, prompts_per_step=2, num_generations=2, max_oversample=0.5)
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        error = None
        for _ in range(200):
            status = (await http.get("/status")).json()
            error = status["steps"]["last_error"]
            if error:
                break
            await asyncio.sleep(0.05)
        assert error and "failed in their environment" in error and "env broke on echo/train/" in error, error
        assert (await http.get("/batch", params={"step": 0, "timeout": 0})).status_code == 204
        assert (await http.get("/health")).status_code == 200  # the sampler itself is fine


async def test_an_eval_asked_for_before_the_inference_server_is_up_waits_for_it(make_sampler):
    from services.inference.standin import create_standin_app
    from tests.support.servers import UvicornThread, free_port

    port = free_port()
    sampler = make_sampler(env="tests.support.envs:EchoDialogue", env_args='{"max_turns": 2}', max_tokens=4,
                           inference_urls=[f"http://127.0.0.1:{port}"])
    late = None
    try:
        async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
            eval_id = (await http.post("/eval", json={"num_examples": 2})).json()["eval_id"]
            await asyncio.sleep(1.0)  # the eval starts while nothing answers on the port
            late = UvicornThread(create_standin_app(), port=port).start()
            result = (await http.get(f"/eval/{eval_id}", params={"timeout": 30})).json()
        assert result["status"] == "done", result
        assert result["result"]["reward_mean"] == 2.0
    finally:
        if late is not None:
            late.stop()


async def test_a_weight_sync_in_the_middle_of_conversations_shows_in_their_versions(make_sampler):
    from tests.support.servers import start_standin

    slow = start_standin(token_latency=0.01)
    try:
        hold_second_turns(slow.url)
        sampler = make_sampler(env="tests.support.envs:EchoDialogue", env_args='{"max_turns": 3}', max_tokens=8,
                               inference_urls=[slow.url], max_staleness=1, temperature=0.0)
        async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
            samples = await publish_between_turns(http, slow.url, timeout=30)
        assert all(len(bytes(s["completion_token_ids"]).decode().split("<|im_start|>user\n")) == 3 for s in samples)
    finally:
        slow.stop()
