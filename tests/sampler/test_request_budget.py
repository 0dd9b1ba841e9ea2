"""An inference request is bounded by what it asks for (request_floor + seconds_per_token x
max_tokens, at most request_timeout), not by the flat request_timeout, and the time one of
our weight syncs holds its server paused is not charged to it. Real stand-in server over HTTP."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from services.sampler.fleet.inference_pool import OK, InferencePool, InferenceUnavailable
from shared.http_client import HttpClient
from tests.support.servers import UvicornThread, start_standin


@pytest.fixture
def slow_server() -> Iterator[UvicornThread]:
    # 0.05 s a token, and every completion the same 20 tokens: a request takes about 1 s.
    server = start_standin(token_latency=0.05)
    httpx.post(f"{server.url}/_standin/configure", json={"reply": "ab" * 10})
    yield server
    server.stop()


def _pool(url: str, **bounds: float) -> InferencePool:
    pool = InferencePool([url], max_concurrency=4, request_timeout=30, retries=0,
                         http=HttpClient(max_connections=4, timeout=30), **bounds)
    for server in pool.servers:
        pool.set_version(server.url, 0)
        pool.set_state(server, OK)
    return pool


def test_the_budget_follows_max_tokens_under_the_flat_cap() -> None:
    pool = _pool("http://127.0.0.1:9", seconds_per_token=0.5, request_floor=10)
    assert pool.budget({"max_tokens": 8}) == 14
    assert pool.budget({"sampling_params": {"max_tokens": 20}}) == 20
    assert pool.budget({"max_tokens": 1000}) == 30  # request_timeout caps it
    assert pool.budget({"prompt": "no max_tokens"}) == 30
    assert _pool("http://127.0.0.1:9").budget({"max_tokens": 8}) == 30  # no per-token bound set


async def test_a_request_that_outlasts_its_budget_is_cut_saying_so(slow_server: UvicornThread) -> None:
    pool = _pool(slow_server.url, seconds_per_token=0.01, request_floor=0.2)  # 0.2 + 0.01 x 20 = 0.4 s
    started = time.monotonic()
    with pytest.raises(InferenceUnavailable) as failure:
        await pool.post("/v1/completions", {"prompt": "x", "max_tokens": 20})
    took = time.monotonic() - started
    assert "within its budget of 0.4 s" in str(failure.value)
    assert took < 0.9, f"cut after {took:.2f}s; the answer takes about 1 s and the budget is 0.4 s"
    # The same request with room for its tokens is answered.
    roomy = _pool(slow_server.url, seconds_per_token=0.2, request_floor=0.2)
    answer, _ = await roomy.post("/v1/completions", {"prompt": "x", "max_tokens": 20})
    assert answer["choices"][0]["text"] == "ab" * 10
    await pool.http.aclose()
    await roomy.http.aclose()


async def test_time_our_sync_holds_the_server_is_not_charged(slow_server: UvicornThread) -> None:
    # 1.5 s of budget: enough for the ~1 s of tokens, not for them and a 1 s pause besides.
    pool = _pool(slow_server.url, seconds_per_token=0.01, request_floor=1.3)
    server = pool.servers[0]

    async def sync_midway() -> None:
        await asyncio.sleep(0.3)
        server.hold(True)  # what a weight sync does around its pause
        await pool.http.request("POST", slow_server.url + "/pause", params={"mode": "keep"})
        await asyncio.sleep(1.0)
        await pool.http.request("POST", slow_server.url + "/resume")
        server.hold(False)

    syncing = asyncio.create_task(sync_midway())
    started = time.monotonic()
    answer, _ = await pool.post("/v1/completions", {"prompt": "x", "max_tokens": 20})
    took = time.monotonic() - started
    await syncing
    assert answer["choices"][0]["text"] == "ab" * 10
    assert took > 1.5, f"answered in {took:.2f}s: the pause did not hold the request, so this shows nothing"
    assert server.held() >= 1.0
    await pool.http.aclose()
