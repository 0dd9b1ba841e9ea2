"""A minimal trainer that knows only docs/sampler-api.md: poll each batch, 'train', publish."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx


async def drive(url: str, steps: int, *, checkpoint: str | None = None, train_seconds: float = 0.0,
                start: int = 0) -> list[dict[str, Any]]:
    batches = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for step in range(start, start + steps):
            while True:
                response = await http.get("/batch", params={"step": step, "timeout": 10})
                if response.status_code == 200:
                    break
                assert response.status_code == 204, response.text
            batch = response.json()
            again = await http.get("/batch", params={"step": step, "timeout": 0})
            assert again.content == response.content, "re-reads must be identical"
            batches.append(batch)
            await asyncio.sleep(train_seconds)
            published = await http.post("/weights_version", json={"version": step + 1, "checkpoint_path": checkpoint})
            assert published.status_code == 200, published.text
    return batches


async def publish_mid_batch(http: httpx.AsyncClient, settle: float, timeout: float,
                            started: Callable[[], Awaitable[bool]] | None = None) -> list[dict[str, Any]]:
    """Publish version 1 `settle` seconds after the sampler starts building (batches 0 and 1, both
    allowed on version 0, are then mid-trajectory), then take batch 0: its samples, and those of
    them sampled by both versions (`versions` [0, 1], `policy_version` 0: the oldest).

    `started`: the publication also waits until it says every trajectory of batch 0 has made its
    first model call (one that had not would be sampled by version 1 alone, newer than batch 0
    allows, and fail the batch): a fixed `settle` alone races with a slow start."""
    while not (await http.get("/status")).json()["steps"]["in_progress"]:
        await asyncio.sleep(0.02)
    while started is not None and not await started():
        await asyncio.sleep(0.02)
    await asyncio.sleep(settle)
    assert (await http.post("/weights_version", json={"version": 1})).status_code == 200
    samples = (await http.get("/batch", params={"step": 0, "timeout": timeout})).json()["samples"]
    straddling = [s for s in samples if s["versions"] == [0, 1]]
    assert straddling, [s["versions"] for s in samples]
    assert all(s["policy_version"] == 0 for s in straddling)
    return straddling
