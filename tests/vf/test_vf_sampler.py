"""A whole sampler running verifiers environments (`env = verifiers:<taskset-id>`) on the real CPU
server of the tiny model: batches are the traces' tokens, masks and logprobs, token for token
what the server sampled; multi-turn episodes are one branch; evals are greedy."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest
from transformers import AutoTokenizer

from services.inference.testing import running_server
from shared.toolcalls import format_tool_call
from shared.wire import Sample
from tests.support.driver import hold_second_turns, publish_between_turns

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cpu_server(tiny_model):
    with running_server(tiny_model, served_model_name="tiny") as handle:
        yield handle


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def root(handle) -> str:
    return handle.base_url.removesuffix("/v1")


async def server_logprobs(url: str, ids: list[int]) -> list[dict]:
    async with httpx.AsyncClient(timeout=60) as http:
        answer = await http.post(url + "/v1/completions", json={
            "model": "tiny", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0})
    return answer.json()["choices"][0]["prompt_logprobs"]


async def batch(sampler, step: int = 0) -> list[Sample]:
    async with httpx.AsyncClient(base_url=sampler.url, timeout=120) as http:
        response = await http.get("/batch", params={"step": step, "timeout": 120})
        assert response.status_code == 200, response.text
        return [Sample.model_validate(s) for s in response.json()["samples"]]


async def status(sampler) -> dict:
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        return (await http.get("/status")).json()


async def test_single_turn_samples_are_what_the_server_sampled(make_sampler, cpu_server, tokenizer):
    sampler = make_sampler(env="verifiers:tandem-vf-parity", env_args='{"taskset": {"size": 32}}',
                           inference_urls=[root(cpu_server)], prompts_per_step=2, num_generations=4, max_tokens=4)
    samples = await batch(sampler)
    assert len(samples) == 8 and len({s.group_id for s in samples}) == 2
    for s in samples:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": s.prompt_text}], tokenize=False,
                                               add_generation_prompt=True)
        assert s.prompt_token_ids == tokenizer.encode(prompt, add_special_tokens=False)
        assert s.prompt_id.startswith("train:n") and s.env == "verifiers:tandem-vf-parity"
        assert 1 <= len(s.completion_token_ids) <= 4 and s.loss_mask == [1] * len(s.completion_token_ids)
        assert s.finish_reason in ("stop", "length") and s.versions == [0] and s.policy_version == 0
        answer = "eo"[int(s.prompt_text.rsplit(" ", 1)[1]) % 2]
        text = tokenizer.decode(s.completion_token_ids, skip_special_tokens=True)
        assert s.reward == s.rewards["correct"] == float(text.lstrip()[:1] == answer)
        metrics = s.model_extra["metrics"]
        assert metrics.pop(f"turn_finish/{s.finish_reason}") == metrics.pop(f"last_turn_finish/{s.finish_reason}") == 1
        assert metrics == {"reply_chars": float(len(text.strip()))}  # one call: its reason is the sample's
        # Token for token: the behaviour logprobs are the server's logprobs of these very ids.
        rows = await server_logprobs(root(cpu_server), s.prompt_token_ids + s.completion_token_ids)
        start = len(s.prompt_token_ids)
        for i, (token, lp) in enumerate(zip(s.completion_token_ids, s.completion_logprobs)):
            assert math.isclose(lp, rows[start + i][str(token)]["logprob"], abs_tol=1e-5), (i, lp)
    counts = (await status(sampler))["environments"]["verifiers:tandem-vf-parity"]
    assert counts["trajectories"] >= 8 and counts["turns"] == counts["trajectories"] and counts["forks"] == 0


async def test_a_multi_turn_episode_is_one_branch_with_the_envs_turns_masked(make_sampler, cpu_server, tokenizer):
    sampler = make_sampler(env="verifiers:tandem-vf-dialogue", env_args='{"turns": 3}',
                           inference_urls=[root(cpu_server)], prompts_per_step=2, num_generations=2, max_tokens=3)
    samples = await batch(sampler)
    assert len(samples) == 4
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for s in samples:
        text = tokenizer.decode(s.completion_token_ids, skip_special_tokens=False)
        assert text.count("<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n") == 2, text
        # The env's turns are never trained on; every model turn is, as sampled (<= 3 ids each).
        runs = "".join(map(str, s.loss_mask)).split("0")
        assert [len(r) for r in runs if r] and all(len(r) <= 3 for r in runs if r)
        assert sum(len(r) > 0 for r in runs) == 3
        assert all(lp == 0.0 for lp, m in zip(s.completion_logprobs, s.loss_mask) if not m)
        # A turn cut off by max_tokens got the close it did not sample, never a second one.
        assert f"{tokenizer.decode([im_end])}{tokenizer.decode([im_end])}" not in text
        rows = await server_logprobs(root(cpu_server), s.prompt_token_ids + s.completion_token_ids)
        start = len(s.prompt_token_ids)
        for i, (token, lp, m) in enumerate(zip(s.completion_token_ids, s.completion_logprobs, s.loss_mask)):
            if m:
                assert math.isclose(lp, rows[start + i][str(token)]["logprob"], abs_tol=1e-5), (i, lp)
    counts = (await status(sampler))["environments"]["verifiers:tandem-vf-dialogue"]
    assert counts["turns"] == 3 * counts["trajectories"] and counts["forks"] == 0


async def test_eval_is_greedy_over_the_eval_block(make_sampler, cpu_server):
    sampler = make_sampler(env="verifiers:tandem-vf-parity",
                           env_args=json.dumps({"taskset": {"size": 32}, "eval": {"taskset": {"seed": 1, "size": 8}}}),
                           inference_urls=[root(cpu_server)], prompts_per_step=2, num_generations=2, max_tokens=4)
    async with httpx.AsyncClient(base_url=sampler.url, timeout=120) as http:
        results = []
        for _ in range(2):
            eval_id = (await http.post("/eval", json={"num_examples": 8})).json()["eval_id"]
            results.append((await http.get(f"/eval/{eval_id}", params={"timeout": 120})).json())
    for result in results:
        assert result["status"] == "done", result
        assert result["result"]["num_examples"] == 8
    # Greedy: the same weights give the same answers, so the same reward.
    assert results[0]["result"]["reward_mean"] == results[1]["result"]["reward_mean"]


async def test_a_reward_that_raises_is_retried(make_sampler, cpu_server, namespace):
    sampler = make_sampler(env="verifiers:tandem-vf-faults",
                           env_args=json.dumps({"taskset": {"fail_first": 1, "tag": namespace}}),
                           inference_urls=[root(cpu_server)], prompts_per_step=2, num_generations=2, max_tokens=2)
    samples = await batch(sampler)
    assert len(samples) == 4 and all(s.reward == 1.0 for s in samples)
    counts = (await status(sampler))["environments"]["verifiers:tandem-vf-faults"]
    assert counts["trajectory_retries"] >= 4 and counts["groups_dropped"] == 0
    assert "failed on purpose" in counts["last_error"]


async def wait_for_dropped(sampler, env: str) -> dict:
    counts: dict = {}
    for _ in range(600):
        counts = (await status(sampler))["environments"].get(env, {})
        if counts.get("groups_dropped"):
            break
        await asyncio.sleep(0.1)
    return counts


async def test_a_reward_that_always_raises_drops_its_group(make_sampler, cpu_server):
    sampler = make_sampler(env="verifiers:tandem-vf-faults", env_args='{"taskset": {"fail_first": -1}}',
                           inference_urls=[root(cpu_server)], prompts_per_step=1, num_generations=2, max_tokens=2,
                           env_retries=1, max_oversample=0.5)
    counts = await wait_for_dropped(sampler, "verifiers:tandem-vf-faults")
    assert counts["groups_dropped"] >= 1 and counts["env_errors"] >= 2, counts
    assert "failed on purpose" in counts["last_error"]


async def test_a_harness_that_crashes_fails_its_trajectory_not_the_sampler(make_sampler, cpu_server):
    sampler = make_sampler(env="verifiers:tandem-vf-parity",
                           env_args='{"taskset": {"size": 8}, "agent": {"harness": {"id": "tandem-vf-crash"}}}',
                           inference_urls=[root(cpu_server)], prompts_per_step=1, num_generations=2, max_tokens=2,
                           env_retries=1, max_oversample=0.5)
    counts = await wait_for_dropped(sampler, "verifiers:tandem-vf-parity")
    assert counts["groups_dropped"] >= 1, counts
    assert "crashed on purpose" in counts["last_error"], counts
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        assert (await http.get("/health")).status_code == 200


async def test_a_tool_call_runs_on_the_tasksets_tool_server_and_its_answer_is_masked(make_sampler, standin,
                                                                                      byte_tokenizer):
    # The stand-in plays a model that calls `calc_add` then answers with the sum (its tokens are
    # bytes: the sampler renders turns with a byte tokenizer of the same chat template).
    call = format_tool_call("calc_add", {"a": 2, "b": 3})
    httpx.post(standin.url + "/_standin/configure", json={"replies": [call, "5"]}).raise_for_status()
    sampler = make_sampler(env="verifiers:tandem-vf-tools", vf_tokenizer=str(byte_tokenizer), prompts_per_step=1,
                           num_generations=2, max_tokens=128)
    samples = await batch(sampler)
    assert len(samples) == 2
    for s in samples:
        text = bytes(s.completion_token_ids).decode()
        prompt = bytes(s.prompt_token_ids).decode()
        assert '"name": "calc_add"' in prompt  # the tool server's tool, offered in the template's tools block
        tool_turn = "<|im_end|>\n<|im_start|>tool\n"
        assert text.startswith(call) and tool_turn in text, text
        answer_at = text.index(tool_turn) + len(tool_turn)
        assert text[answer_at:].startswith("5<|im_end|>\n<|im_start|>assistant\n5")  # the tool's 2 + 3, then "5"
        # Trained on: the two sampled turns, as sampled; not the tool's answer nor the template's.
        trained = bytes(t for t, m in zip(s.completion_token_ids, s.loss_mask) if m)
        assert trained == (call + "5").encode(), trained
        assert s.model_extra["metrics"] == {"tool_calls": 1.0, "turn_finish/stop": 2.0, "last_turn_finish/stop": 1.0}
    assert all(s.reward == float(s.prompt_text == "add 2 and 3") for s in samples)
    counts = (await status(sampler))["environments"]["verifiers:tandem-vf-tools"]
    assert counts["tool_calls"] == counts["trajectories"] and counts["forks"] == 0


async def test_a_weight_sync_in_the_middle_of_episodes_shows_in_their_versions(make_sampler, byte_tokenizer):
    from tests.support.servers import start_standin

    slow = start_standin(token_latency=0.01)
    sampler = None
    try:
        hold_second_turns(slow.url)
        sampler = make_sampler(env="verifiers:tandem-vf-dialogue", env_args='{"turns": 3}', max_tokens=8,
                               inference_urls=[slow.url], max_staleness=1, vf_tokenizer=str(byte_tokenizer),
                               temperature=0.0, drain_deadline=0)  # at the end, batches still in flight need not seal
        async with httpx.AsyncClient(base_url=sampler.url, timeout=60) as http:
            samples = await publish_between_turns(http, slow.url, timeout=60)
        # Three model turns each (the environment talked back twice).
        assert all(bytes(s["prompt_token_ids"] + s["completion_token_ids"]).decode().count("<|im_start|>user\nagain")
                   == 2 for s in samples)
    finally:
        if sampler is not None:
            sampler.stop()  # first: stopped after its server, its episodes in flight would retry to no end
        slow.stop()


async def test_a_full_context_ends_the_episode_with_finish_reason_length(make_sampler, tiny_model):
    # 160 tokens of context: the dialogue's prompt and a few turns of 8 fill it well before 40 turns.
    with running_server(tiny_model, served_model_name="tiny", max_model_len=160) as small:
        sampler = make_sampler(env="verifiers:tandem-vf-dialogue", env_args='{"turns": 40}',
                               inference_urls=[root(small)], prompts_per_step=1, num_generations=2, max_tokens=8)
        samples = await batch(sampler)
        counts = (await status(sampler))["environments"]["verifiers:tandem-vf-dialogue"]
        async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
            card = (await http.get("/v1/models")).json()["data"][0]
    assert card["id"] == "tiny" and card["max_model_len"] == 160
    for s in samples:
        assert s.finish_reason == "length"
        assert len(s.prompt_token_ids) + len(s.completion_token_ids) <= 160
    assert counts["env_errors"] == 0 and counts["groups_dropped"] == 0


async def test_an_empty_answer_is_a_sample_not_a_fault(make_sampler, standin, byte_tokenizer):
    httpx.post(standin.url + "/_standin/configure", json={"replies": [""]}).raise_for_status()
    sampler = make_sampler(env="verifiers:tandem-vf-parity", vf_tokenizer=str(byte_tokenizer), prompts_per_step=1,
                           num_generations=2, max_tokens=8)
    samples = await batch(sampler)
    assert [s.completion_token_ids for s in samples] == [[], []] and all(s.reward == 0.0 for s in samples)
    assert all(bytes(s.prompt_token_ids).decode().endswith("<|im_start|>assistant\n") for s in samples)
    counts = (await status(sampler))["environments"]["verifiers:tandem-vf-parity"]
    assert counts["env_errors"] == 0 and counts["trajectories"] >= 2
