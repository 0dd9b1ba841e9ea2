"""Concurrent requests share batched forward passes, and batching does not change results."""

from __future__ import annotations

import asyncio
import re

import httpx

from services.inference.testing import ServerHandle


def _peak_from_metrics(text: str) -> float:
    m = re.search(r'^tandem_inference_peak_batch_size\{[^}]*\} ([0-9.e+]+)$', text, re.MULTILINE)
    assert m, "peak batch-size gauge missing from /metrics"
    return float(m.group(1))


async def test_concurrent_requests_are_batched(fresh_server: ServerHandle) -> None:
    prompts = [f"prompt number {i}: " for i in range(16)]
    async with httpx.AsyncClient(base_url=fresh_server.url, timeout=60) as c:
        async def one(p: str) -> list[int]:
            body = {"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            r = await c.post("/v1/completions", json=body)
            return r.json()["choices"][0]["token_ids"]

        solo = [await one(p) for p in prompts[:3]]
        assert _peak_from_metrics((await c.get("/metrics")).text) == 1
        together = await asyncio.gather(*(one(p) for p in prompts))
        peak = _peak_from_metrics((await c.get("/metrics")).text)
    assert peak >= 8, f"16 concurrent requests ran in batches of at most {peak}"
    # Left padding and joining a running batch do not change greedy results.
    assert together[:3] == solo
    stats = fresh_server.engine.stats
    assert stats["steps"] < 3 * 24 + 16 * 24  # far fewer steps than one sequence at a time


async def test_n_copies_share_one_prefill(fresh_server: ServerHandle) -> None:
    async with httpx.AsyncClient(base_url=fresh_server.url, timeout=60) as c:
        r = await c.post("/v1/completions", json={"prompt": "shared prompt", "n": 8, "max_tokens": 4, "seed": 0})
    assert len(r.json()["choices"]) == 8
    stats = fresh_server.engine.stats
    assert stats["prompt_tokens"] == len("shared prompt")  # prefilled once, not 8 times
    assert stats["peak_batch_size"] == 8
