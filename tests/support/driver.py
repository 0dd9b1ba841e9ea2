"""A minimal trainer that knows only docs/sampler-api.md: poll each batch, 'train', publish."""

from __future__ import annotations

import asyncio
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
