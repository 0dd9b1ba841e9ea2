"""SIGTERM drains: batches in flight seal within `drain_deadline`, Redis is left consistent
(every batch key is in the sealed index and the reverse, no step claim left behind), and no
inference server is left paused, even when SIGTERM lands in the middle of a weight sync.

The stand-in's `reload_delay` hook makes reload_weights slow, so the signal reliably
arrives while the server is paused for the sync: once with a reload that ends within
uvicorn's graceful window (the sync finishes, the version is published), once with one
that outlasts it (the request is cancelled; the server must still be resumed).
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.reliability.support import Cleanup, redis_keys, stop_process, wait_for
from tests.support.servers import start_sampler_process, start_standin


@pytest.mark.parametrize("reload_delay", [
    pytest.param(3.0, id="sync-finishes-in-the-grace-period"),
    pytest.param(14.0, id="sync-outlasts-the-grace-period", marks=pytest.mark.slow),
])
def test_sigterm_during_a_weight_sync(tmp_path: Path, redis_url: str, namespace: str, cleanup: Cleanup,
                                      reload_delay: float) -> None:
    standin = start_standin(token_latency=0.1)
    cleanup.add(standin.stop)
    cleanup.add(lambda: httpx.post(f"{standin.url}/resume"))
    # A resume that takes a moment: it must still complete when the sync's request is cancelled.
    # Every completion is the same 50 tokens, 5 s at 0.1 s a token (random ones stop early at
    # random): batch 1 is still generating when the sync pauses the server.
    httpx.post(f"{standin.url}/_standin/configure",
               json={"reload_delay": reload_delay, "resume_delay": 0.5, "reply": "ab" * 25})
    sampler = start_sampler_process(tmp_path / "sampler", redis_url=redis_url, namespace=namespace,
                                    inference_urls=[standin.url], env="tests.support.envs:CountEnv",
                                    prompts_per_step=2, num_generations=2, max_tokens=64, max_staleness=1,
                                    drain_deadline=20)
    cleanup.add(lambda: stop_process(sampler))
    url = sampler.url

    # With max_staleness 1, batches 0 and 1 may both be built under version 0, at the same time:
    # waiting for batch 0 first can find batch 1 finished too. So the sync starts as soon as
    # batch 1 is seen generating, and pauses the server under it (up to 5 s of tokens left).
    wait_for(lambda: 1 in [p["step"] for p in httpx.get(f"{url}/status", timeout=10).json()["steps"]["in_progress"]],
             30, "batch 1 to be generating")
    result: dict[str, Any] = {}

    def publish() -> None:
        try:
            result["response"] = httpx.post(f"{url}/weights_version", timeout=60,
                                            json={"version": 1, "checkpoint_path": str(tmp_path / "step-0")})
        except httpx.HTTPError as exc:
            result["error"] = exc

    poster = threading.Thread(target=publish, daemon=True)
    poster.start()
    wait_for(lambda: httpx.get(f"{standin.url}/is_paused").json()["is_paused"], 10, "the sync to pause the server",
             detail=lambda: f"POST /weights_version: {result}\n{sampler.log_tail()}")
    in_flight = [p["step"] for p in httpx.get(f"{url}/status", timeout=10).json()["steps"]["in_progress"]]
    assert 1 in in_flight, f"batch 1 should be generating when SIGTERM arrives (in progress: {in_flight})"

    sampler.popen.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    rc = sampler.popen.wait(60)
    stopped_in = time.monotonic() - signalled
    poster.join(10)
    assert rc in (0, -signal.SIGTERM), f"exit status {rc}\n{sampler.log_tail()}"
    assert stopped_in < reload_delay + 25, f"shutdown took {stopped_in:.0f}s"

    # The server is not left paused (a background resume may need a moment after a cancelled sync).
    wait_for(lambda: not httpx.get(f"{standin.url}/is_paused").json()["is_paused"], 3,
             "the inference server to be resumed", detail=sampler.log_tail)

    state = redis_keys(redis_url, namespace)
    assert state["batches"] == state["sealed"], f"half-written state: batch keys {state['batches']}, index {state['sealed']}"
    assert state["claims"] == {}, f"claims left behind: {state['claims']}"
    assert set(in_flight) <= set(state["sealed"]), f"batches in flight at SIGTERM were not drained: {in_flight}, {state}"
    response = result.get("response")
    if response is not None and response.status_code == 200:
        assert int(state["meta"]["version"]) == 1, "the acknowledged version was not recorded"
    if reload_delay < 10:
        # Within uvicorn's graceful window the sync completes and is acknowledged.
        assert response is not None and response.status_code == 200, result
        assert state["meta"]["version"] == "1"
        assert httpx.get(f"{standin.url}/weight_info").json()["weight_version"] == "1"
