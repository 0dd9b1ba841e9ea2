"""POST/GET /weights_version: monotonic versions, weight sync on the server, auth."""

from __future__ import annotations

import time

import httpx
import pytest


def test_versions_only_move_forward(make_sampler):
    sampler = make_sampler()
    with httpx.Client(base_url=sampler.url, timeout=30) as http:
        assert http.get("/weights_version").json()["version"] == 0
        assert http.post("/weights_version", json={"version": 3}).json()["version"] == 3
        # The same version again is an idempotent retry, not an error.
        assert http.post("/weights_version", json={"version": 3}).status_code == 200
        lower = http.post("/weights_version", json={"version": 2})
        assert lower.status_code == 409
        assert "lower than the published version 3" in lower.json()["detail"]
        assert http.get("/weights_version").json()["version"] == 3


@pytest.mark.parametrize("body", [{}, {"version": -1}, {"version": "x"}, {"version": 1, "junk": 1}, [1]])
def test_bad_bodies_are_422(make_sampler, body):
    sampler = make_sampler()
    response = httpx.post(sampler.url + "/weights_version", json=body, timeout=30)
    assert response.status_code == 422


def test_checkpoint_sync_runs_the_server_protocol(make_sampler, standin):
    sampler = make_sampler()
    response = httpx.post(sampler.url + "/weights_version",
                          json={"version": 1, "checkpoint_path": "/ckpt/step-0"}, timeout=30)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["version"] == 1 and body["checkpoint_path"] == "/ckpt/step-0"
    assert [s["version"] for s in body["servers"]] == [1]
    stats = httpx.get(standin.url + "/_standin/stats").json()
    assert stats == {**stats, "reloads": ["/ckpt/step-0"], "version": "1", "paused": False}


def test_a_failed_reload_is_a_4xx_and_leaves_no_server_paused(make_sampler, standin):
    sampler = make_sampler()
    response = httpx.post(sampler.url + "/weights_version",
                          json={"version": 1, "checkpoint_path": "/ckpt/does-not-exist"}, timeout=30)
    assert response.status_code == 422
    assert "does-not-exist" in response.json()["detail"]
    assert httpx.get(standin.url + "/is_paused").json()["is_paused"] is False
    weights = httpx.get(sampler.url + "/weights_version").json()
    assert weights["version"] == 0
    assert "reload_weights" in weights["servers"][0]["error"]


def test_an_unreachable_server_does_not_block_a_publication(make_sampler):
    """With k >= 1 the trainer may go on to its next batch while a server is down: the version
    is published, the server is out of rotation, and the fleet loads the checkpoint into it
    once it answers (tests/reliability/test_inference_restarts.py)."""
    sampler = make_sampler(inference_urls=["http://127.0.0.1:9"], resume_deadline=1.0)
    deadline = time.monotonic() + 10
    while httpx.get(sampler.url + "/inference_servers").json()["servers"][0]["state"] != "down":
        assert time.monotonic() < deadline, "the fleet never marked the unreachable server down"
        time.sleep(0.05)
    response = httpx.post(sampler.url + "/weights_version",
                          json={"version": 1, "checkpoint_path": "/ckpt"}, timeout=120)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["version"] == 1
    server = body["servers"][0]
    assert server["url"] == "http://127.0.0.1:9" and server["state"] == "down", server
    assert "127.0.0.1:9" in (server["error"] or server["reason"]), server


def test_mutating_endpoints_need_the_token(make_sampler):
    sampler = make_sampler(api_token="s3cret")
    with httpx.Client(base_url=sampler.url, timeout=30) as http:
        for method, path, body in [("POST", "/weights_version", {"version": 1}), ("POST", "/eval", {})]:
            assert http.request(method, path, json=body).status_code == 401
            wrong = http.request(method, path, json=body, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
            assert "Bearer" in wrong.json()["detail"]
        ok = http.post("/weights_version", json={"version": 1}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        # Reads are closed too (every route but /health and /metrics), and open with the token.
        for path in ("/weights_version", "/status"):
            assert http.get(path).status_code == 401
            assert http.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert http.get("/health").status_code == 200


def test_a_server_labelled_ahead_of_the_run_is_relabelled(make_sampler, standin):
    httpx.post(standin.url + "/update_weight_version", json={"new_version": "9"})
    sampler = make_sampler()
    batch = httpx.get(sampler.url + "/batch", params={"step": 0, "timeout": 20}, timeout=30).json()
    assert {s["policy_version"] for s in batch["samples"]} == {0}
    assert httpx.get(standin.url + "/weight_info").json()["weight_version"] == "0"


async def test_a_sync_cut_off_by_shutdown_still_resumes_the_server(standin, redis_url, namespace):
    # What uvicorn does when a POST /weights_version outlasts the graceful shutdown: cancel
    # the request's task, then run the lifespan's shutdown, which closes the HTTP client.
    import asyncio

    import redis.asyncio as aioredis

    from services.sampler.fleet.inference_pool import InferencePool
    from services.sampler.storage.keys import Keys
    from services.sampler.storage.store import Store
    from services.sampler.fleet.weight_sync import WeightSync
    from shared.http_client import HttpClient

    httpx.post(f"{standin.url}/_standin/configure", json={"reload_delay": 30.0, "resume_delay": 0.5})
    http = HttpClient(max_connections=8, timeout=60)
    pool = InferencePool([standin.url], max_concurrency=4, request_timeout=60, retries=1, http=http)
    redis = aioredis.from_url(redis_url)
    sync = WeightSync(pool, Store(redis, Keys(namespace)))
    try:
        task = asyncio.create_task(sync.sync_server(pool.servers[0], 1, "/nowhere"))
        async with httpx.AsyncClient() as client:
            for _ in range(100):
                if (await client.get(f"{standin.url}/is_paused")).json()["is_paused"]:
                    break
                await asyncio.sleep(0.05)
            assert (await client.get(f"{standin.url}/is_paused")).json()["is_paused"]
            task.cancel()
            await sync.shutdown(10)
            await http.aclose()
            assert not (await client.get(f"{standin.url}/is_paused")).json()["is_paused"]
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await http.aclose()
        await redis.aclose()
        httpx.post(f"{standin.url}/_standin/configure", json={"reload_delay": 0.0, "resume_delay": 0.0})


def test_a_cpu_server_is_synced_in_one_request_without_a_pause(make_sampler, tiny_model, tmp_path):
    """Tandem's CPU server relabels as it reloads (GET /server_info says so): the sampler's sync
    is that one request, so the server is never paused, and it serves and is labelled with the
    version afterwards. (The stand-in, without /server_info, gets pause -> ... -> resume: the test
    above.)"""
    import shutil

    from services.inference.testing import running_server

    checkpoint = tmp_path / "version-1"
    shutil.copytree(tiny_model, checkpoint)
    with running_server(tiny_model, served_model_name="tiny") as cpu:
        sampler = make_sampler(inference_urls=[cpu.url], model_name="tiny")
        for version in (1, 2):
            response = httpx.post(sampler.url + "/weights_version",
                                  json={"version": version, "checkpoint_path": str(checkpoint)}, timeout=60)
            assert response.status_code == 200, response.text
            assert [s["version"] for s in response.json()["servers"]] == [version]
            assert httpx.get(cpu.url + "/weight_info").json() == {"weight_version": str(version)}
        assert cpu.engine.stats["reloads"] == 2 and cpu.engine.stats["pauses"] == 0
        assert not cpu.engine.is_paused


def _trainer_probe(model_dir, token_ids: list[int]) -> dict:
    """What a trainer sends: its own float32 logprobs of `token_ids` under the checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]
    return {"token_ids": token_ids, "logprobs": [None, *logprobs.tolist()], "dtype": "float32"}


def test_a_cpu_server_answers_the_probe_in_its_reload(make_sampler, tiny_model, tmp_path):
    """The CPU server's one-request sync carries the probe too: it is verified (and a wrong one
    refused) without a probe request of its own."""
    import shutil

    from services.inference.testing import running_server

    checkpoint = tmp_path / "version-1"
    shutil.copytree(tiny_model, checkpoint)
    probe = _trainer_probe(checkpoint, [5, 17, 33, 8, 61, 2, 40])
    with running_server(tiny_model, served_model_name="tiny") as cpu:
        asked = []  # prompt logprobs asked for by a request (a probe of its own), not by the reload
        scoring = cpu.engine._prompt_logprobs
        cpu.engine._prompt_logprobs = lambda seq, k: asked.append(seq.prompt_ids) or scoring(seq, k)
        sampler = make_sampler(inference_urls=[cpu.url], model_name="tiny")
        response = httpx.post(sampler.url + "/weights_version",
                              json={"version": 1, "checkpoint_path": str(checkpoint), "probe": probe}, timeout=60)
        assert response.status_code == 200, response.text
        assert [s["version"] for s in response.json()["servers"]] == [1]
        assert cpu.engine.stats["reloads"] == 1 and asked == []

        wrong = {**probe, "logprobs": [None, *(x - 0.5 for x in probe["logprobs"][1:])]}
        response = httpx.post(sampler.url + "/weights_version",
                              json={"version": 2, "checkpoint_path": str(checkpoint), "probe": wrong}, timeout=60)
        assert response.status_code == 422 and "computes the trainer's logprobs" in response.text, response.text
        assert cpu.engine.stats["reloads"] == 2 and asked == []
        assert httpx.get(sampler.url + "/weights_version").json()["version"] == 1
