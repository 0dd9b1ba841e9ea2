"""Store: a batch is sealed as chunks, all or nothing; sealed chunks are served from memory
to readers in this process, never wrong ones; trimming removes a batch with its chunks."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import redis.asyncio as aioredis

from services.sampler.storage.keys import Keys
from services.sampler.storage.packing import SealedBatch, pack
from services.sampler.storage.store import Store
from shared.chunks import decode_chunk, samples_of
from tests.support.servers import start_redis


@pytest.fixture
async def redis(redis_url):
    client = aioredis.from_url(redis_url)
    yield client
    await client.aclose()


def _samples(step: int, groups: int = 6, group_size: int = 4, tokens: int = 300) -> list[dict]:
    rng = np.random.default_rng(step)
    return [{"prompt_id": f"p{g}", "group_id": f"s{step}-g{g}", "prompt_token_ids": rng.integers(0, 50_000, 40).tolist(),
             "completion_token_ids": rng.integers(0, 50_000, tokens).tolist(),
             "completion_logprobs": (-rng.random(tokens)).tolist(), "loss_mask": [1] * tokens,
             "reward": float(g), "advantage": 0.5, "policy_version": step, "finish_reason": "stop"}
            for g in range(groups) for _ in range(group_size)]


def _batch(step: int, chunk_bytes: int = 8 << 10, **kwargs) -> SealedBatch:
    """A batch of several chunks (a group of 4 samples is ~7 KB here)."""
    return pack(step, _samples(step, **kwargs), {"step": step}, chunk_bytes)


async def _calls(r: aioredis.Redis, *commands: str) -> int:
    stats = await r.info("commandstats")
    return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in commands)


async def _keys(r: aioredis.Redis, keys: Keys, step: int) -> list[bytes]:
    return sorted([k async for k in r.scan_iter(f"{keys.batch(step)}*")])


def _bytes(buffers) -> list[bytes]:
    return [bytes(b) for b in buffers]


async def test_a_batch_is_stored_as_group_aligned_chunks_and_reads_back_the_same(redis, namespace):
    keys = Keys(namespace)
    store, reader = Store(redis, keys), Store(redis, keys)
    batch = _batch(0)
    assert len(batch.table) >= 3 and batch.num_samples == 24
    assert await store.seal(0, batch) == 1
    read = await reader.get_batch(0)  # another process: from Redis
    assert read.build == batch.build and read.table == batch.table and read.stats == {"step": 0}
    assert _bytes(read.chunks) == _bytes(batch.chunks)
    samples = [s for c in read.chunks for s in samples_of(decode_chunk(c))]
    groups = [[s["group_id"] for s in samples_of(decode_chunk(c))] for c in read.chunks]
    for before, after in zip(groups, groups[1:]):
        assert before[-1] != after[0], "a group was cut between two chunks"
    for got, want in zip(samples, _samples(0)):
        assert got["completion_token_ids"].tolist() == want["completion_token_ids"]
        assert got["completion_logprobs"].tolist() == want["completion_logprobs"]
        assert {k: v for k, v in got.items() if not isinstance(v, np.ndarray)} == \
            {k: v for k, v in want.items() if not isinstance(v, list)}
    # A reader of one chunk reads only that chunk.
    manifest = await reader.manifest(0)
    assert manifest.chunks is None  # not sealed by this process: nothing in memory
    mgets = await _calls(redis, "mget", "get")
    assert _bytes(await reader.read_chunks(manifest, [1])) == _bytes(batch.chunks[1:2])
    assert await _calls(redis, "mget", "get") == mgets + 1


async def test_a_reader_during_our_own_seal_gets_the_chunks_without_reading_them_back(redis, namespace):
    store = Store(redis, Keys(namespace))
    batch = _batch(0, groups=40, tokens=4000)
    reads = await _calls(redis, "get", "mget", "hgetall")
    sealing = asyncio.create_task(store.seal(0, batch))
    await asyncio.sleep(0)  # the seal is on its way to Redis, not answered yet
    assert not sealing.done()
    assert await store.manifest(0) is batch
    assert await sealing == 1
    assert await _calls(redis, "get", "mget", "hgetall") == reads, "the batch was read back from Redis"


async def test_a_losing_seal_leaves_the_first_batch_and_no_chunks_of_its_own(redis, namespace):
    keys = Keys(namespace)
    first, second = Store(redis, keys), Store(redis, keys)
    winner, loser = _batch(0), _batch(0)
    assert await first.seal(0, winner) == 1
    sealing = asyncio.create_task(second.seal(0, loser))
    await asyncio.sleep(0)
    assert (await second.manifest(0)).build == winner.build
    assert await sealing == 0
    assert (await second.manifest(0)).build == winner.build
    assert _bytes((await second.get_batch(0)).chunks) == _bytes(winner.chunks)
    names = await _keys(redis, keys, 0)
    assert not [k for k in names if loser.build.encode() in k], "the losing build's chunks stayed behind"
    assert len(names) == 1 + len(winner.table)


async def test_a_batch_is_seen_whole_or_not_at_all(redis, namespace):
    """Chunks written but not sealed are invisible, expire on their own, and become permanent
    only with the seal; a chunk lost before the seal is written again, not sealed as missing."""
    keys = Keys(namespace)
    batch = _batch(0)
    prefix = keys.chunk_prefix(0, batch.build)
    store = Store(redis, keys)
    await store._write_chunks(prefix, batch.chunks)
    assert await Store(redis, keys).manifest(0) is None
    assert 0 < await redis.pttl(prefix + "0") <= 3_600_000
    await redis.delete(prefix + str(len(batch.table) - 1))  # lost before the seal

    class Forgetful(Store):
        writes = 0

        async def _write_chunks(self, prefix, buffers, *args, **kwargs):
            self.writes += 1
            # The first write misses the last chunk, which is then not in Redis at the seal.
            await super()._write_chunks(prefix, buffers if self.writes > 1 else buffers[:-1], *args, **kwargs)

    forgetful = Forgetful(redis, keys)
    assert await forgetful.seal(0, batch) == 1 and forgetful.writes == 2
    for i in range(len(batch.table)):
        assert await redis.pttl(prefix + str(i)) == -1  # permanent now
    assert _bytes((await Store(redis, keys).get_batch(0)).chunks) == _bytes(batch.chunks)


async def test_a_trimmed_batch_is_not_served_from_memory_and_its_chunks_are_deleted(redis, namespace):
    keys = Keys(namespace)
    store = Store(redis, keys)
    batch = _batch(0)
    assert await store.seal(0, batch) == 1
    assert await store.manifest(0) is batch
    await store.trim_below(1)
    assert await store.manifest(0) is None and not store.held(0)
    assert await _keys(redis, keys, 0) == []
    assert await store.seal(0, _batch(0)) == -1  # sealing a trimmed step writes nothing that stays
    assert await _keys(redis, keys, 0) == []


async def test_memory_holds_the_newest_batch_and_older_ones_while_they_fit(redis, namespace):
    store = Store(redis, Keys(namespace), cache_bytes=1)
    for step in range(3):
        assert await store.seal(step, _batch(step)) == 1
    assert [store.held(s) for s in range(3)] == [False, False, True]
    roomy = Store(redis, Keys(namespace + "x"), cache_bytes=1 << 30)
    for step in range(3):
        assert await roomy.seal(step, _batch(step)) == 1
    assert all(roomy.held(s) for s in range(3))


async def test_a_batch_far_larger_than_redis_takes_in_one_value_seals_and_reads_back(tmp_path, namespace):
    """Redis refuses any value over proto-max-bulk-len (512 MB by default; 1 MB here): a
    batch of several times that is stored as chunks under it."""
    proc, url = start_redis(tmp_path / "redis")
    client = aioredis.from_url(url)
    try:
        await client.config_set("proto-max-bulk-len", "1mb")
        with pytest.raises(aioredis.RedisError):  # Redis drops a client that sends one
            await client.set("too-big", b"x" * (2 << 20))
        await client.aclose()
        client = aioredis.from_url(url)
        batch = _batch(0, chunk_bytes=256 << 10, groups=160, tokens=700)
        assert batch.nbytes > 4 << 20 and max(b for _, b in batch.table) < 1 << 20
        assert await Store(client, Keys(namespace)).seal(0, batch) == 1
        assert _bytes((await Store(client, Keys(namespace)).get_batch(0)).chunks) == _bytes(batch.chunks)
    finally:
        await client.aclose()
        proc.terminate()


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
        assert await store.seal(step, _batch(step)) == 1
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


async def test_a_batch_sealed_before_chunks_is_still_served_and_trimmed(redis, namespace):
    """A run upgraded mid-way: a batch an older sampler sealed as one arrays-form string."""
    from shared import codec

    keys = Keys(namespace)
    samples = _samples(0, groups=2)
    await redis.set(keys.batch(0), codec.pack_arrays({"step": 0, "samples": samples, "stats": {"step": 0}}))
    await redis.zadd(keys.sealed, {"0": 0})
    store = Store(redis, keys)
    batch = await store.get_batch(0)
    assert batch.stats == {"step": 0} and batch.num_samples == len(samples)
    got = [s for c in batch.chunks for s in samples_of(decode_chunk(c))]
    assert [s["completion_token_ids"].tolist() for s in got] == [s["completion_token_ids"] for s in samples]
    assert await store.seal(0, _batch(0)) == 0  # sealed already: the old batch stands
    assert await redis.type(keys.batch(0)) == b"string" and await _keys(redis, keys, 0) == [keys.batch(0).encode()]
    assert await store.trim_below(1) == 1
    assert await _keys(redis, keys, 0) == []
