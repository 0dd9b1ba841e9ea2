"""Inference faults with four servers: one answers 5xx, one hangs, one dies, one works.

Requests are retried with backoff and fail over to the working server; every fault is
visible in /status. When no server can generate, GET /batch answers 503 naming the cause
once `generation_deadline` passes, and `SamplerClient` raises `SamplerUnavailable` carrying
the server's detail; when a server comes back, generation resumes without a restart.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from shared.client import SamplerClient, SamplerUnavailable
from tests.reliability.support import (
    Cleanup,
    kill_embedded_redis,
    start_standin_process,
    stop_process,
    wait_for,
)
from tests.support.servers import start_sampler_process, start_standin


async def _train(url: str, steps: range, publish_last: bool = True) -> list[dict]:
    batches = []
    async with SamplerClient(url, poll_timeout=5, retry_for=30) as client:
        for step in steps:
            batches.append(await client.get_batch_raw(step, timeout=60))
            if publish_last or step != steps[-1]:
                await client.publish_weights(step + 1)
    return batches


def _servers(url: str) -> dict[str, dict]:
    status = httpx.get(f"{url}/status", timeout=10).json()
    return {s["url"]: s for s in status["inference_servers"]}, status


@pytest.mark.slow
def test_5xx_hanging_and_dead_servers_fail_over_stall_and_recover(tmp_path: Path, cleanup: Cleanup) -> None:
    failing, hanging, healthy = start_standin(), start_standin(), start_standin()
    for server in (failing, hanging, healthy):
        cleanup.add(server.stop)
    dying = start_standin_process(tmp_path, cleanup)
    httpx.post(f"{failing.url}/_standin/fail", params={"count": 10**9})
    # Accepts requests, never finishes them, and says it is running (a paused server would be
    # resumed by the sampler: services/sampler/fleet/liveness.py).
    httpx.post(f"{hanging.url}/_standin/configure", json={"hung": True})
    cleanup.add(lambda: httpx.post(f"{hanging.url}/_standin/configure", json={"hung": False}))
    run_dir = tmp_path / "sampler"
    cleanup.add(lambda: kill_embedded_redis(run_dir))
    urls = [failing.url, hanging.url, dying.url, healthy.url]
    sampler = start_sampler_process(run_dir, inference_urls=urls, env="tests.support.envs:CountEnv",
                                    prompts_per_step=4, num_generations=2, max_tokens=6, max_staleness=0,
                                    request_timeout=1.5, request_retries=6, generation_deadline=3)
    cleanup.add(lambda: stop_process(sampler))
    url, pid = sampler.url, sampler.pid

    started = time.monotonic()
    batches = asyncio.run(_train(url, range(2)))
    dying.kill()  # its process is gone: connection refused from now on
    batches += asyncio.run(_train(url, range(2, 4), publish_last=False))
    took = time.monotonic() - started
    assert [b["step"] for b in batches] == [0, 1, 2, 3]
    assert all(len(b["samples"]) == 8 for b in batches)

    servers, status = _servers(url)
    assert servers[failing.url]["failures"] >= 1 and "503" in servers[failing.url]["error"], servers[failing.url]
    assert servers[hanging.url]["failures"] >= 1 and "Timeout" in servers[hanging.url]["error"], servers[hanging.url]
    # The dead server is out of rotation and /status says why. Two paths see the death and
    # either may come first: a generation request (killed mid-request it drops the connection,
    # killed between requests it refuses new ones) or the fleet's /weight_info check, which
    # runs every `server_check_interval` (2 s) and may find it gone before any request goes
    # there; then it has no request failures at all. (aiohttp, the sampler's client, names a
    # dropped connection ServerDisconnectedError or ClientOSError "Connection reset by peer".)
    dead_errors = ("Connect", "ServerDisconnected", "Connection reset", "ReadError")
    dead = wait_for(lambda: (s := _servers(url)[0][dying.url])["state"] == "down" and s, 10,
                    "the fleet to take the killed server out of rotation")
    assert any(e in dead["reason"] for e in dead_errors), dead
    if dead["failures"]:
        assert any(e in dead["error"] for e in dead_errors), dead
    assert servers[healthy.url]["error"] is None and servers[healthy.url]["requests"] >= 1
    assert status["throughput"]["retries"] >= 3, status["throughput"]
    assert took < 60, f"four batches took {took:.0f}s with one healthy server"

    # The last healthy server fails too: generation stalls past generation_deadline.
    httpx.post(f"{healthy.url}/_standin/fail", params={"count": 10**9})
    assert httpx.post(f"{url}/weights_version", json={"version": 4}).status_code == 200  # batch 4 may start

    async def stalled() -> str:
        async with SamplerClient(url, poll_timeout=2, retry_for=4) as client:
            with pytest.raises(SamplerUnavailable) as caught:
                await client.get_batch_raw(4, timeout=60)
            return str(caught.value)

    message = asyncio.run(asyncio.wait_for(stalled(), 60))
    # The trainer's error carries the sampler's cause, down to the inference servers' answers.
    assert "HTTP 503" in message and "batch 4" in message, message
    # Two stall messages name the cause (producer.stall): "has waited Ns for an inference server"
    # while a request waits for one, "has failed to build ... InferenceUnavailable" between
    # attempts; which one the trainer's last poll sees depends on timing, and both give the reason.
    assert "no inference server in rotation serves version >= 4" in message, message
    assert "stand-in told to fail" in message, message
    assert healthy.url in message, message
    direct = httpx.get(f"{url}/batch", params={"step": 4, "timeout": 0}, timeout=10)
    assert direct.status_code == 503 and direct.headers.get("retry-after"), direct.text

    # A server comes back: generation resumes in the same sampler process.
    httpx.post(f"{healthy.url}/_standin/fail", params={"count": 0})
    back = time.monotonic()
    batches = asyncio.run(_train(url, range(4, 6)))
    assert [b["step"] for b in batches] == [4, 5]
    assert time.monotonic() - back < 30
    assert sampler.popen.poll() is None and sampler.pid == pid
    servers, _ = wait_for(lambda: (s := _servers(url)) and s[0][healthy.url]["error"] is None and s, 10,
                          "the recovered server's error to clear")
