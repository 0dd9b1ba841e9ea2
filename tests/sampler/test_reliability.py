"""Sampler fault handling: replicas, stalled generation, Redis outages, big bodies, shutdown."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from shared.token_guard import bearer_headers
from tests.support.driver import drive


async def test_two_replicas_split_steps_without_duplicates(make_sampler, standin):
    a = make_sampler(prompts_per_step=2, num_generations=2, claim_ttl=2)
    b = make_sampler(prompts_per_step=2, num_generations=2, claim_ttl=2)
    # The trainer alternates between replicas: both serve the same run.
    batches = []
    async with httpx.AsyncClient(timeout=30) as http:
        for step in range(10):
            url = (a, b)[step % 2].url
            response = await http.get(f"{url}/batch", params={"step": step, "timeout": 20})
            assert response.status_code == 200
            batches.append(response.json())
            other = (b, a)[step % 2].url
            assert (await http.get(f"{other}/batch", params={"step": step})).content == response.content
            await http.post(f"{url}/weights_version", json={"version": step + 1})
        await asyncio.sleep(0.5)  # let a batch in flight finish
        statuses = [(await http.get(f"{s.url}/status")).json() for s in (a, b)]
    sealed_steps = statuses[0]["steps"]["sealed_steps"]
    assert sealed_steps == statuses[1]["steps"]["sealed_steps"]
    # No step was generated twice: one request (n = 2) per group of each sealed step.
    requests = httpx.get(standin.url + "/_standin/stats").json()["requests"]
    generated = max(sealed_steps) + 1  # steps 0..max were sealed (older ones trimmed since)
    assert requests == 2 * generated, (requests, sealed_steps)
    assert sum(s["steps"]["sealed_since_start"] for s in statuses) == generated


async def test_a_killed_replicas_claims_are_taken_over(make_sampler, standin):
    httpx.post(standin.url + "/pause")  # the first replica will claim steps 0 and 1 and hang
    a = make_sampler(claim_ttl=1)
    await asyncio.sleep(0.5)
    a.server.force_exit = True  # die without draining or releasing claims
    a.stop()
    httpx.post(standin.url + "/resume")
    b = make_sampler(claim_ttl=1)
    started = time.monotonic()
    batches = await drive(b.url, 3)
    assert [x["step"] for x in batches] == [0, 1, 2]
    assert time.monotonic() - started < 15


async def test_stalled_generation_is_a_503_naming_the_cause(make_sampler):
    sampler = make_sampler(inference_urls=["http://127.0.0.1:9"], generation_deadline=1, request_retries=0,
                           request_timeout=2)
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        deadline = time.monotonic() + 20
        while True:
            response = await http.get("/batch", params={"step": 0, "timeout": 1})
            if response.status_code == 503 or time.monotonic() > deadline:
                break
            assert response.status_code == 204
        assert response.status_code == 503
        assert "127.0.0.1:9" in response.json()["detail"]


@pytest.mark.parametrize("batch_2", ["sealed", "building"])
async def test_a_stall_names_the_version_the_next_step_needs(make_sampler, standin, batch_2):
    """The only server dies, then version 2 is published, with batch 2 sealed or still being
    built: batch 3 needs version 2, and its 503 must say so (not the version of batch 2)."""
    sampler = make_sampler(max_staleness=1, generation_deadline=1, server_check_interval=0.3, request_retries=0,
                           request_timeout=2)
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        for step in (0, 1):  # both built from version 0
            assert (await http.get("/batch", params={"step": step, "timeout": 20})).status_code == 200
        if batch_2 == "building":
            httpx.post(f"{standin.url}/_standin/configure", json={"hung": True})
        assert (await http.post("/weights_version", json={"version": 1})).status_code == 200
        if batch_2 == "sealed":
            assert (await http.get("/batch", params={"step": 2, "timeout": 20})).status_code == 200
        else:
            deadline = time.monotonic() + 20
            while 2 not in [p["step"] for p in (await http.get("/status")).json()["steps"]["in_progress"]]:
                assert time.monotonic() < deadline, "batch 2 never started"
                await asyncio.sleep(0.05)
        standin.stop()
        assert (await http.post("/weights_version", json={"version": 2, "checkpoint_path": "/ckpt/2"})).status_code == 200
        deadline = time.monotonic() + 30
        while True:
            response = await http.get("/batch", params={"step": 3, "timeout": 1})
            if response.status_code != 204 or time.monotonic() > deadline:
                break
        assert response.status_code == 503, response.text
        detail = response.json()["detail"]
        assert "batch 3" in detail and "version >= 2" in detail and standin.url in detail, detail
        assert (await http.get("/status")).json()["steps"]["next_step"] == 3


async def test_generation_resumes_when_the_server_comes_back(make_sampler, standin):
    httpx.post(standin.url + "/_standin/fail", params={"count": 12})
    sampler = make_sampler(request_retries=1, prompts_per_step=2, num_generations=2)
    batches = await drive(sampler.url, 2)
    assert len(batches) == 2
    status = httpx.get(sampler.url + "/status").json()
    assert status["throughput"]["errors"] >= 1


def test_oversized_bodies_are_413(make_sampler):
    sampler = make_sampler(max_body_bytes=2048)
    big = {"version": 1, "checkpoint_path": "x" * 5000}
    response = httpx.post(sampler.url + "/weights_version", json=big)
    assert response.status_code == 413
    assert "2048" in response.json()["detail"]

    def chunks():
        for _ in range(10):
            yield b"x" * 1000

    streamed = httpx.post(sampler.url + "/eval", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413
    assert httpx.get(sampler.url + "/weights_version").json()["version"] == 0


async def test_redis_outage_is_503_then_recovers(tmp_path, make_sampler):
    from tests.support.servers import start_redis

    proc, url = start_redis(tmp_path / "outage")
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    sampler = make_sampler(redis_url=url)
    assert httpx.get(sampler.url + "/batch", params={"step": 0, "timeout": 20}, timeout=30).status_code == 200
    proc.kill()
    response = httpx.get(sampler.url + "/batch", params={"step": 0}, timeout=30)
    assert response.status_code == 503
    assert "Redis" in response.json()["detail"]
    proc2, _ = start_redis(tmp_path / "outage", port=port)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            again = httpx.get(sampler.url + "/batch", params={"step": 0}, timeout=30)
            if again.status_code == 200:
                break
            await asyncio.sleep(0.2)
        assert again.status_code == 200  # AOF brought the sealed batch back
    finally:
        proc2.terminate()


async def test_a_redis_outage_is_a_state_not_a_crash_loop(tmp_path, make_sampler, caplog):
    """While Redis is down every loop waits quietly: one warning, one recovery line, no traceback,
    and /health, /status and /metrics answer (from memory) and say what is wrong."""
    import logging

    from tests.support.servers import start_redis

    caplog.set_level(logging.INFO)
    proc, url = start_redis(tmp_path / "outage", appendfsync="always")
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    # With the run's token, as a run is started (without one the sampler warns at start-up, and
    # any warning but the outage's two would fail the check below).
    sampler = make_sampler(redis_url=url, server_check_interval=0.5, api_token="outage-token")
    with httpx.Client(base_url=sampler.url, timeout=30, headers=bearer_headers("outage-token")) as http:
        assert http.get("/batch", params={"step": 0, "timeout": 20}).status_code == 200
        assert http.get("/health").json() == {"status": "ok", "problems": []}
        proc.kill()
        # Long enough for every loop to fail several times over: the producer re-plans every 2 s,
        # the fleet checks every 0.5 s, the link looks every 0.2 s while Redis is down.
        await asyncio.sleep(5)
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
        assert f"127.0.0.1:{port}" in health.json()["problems"][0] and "unreachable" in health.json()["problems"][0]
        status = http.get("/status")
        assert status.status_code == 200, status.text
        redis_state = status.json()["redis"]
        assert redis_state["state"] == "unreachable" and redis_state["down_seconds"] >= 4, redis_state
        assert status.json()["steps"]["sealed_steps"] is None  # lives in Redis: unknown, not invented
        metrics = http.get("/metrics")
        assert metrics.status_code == 200 and "tandem_sampler_redis_up 0.0" in metrics.text
        busy = http.get("/batch", params={"step": 1})
        assert busy.status_code == 503 and "unreachable for" in busy.json()["detail"], busy.text
        proc2, _ = start_redis(tmp_path / "outage", port=port, appendfsync="always")
        try:
            deadline = time.monotonic() + 20
            while http.get("/health").json()["status"] != "ok":
                assert time.monotonic() < deadline, "the sampler did not see Redis come back"
                await asyncio.sleep(0.1)
            assert http.post("/weights_version", json={"version": 1}).status_code == 200
            assert http.get("/batch", params={"step": 1, "timeout": 20}).status_code == 200
            assert http.get("/status").json()["redis"]["outages"] == 1
            records = list(caplog.records)
        finally:
            proc2.terminate()
    ours = [r for r in records if r.name.startswith("tandem")]
    down = [r for r in ours if "is unreachable" in r.getMessage()]
    back = [r for r in ours if "answers again" in r.getMessage()]
    assert len(down) == 1 and len(back) == 1, [r.getMessage() for r in ours if r.levelno >= logging.WARNING]
    tracebacks = [r.getMessage() for r in ours if r.exc_info]
    assert tracebacks == [], tracebacks
    noisy = [r.getMessage() for r in ours if r.levelno >= logging.WARNING and r not in down + back
             and "appendfsync" not in r.getMessage()]
    assert noisy == [], noisy


@pytest.mark.parametrize("timeout", [30])
def test_sigterm_ends_long_polls_at_once_and_drains(run_dir, standin, timeout):
    from tests.support.servers import kill_embedded_redis, start_sampler_process

    sampler = start_sampler_process(run_dir, inference_urls=[standin.url], env="tests.support.envs:CountEnv",
                                    prompts_per_step=2, num_generations=2, max_staleness=0)
    url = sampler.url
    try:
        assert httpx.get(f"{url}/batch", params={"step": 0, "timeout": 20}, timeout=30).status_code == 200
        with httpx.Client(timeout=60) as http:
            import threading

            result = {}

            def poll():
                # Step 1 needs version 1 with k = 0: this poll waits until the sampler stops.
                result["response"] = http.get(f"{url}/batch", params={"step": 0 + 1, "timeout": timeout})

            httpx.post(f"{url}/weights_version", json={"version": 1})
            httpx.post(standin.url + "/pause")  # batch 1 is now in flight and stuck
            thread = threading.Thread(target=poll)
            thread.start()
            time.sleep(0.5)
            started = time.monotonic()
            sampler.popen.send_signal(15)
            time.sleep(0.5)
            httpx.post(standin.url + "/resume")  # the drain lets batch 1 seal
            thread.join(30)
            rc = sampler.popen.wait(30)
            assert time.monotonic() - started < 15
            assert rc in (0, -15)
            assert result["response"].status_code in (200, 503)
    finally:
        sampler.terminate()
    # The drained batch was sealed and survives the restart.
    sampler = start_sampler_process(run_dir, inference_urls=[standin.url], env="tests.support.envs:CountEnv",
                                    prompts_per_step=2, num_generations=2, max_staleness=0)
    try:
        assert httpx.get(f"{sampler.url}/batch", params={"step": 1, "timeout": 0}, timeout=30).status_code == 200
        assert httpx.get(standin.url + "/is_paused").json()["is_paused"] is False
    finally:
        sampler.terminate()
        kill_embedded_redis(run_dir)


def test_shutdown_cancels_failing_builds_at_once(run_dir, standin):
    from tests.support.servers import start_sampler_process

    httpx.post(standin.url + "/_standin/fail", params={"count": 10**9})
    sampler = start_sampler_process(run_dir, inference_urls=[standin.url], env="tests.support.envs:CountEnv",
                                    request_retries=0, drain_deadline=20)
    try:
        deadline = time.monotonic() + 20
        while not httpx.get(sampler.url + "/status").json()["steps"]["last_error"]:
            assert time.monotonic() < deadline, "the build never failed"
            time.sleep(0.1)
        started = time.monotonic()
        sampler.popen.send_signal(15)
        sampler.popen.wait(30)
        assert time.monotonic() - started < 8, "shutdown waited for a build that could not finish"
    finally:
        sampler.terminate()
