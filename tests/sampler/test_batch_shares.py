"""Rank shares of a chunked batch through a real sampler and real HTTP: the shares partition the
batch, every media type carries the same share, a share's frames are its chunks byte for byte
(edges sent from views of the stored chunk), a replica serving a share reads only that share's
chunks from Redis, and a batch that does not split evenly is a clear 422."""

from __future__ import annotations

import json
import struct

import httpx
import msgpack
import numpy as np
import pytest
import redis.asyncio as aioredis

from services.sampler.storage.packing import pieces, share_range
from shared import codec
from shared.chunks import FRAMES, VIEW_BYTES, slice_chunk
from shared.client import SamplerClient, SamplerRequestError
from tests.support.servers import start_redis

# 16 prompts x 4 generations = 64 samples: shares of 32 (2 ranks) and 16 (4 ranks) are whole
# groups. temperature 0: the stand-in writes max_tokens tokens every time, so a sample is ~6.5 KB
# (about 14 bytes a token) and a batch ~0.4 MB, in chunks of about 64 KiB (the smallest): three
# groups (12 samples) a chunk, so share edges (every 16 samples) fall inside chunks.
SETTINGS = {"prompts_per_step": 16, "num_generations": 4, "max_tokens": 450, "temperature": 0.0,
            "batch_chunk_bytes": 64 << 10, "max_staleness": 0}
GROUP = SETTINGS["num_generations"]
TOTAL = SETTINGS["prompts_per_step"] * GROUP


async def _table(redis_url: str, namespace: str, step: int = 0) -> list[tuple[int, int]]:
    client = aioredis.from_url(redis_url)
    try:
        raw = await client.hget(f"tandem:{namespace}:batch:{step}", "table")
    finally:
        await client.aclose()
    assert raw is not None, "no manifest for the batch"
    return [(int(n), int(b)) for n, b in json.loads(raw)]


async def test_rank_shares_partition_the_batch_in_every_encoding(make_sampler, redis_url, namespace):
    sampler = make_sampler(**SETTINGS)
    async with SamplerClient(sampler.url, encoding="frames", poll_timeout=20) as client:
        whole = await client.get_batch_arrays(0, timeout=60)
        assert whole.num_samples == TOTAL and (whole.rank, whole.world_size) == (0, 1)
        table = await _table(redis_url, namespace)
        assert sum(n for n, _ in table) == TOTAL
        assert len(table) >= 5, f"the batch should be several chunks: {table}"
        assert len(whole.chunks) == len(table)
        # Some share edges cut a chunk (its part is re-encoded), others take chunks whole.
        parts = [p for rank in range(4) for p in pieces(table, *share_range(TOTAL, rank, 4))]
        assert any(not p.whole for p in parts) and any(p.whole for p in parts), table
        whole_samples = whole.samples()
        whole_plain = codec.plain(whole_samples)
        assert whole_samples[0]["completion_token_ids"].dtype == np.int32
        assert len(whole_samples[0]["completion_token_ids"]) == SETTINGS["max_tokens"]
        assert len({s["group_id"] for s in whole_samples}) == SETTINGS["prompts_per_step"]
        async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
            for world_size in (2, 4):
                shares = []
                for rank in range(world_size):
                    share = await client.get_batch_arrays(0, rank, world_size, timeout=10)
                    assert (share.step, share.rank, share.world_size) == (0, rank, world_size)
                    assert share.num_samples == TOTAL // world_size
                    assert share.stats == whole.stats
                    samples = share.samples()
                    shares.append(samples)
                    # Token columns of the share are the share's samples' tokens, in order.
                    values, offsets = share.column("completion_token_ids")
                    assert values.flags.writeable  # views of the buffer the client received into
                    assert values.tolist() == [v for s in samples for v in s["completion_token_ids"].tolist()]
                    assert offsets.tolist() == [0, *np.cumsum([len(s["completion_token_ids"]) for s in samples])]
                    framed = codec.plain(share.as_dict())
                    assert framed["rank"] == rank and framed["world_size"] == world_size
                    # The same share in every other media type: the same values.
                    params = {"step": 0, "rank": rank, "world_size": world_size}
                    for accept, decode in ((codec.JSON, lambda r: r.json()),
                                           (codec.MSGPACK, lambda r: msgpack.unpackb(r.content, raw=False)),
                                           (codec.ARRAYS, lambda r: codec.unpack(r.content))):
                        response = await http.get("/batch", params=params, headers={"Accept": accept})
                        assert response.status_code == 200, response.text
                        assert response.headers["content-type"].startswith(accept)
                        assert codec.plain(decode(response)) == framed, (accept, rank, world_size)
                    raw = await http.get("/batch", params=params, headers={"Accept": FRAMES})
                    assert raw.headers["content-type"] == FRAMES
                    assert int(raw.headers["content-length"]) == len(raw.content)
                joined = [s for share in shares for s in share]
                assert codec.plain(joined) == whole_plain, f"world_size {world_size}: shares != the batch"
                # Types survive too: each share's token ids are int32 views, rewards floats.
                for share in shares:
                    assert all(s["completion_token_ids"].dtype == np.int32 for s in share)
                    assert all(type(s["reward"]) is float for s in share)
                # A share of whole groups (16 or 32 samples, groups of 4) never splits a group.
                groups = [{s["group_id"] for s in share} for share in shares]
                for i, mine in enumerate(groups):
                    assert len(mine) * GROUP == len(shares[i])
                    for theirs in groups[i + 1:]:
                        assert mine.isdisjoint(theirs), f"world_size {world_size}: a group is split between ranks"


def _frame_parts(body: bytes) -> tuple[dict, list[bytes]]:
    """A FRAMES body's header and its chunks' bytes."""
    magic, size = struct.unpack_from("<4sI", body)
    assert magic == b"TBT1"
    header = msgpack.unpackb(body[8:8 + size], raw=False)
    at, chunks = (8 + size + 7) & ~7, []
    for length in header["chunks"]:
        chunks.append(body[at:at + length])
        at += length
    assert at == len(body)
    return header, chunks


async def test_a_share_is_its_chunks_byte_for_byte_with_edges_from_views(make_sampler):
    """One chunk of 64 samples (~0.4 MB): each half's edge cuts it, and its logprobs (~115 KB)
    are past chunks.VIEW_BYTES, so the sampler sends them as a view of the stored chunk. What
    arrives is the chunk slice_chunk makes of that half, byte for byte, the same on every read."""
    sampler = make_sampler(**{**SETTINGS, "batch_chunk_bytes": 1 << 20})
    headers = {"Accept": FRAMES}
    async with httpx.AsyncClient(base_url=sampler.url, timeout=60) as http:
        whole = await http.get("/batch", params={"step": 0, "timeout": 50}, headers=headers)
        assert whole.status_code == 200, whole.text
        head, (stored,) = _frame_parts(whole.content)
        assert head["num_samples"] == TOTAL
        for rank in range(2):
            params = {"step": 0, "rank": rank, "world_size": 2}
            first = await http.get("/batch", params=params, headers=headers)
            again = await http.get("/batch", params=params, headers=headers)
            assert first.status_code == 200 and first.content == again.content
            share, (edge,) = _frame_parts(first.content)
            start, stop = share_range(TOTAL, rank, 2)
            assert (share["rank"], share["world_size"], share["num_samples"]) == (rank, 2, stop - start)
            assert edge == bytes(slice_chunk(stored, start, stop))
            assert (stop - start) * SETTINGS["max_tokens"] * 8 >= VIEW_BYTES  # its logprobs went by view


async def _output_bytes(client: aioredis.Redis) -> int:
    return int((await client.info("stats"))["total_net_output_bytes"])


async def test_a_replica_reads_only_the_chunks_of_the_share_it_serves(make_sampler, namespace, tmp_path):
    """Batch 0 is sealed by sampler A; sampler B (same Redis, same namespace) did not seal it,
    so it reads chunks from Redis to answer (batch_store = redis: tests/sampler/test_chunk_files.py
    has the files' version). What Redis sends while B answers rank r of 4 is
    that rank's chunks (at most the share plus the two chunks its edges cut), not the batch.
    A private Redis: no other test's traffic is counted."""
    proc, url = start_redis(tmp_path / "redis")
    redis = aioredis.from_url(url)
    try:
        a = make_sampler(redis_url=url, batch_store="redis", **SETTINGS)
        async with SamplerClient(a.url, poll_timeout=20) as client:
            whole = await client.get_batch_arrays(0, timeout=60)
        table = await _table(url, namespace)
        total_bytes = sum(b for _, b in table)
        biggest = max(b for _, b in table)
        assert len(table) >= 5, table
        b = make_sampler(redis_url=url, batch_store="redis", **SETTINGS)
        async with SamplerClient(b.url, poll_timeout=5) as client:
            # B is up and has nothing sealed in memory: its answers come from Redis.
            assert (await client.get_batch_arrays(0, 0, 4, timeout=10)).num_samples == TOTAL // 4
            overhead = 32 << 10  # the manifest, INFO's own reply, replies to B's and A's small commands
            shares = []
            for rank in range(4):
                start, stop = share_range(TOTAL, rank, 4)
                needed = sum(table[p.index][1] for p in pieces(table, start, stop))
                assert needed <= total_bytes / 4 + 2 * biggest
                before = await _output_bytes(redis)
                share = await client.get_batch_arrays(0, rank, 4, timeout=10)
                sent = await _output_bytes(redis) - before
                shares.append(share.samples())
                assert sent >= needed, f"rank {rank}: Redis sent {sent} bytes, the share's chunks are {needed}"
                assert sent <= needed + overhead, (
                    f"rank {rank} of 4: Redis sent {sent} bytes to serve a share whose chunks are {needed} bytes "
                    f"(the whole batch is {total_bytes} bytes in {len(table)} chunks)")
                assert sent < total_bytes / 2
            # The measure sees a whole read as one: world_size 1 reads every chunk.
            before = await _output_bytes(redis)
            again = await client.get_batch_arrays(0, timeout=10)
            assert await _output_bytes(redis) - before >= total_bytes
        assert codec.plain([s for share in shares for s in share]) == codec.plain(whole.samples())
        assert codec.plain(again.samples()) == codec.plain(whole.samples())
    finally:
        await redis.aclose()
        proc.terminate()


async def test_a_batch_that_does_not_split_evenly_is_a_422_saying_so(make_sampler):
    sampler = make_sampler(prompts_per_step=4, num_generations=4)  # 16 samples
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        assert (await http.get("/batch", params={"step": 0, "timeout": 20})).status_code == 200
        for world_size, accept in ((3, FRAMES), (5, codec.JSON), (32, codec.ARRAYS)):
            response = await http.get("/batch", params={"step": 0, "rank": 0, "world_size": world_size},
                                      headers={"Accept": accept})
            assert response.status_code == 422, response.text
            detail = response.json()["detail"]
            assert detail == f"a batch of 16 samples cannot be split evenly over world_size={world_size}"
        assert (await http.get("/batch", params={"step": 0, "rank": 3, "world_size": 4})).status_code == 200
    async with SamplerClient(sampler.url, poll_timeout=5) as client:
        with pytest.raises(SamplerRequestError, match="cannot be split evenly over world_size=3") as caught:
            await client.get_batch_arrays(0, 1, 3, timeout=10)
        assert caught.value.status == 422
