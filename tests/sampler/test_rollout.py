"""Dataset order, completion parsing, and the fan-out pool's balance, bound and retries."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.sampler.fleet.inference_pool import (
    OK,
    InferencePool,
    InferenceRequestError,
    InferenceUnavailable,
    WentBackwards,
)
from services.sampler.rollouts.completions import parse_completions
from services.sampler.rollouts.seeds import DatasetOrder
from shared.http_client import HttpClient


def test_dataset_order_is_seeded_and_covers_each_epoch():
    order = DatasetOrder(10, seed=3)
    epoch0 = [order[i] for i in range(10)]
    epoch1 = [order[i] for i in range(10, 20)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1  # reshuffled per epoch
    again = DatasetOrder(10, seed=3)
    assert [again[i] for i in range(20)] == epoch0 + epoch1
    assert [DatasetOrder(10, seed=4)[i] for i in range(10)] != epoch0


def test_parse_completions_takes_the_oldest_weight_version():
    body = {"choices": [
        {"index": 1, "text": "b", "token_ids": [5], "prompt_token_ids": [1],
         "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "length",
         "weight_versions": [{"version": "3", "start": 0, "end": 1}]},
        {"index": 0, "text": "ab", "token_ids": [4, 5], "prompt_token_ids": [1],
         "logprobs": {"token_logprobs": [-0.1, -0.2]}, "finish_reason": "stop",
         "weight_versions": [{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 2}]},
    ]}
    # Sent while the server served version 2 (the first choice was paused across the update to 3).
    first, second = parse_completions(body, served_version=2)
    assert first.text == "ab" and first.versions == [2, 3] and first.finish_reason == "stop"
    assert second.versions == [3] and second.finish_reason == "length"


def test_spans_older_than_the_version_served_at_dispatch_mean_lost_weights():
    choice = {"index": 0, "text": "a", "token_ids": [4], "prompt_token_ids": [1],
              "logprobs": {"token_logprobs": [-0.1]}, "finish_reason": "stop"}
    restarted = {"choices": [{**choice, "weight_versions": [{"version": "0", "start": 0, "end": 1}]}]}
    with pytest.raises(WentBackwards, match="labelled 0 although it served version 8"):
        parse_completions(restarted, served_version=8)
    assert parse_completions(restarted, served_version=0)[0].versions == [0]
    unlabelled = {"choices": [{**choice, "weight_versions": [{"version": "default", "start": 0, "end": 1}]}]}
    with pytest.raises(WentBackwards, match="labelled default"):
        parse_completions(unlabelled, served_version=0)
    # Without spans (vLLM 0.32) every token is stamped with the version served at dispatch.
    assert parse_completions({"choices": [choice]}, served_version=5)[0].versions == [5]


def test_parse_completions_refuses_missing_token_ids_or_logprobs():
    with pytest.raises(InferenceRequestError, match="return_token_ids"):
        parse_completions({"choices": [{"text": "x", "logprobs": {"token_logprobs": [0.0]}}]}, 0)
    with pytest.raises(InferenceRequestError, match="logprobs"):
        parse_completions({"choices": [{"text": "x", "token_ids": [1], "prompt_token_ids": [1]}]}, 0)


async def _pool(urls, **kw) -> InferencePool:
    pool = InferencePool(urls, max_concurrency=kw.get("max_concurrency", 8), request_timeout=kw.get("timeout", 30),
                         retries=kw.get("retries", 3), http=HttpClient(max_connections=16, timeout=30))
    for server in pool.servers:
        pool.set_version(server.url, 0)
        pool.set_state(server, OK)
    return pool


async def test_requests_are_balanced_and_bounded(two_standins):
    urls = [s.url for s in two_standins]
    pool = await _pool(urls, max_concurrency=6)
    peak = 0

    async def one():
        nonlocal peak
        task = asyncio.create_task(pool.post("/v1/completions", {"prompt": "x", "max_tokens": 10}))
        await asyncio.sleep(0)
        peak = max(peak, pool.in_flight)
        return await task

    results = await asyncio.gather(*(one() for _ in range(40)))
    await pool.http.aclose()
    assert peak <= 6
    counts = [httpx.get(u + "/_standin/stats").json()["requests"] for u in urls]
    assert sum(counts) == 40
    assert min(counts) >= 12, counts  # least-outstanding routing spreads the load
    assert {server.url for _, server in results} == set(urls)


async def test_5xx_is_retried_on_another_server(two_standins):
    urls = [s.url for s in two_standins]
    httpx.post(urls[0] + "/_standin/fail", params={"count": 100})
    pool = await _pool(urls)
    for _ in range(5):
        body, server = await pool.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert server.url == urls[1] and body["choices"]
    await pool.http.aclose()
    assert pool.stats.retries >= 1
    assert pool.servers[0].last_error.startswith("HTTP 503")


async def test_a_server_that_stays_down_fails_clearly():
    pool = await _pool(["http://127.0.0.1:9"], retries=2, timeout=10)
    with pytest.raises(InferenceUnavailable, match="after 3 attempts.*127.0.0.1:9"):
        await pool.post("/v1/completions", {"prompt": "x"})
    await pool.http.aclose()


async def test_4xx_is_not_retried(two_standins):
    pool = await _pool([two_standins[0].url])
    with pytest.raises(InferenceRequestError, match="max_tokens"):
        await pool.post("/v1/completions", {"prompt": "x", "max_tokens": -1})
    await pool.http.aclose()
    assert pool.stats.retries == 0


async def test_only_servers_with_a_new_enough_version_are_used(two_standins):
    urls = [s.url for s in two_standins]
    pool = await _pool(urls)
    pool.set_version(urls[0], 5)
    for _ in range(6):
        _, server = await pool.post("/v1/completions", {"prompt": "x", "max_tokens": 1}, min_version=5)
        assert server.url == urls[0]
    await pool.http.aclose()
