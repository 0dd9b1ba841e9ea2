"""Store: sealed bytes are served from memory to readers in this process, never wrong bytes."""

from __future__ import annotations

import asyncio
import os

import pytest
import redis.asyncio as aioredis

from services.sampler.keys import Keys
from services.sampler.store import Store


@pytest.fixture
async def redis(redis_url):
    client = aioredis.from_url(redis_url)
    yield client
    await client.aclose()


async def _get_calls(r: aioredis.Redis) -> int:
    return (await r.info("commandstats")).get("cmdstat_get", {}).get("calls", 0)


async def test_a_reader_during_our_own_seal_gets_the_bytes_without_reading_them_back(redis, namespace):
    store = Store(redis, Keys(namespace))
    payload = os.urandom(8 << 20)
    gets = await _get_calls(redis)
    sealing = asyncio.create_task(store.seal(0, payload))
    await asyncio.sleep(0)  # the seal is on its way to Redis, not answered yet
    assert not sealing.done()
    assert await store.get_batch(0) == payload
    assert await sealing == 1
    assert await _get_calls(redis) == gets, "the batch was read back from Redis"


async def test_a_reader_during_a_losing_seal_gets_the_batch_that_was_sealed_first(redis, namespace):
    first, second = Store(redis, Keys(namespace)), Store(redis, Keys(namespace))
    assert await first.seal(0, b"sealed first") == 1
    sealing = asyncio.create_task(second.seal(0, b"too late"))
    await asyncio.sleep(0)
    assert await second.get_batch(0) == b"sealed first"
    assert await sealing == 0
    assert await second.get_batch(0) == b"sealed first"


async def test_a_trimmed_batch_is_not_served_from_memory(redis, namespace):
    store = Store(redis, Keys(namespace))
    assert await store.seal(0, b"batch 0") == 1
    assert await store.get_batch(0) == b"batch 0"
    await store.trim_below(1)
    assert await store.get_batch(0) is None


async def test_wait_served_returns_once_a_reader_was_answered_or_after_the_timeout(redis, namespace):
    store = Store(redis, Keys(namespace))
    assert await store.wait_served(0, 0.05) is False
    waiting = asyncio.create_task(store.wait_served(1, 30))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    store.mark_served(1)
    assert await waiting is True
    store.mark_served(2)  # answered before anyone waits: the wait returns at once
    assert await store.wait_served(2, 0) is True


async def test_trim_keeps_every_batch_from_the_trainers_resume_step(redis, namespace):
    """A trainer that would restart at step 2 keeps batches 2.. whatever keep_batches says; the
    mark never moves back, and once the trainer checkpoints further the old ones go."""
    store = Store(redis, Keys(namespace))
    for step in range(8):
        assert await store.seal(step, f"batch {step}".encode()) == 1
    assert await store.trim_below(6, resume_step=2) == 2
    assert await store.sealed_steps() == [2, 3, 4, 5, 6, 7]
    meta = await store.meta()
    assert meta["trimmed_below"] == 2 and meta["resume_step"] == 2
    assert await store.trim_below(7, resume_step=1) == 0  # an older resume step does not bring 0-1 back
    assert await store.sealed_steps() == [2, 3, 4, 5, 6, 7]
    assert await store.trim_below(7, resume_step=5) == 3
    assert await store.sealed_steps() == [5, 6, 7]
    assert await store.trim_below(6) == 1  # no resume step (an older trainer): keep_batches alone
    assert await store.sealed_steps() == [6, 7]
