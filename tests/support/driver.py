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


def hold_second_turns(standin_url: str) -> None:
    """Make the stand-in hold each conversation's second model call before its first token,
    until `publish_between_turns` or `release_held_turns` releases them. Call it before the sampler starts."""
    httpx.post(f"{standin_url}/_standin/configure", json={"hold_request": 2}).raise_for_status()


def release_held_turns(standin_url: str) -> None:
    """Let the calls `hold_second_turns` holds go on, and hold no more."""
    httpx.post(f"{standin_url}/_standin/configure", json={"hold_request": None}).raise_for_status()


async def publish_between_turns(http: httpx.AsyncClient, standin_url: str, timeout: float,
                                conversations: int = 32) -> list[dict[str, Any]]:
    """Publish version 1 while `conversations` conversations stand between their first and
    second turn, then take batch 0 and return its samples; every one of them must have been
    sampled by both versions (`versions` [0, 1], `policy_version` 0: the oldest).

    The stand-in holds the second calls (`hold_second_turns`): once all of batches 0 and 1's
    conversations (16 each, both batches allowed on version 0 and built at once) are held,
    each has its first turn from version 0 and the rest to come, whatever the machine's load.
    The conversations need a first turn with tokens in it (temperature 0: the stand-in then
    never stops at once): one whose tokens all came from version 1 would be newer than batch 0
    allows and fail the batch. The trainer this stands for publishes version N+1 only after
    reading batch N; publishing before is what puts a sync in the middle of batch 0."""
    async with asyncio.timeout(timeout):
        while (await http.get(f"{standin_url}/_standin/stats")).json()["held"] < conversations:
            await asyncio.sleep(0.02)
    assert (await http.post("/weights_version", json={"version": 1})).status_code == 200
    (await http.post(f"{standin_url}/_standin/configure", json={"hold_request": None})).raise_for_status()
    samples = (await http.get("/batch", params={"step": 0, "timeout": timeout})).json()["samples"]
    assert [s["versions"] for s in samples] == [[0, 1]] * len(samples)
    assert [s["policy_version"] for s in samples] == [0] * len(samples)
    return samples


async def batch_samples(url: str, step: int = 0, timeout: float = 120.0) -> list[Any]:
    """GET /batch?step=N, long-polled up to `timeout`; its samples as `Sample`s (200 asserted)."""
    from shared.wire import Sample

    async with httpx.AsyncClient(base_url=url, timeout=timeout + 10) as http:
        response = await http.get("/batch", params={"step": step, "timeout": timeout})
        assert response.status_code == 200, response.text
        return [Sample.model_validate(s) for s in response.json()["samples"]]


def fill_the_context_on_the_second_turn(standin_url: str) -> int:
    """The stand-in answers 8 bytes a turn to an EchoDialogue (tests/support/envs.py), its
    context cut to fit the opening, one turn, the environment's answer and 4 more bytes: the
    second turn fills it (cut at those 4 bytes, under a max_tokens of 16). Returns that context
    length."""
    opening = len("<|im_start|>user\nhello 0<|im_end|>\n<|im_start|>assistant\n")
    per_turn = 8 + len("<|im_end|>\n<|im_start|>user\nnext 1<|im_end|>\n<|im_start|>assistant\n")
    context = opening + per_turn + 4
    httpx.post(standin_url + "/_standin/configure",
               json={"replies": ["abcdefgh"], "max_model_len": context}).raise_for_status()
    return context
