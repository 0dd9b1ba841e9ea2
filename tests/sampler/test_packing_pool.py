"""services/sampler/storage/packing.py: chunk boundaries found a column at a time are exactly
the per-sample rule's, a batch is packed into the buffers of a batch dropped before (never
into those of one still held), and a share's edges are sent as views of the stored chunks."""

from __future__ import annotations

import gc
import random

import numpy as np
import pytest

from services.sampler.storage import packing
from shared.chunks import decode_chunk, samples_of, slice_chunk


def _per_sample_runs(samples: list[dict], chunk_bytes: int) -> list[tuple[int, int]]:
    """The rule, one sample at a time: a run ends at the first group boundary where its
    samples' approximate bytes reach chunk_bytes."""
    runs, start, size = [], 0, 0
    for i, sample in enumerate(samples):
        if size >= chunk_bytes and i > start and sample.get("group_id") != samples[i - 1].get("group_id"):
            runs.append((start, i))
            start, size = i, 0
        size += packing._approx_bytes(sample)
    runs.append((start, len(samples)))
    return runs


def _odd_sample(rng: random.Random) -> dict:
    """A sample whose sized fields are arrays, lists, strings, None or missing."""
    sample = {"group_id": rng.choice(["a", "b", "c", None])}
    if rng.random() < 0.8:
        sample["completion_token_ids"] = np.zeros(rng.randrange(0, 50), rng.choice([np.int32, np.int64]))
    if rng.random() < 0.3:
        sample["prompt_token_ids"] = [1] * rng.randrange(5)
    if rng.random() < 0.5:
        sample["prompt_text"] = "x" * rng.randrange(30)
    if rng.random() < 0.1:
        sample["completion_text"] = None
    if rng.random() < 0.2:
        del sample["group_id"]
    return sample


@pytest.mark.parametrize("seed", range(5))
def test_group_runs_are_the_per_sample_rule_exactly(seed):
    rng = random.Random(seed)
    for _ in range(300):
        samples = [_odd_sample(rng) for _ in range(rng.randrange(0, 40))]
        chunk_bytes = rng.choice([0, 1, 100, 300, 1000, 5000])
        want = _per_sample_runs(samples, chunk_bytes) if samples else [(0, 0)]
        assert packing.group_runs(samples, chunk_bytes) == want, (samples, chunk_bytes)


def _samples(groups: int, tokens: int, tag: int) -> list[dict]:
    return [{"group_id": f"g{g}", "completion_token_ids": np.full(tokens, tag + g, np.int32),
             "completion_logprobs": np.full(tokens, -0.5), "prompt_text": "p" * 100}
            for g in range(groups) for _ in range(4)]


def _addresses(batch: packing.SealedBatch) -> set[int]:
    return {c.__array_interface__["data"][0] for c in batch.chunks}


@pytest.fixture
def pool():
    packing.CHUNK_BUFFERS.clear()
    yield packing.CHUNK_BUFFERS
    packing.CHUNK_BUFFERS.clear()


def test_a_batch_is_packed_into_the_buffers_of_one_dropped_before_and_never_a_held_ones(pool):
    tokens = 40_000  # ~1.9 MB a group of 4: two groups a chunk (the bound is 2 MiB), 3 chunks a batch
    first = packing.pack(1, _samples(6, tokens, 0), {}, 1 << 21)
    second = packing.pack(2, _samples(6, tokens, 100), {}, 1 << 21)
    assert len(first.chunks) == len(second.chunks) == 3 and pool.keep == 3
    held, dropped = bytes(b"".join(bytes(c) for c in second.chunks)), _addresses(first)
    assert not dropped & _addresses(second)
    reused = pool.reused
    del first
    gc.collect()
    third = packing.pack(3, _samples(6, tokens, 200), {}, 1 << 21)
    assert _addresses(third) == dropped and pool.reused == reused + 3
    # The held batch is untouched, the new one holds its own samples.
    assert b"".join(bytes(c) for c in second.chunks) == held
    got = [s for c in third.chunks for s in samples_of(decode_chunk(c))]
    assert [int(s["completion_token_ids"][0]) for s in got] == [200 + g for g in range(6) for _ in range(4)]


def test_the_pool_keeps_one_batch_worth_of_free_buffers(pool):
    batches = [packing.pack(i, _samples(6, 40_000, i), {}, 1 << 21) for i in range(3)]
    small = packing.pack(9, _samples(2, 40_000, 9), {}, 1 << 21)  # the last packed: 1 chunk
    assert pool.keep == 1
    del batches
    gc.collect()
    assert pool.free_bytes == 4 << 20  # one mapping (a 3.8 MB chunk, 1 MiB grain), not nine
    del small


def test_a_share_edge_is_sent_as_views_of_the_stored_chunk_not_a_copy(pool):
    """The edges of a share are the bytes slice_chunk lays out (the wire format is unchanged),
    but sent as a new header and offsets plus views of the stored chunk: nothing of the share's
    token arrays is copied, and no buffer is taken, pooled or fresh (right after a seal the
    packing has taken every pooled one: the copy went to fresh memory, 4-26 ms a 1 GiB batch's
    ws-8 share on the 2-core VM)."""
    batch = packing.pack(1, _samples(6, 40_000, 0), {}, 1 << 21)
    assert [n for n, _ in batch.table] == [8, 8, 8]
    parts = packing.pieces(batch.table, 2, 14)  # cuts the first chunk and the second
    assert [p.whole for p in parts] == [False, False]
    stored = [batch.chunks[p.index] for p in parts]
    reused, free = pool.reused, pool.free_bytes
    chunks = packing.share_chunks(parts, stored)
    assert (pool.reused, pool.free_bytes) == (reused, free)  # no buffer taken from the pool
    for part, chunk, buf in zip(parts, chunks, stored):
        edge = b"".join(chunk)
        assert edge == bytes(slice_chunk(buf, part.start, part.stop))
        copied = sum(len(p) for p in chunk if not np.shares_memory(np.frombuffer(p, np.uint8), buf))
        assert copied < len(edge) // 100, (copied, len(edge))
    assert [s["group_id"] for c in chunks for s in samples_of(decode_chunk(packing.joined(c)))] == \
        [f"g{i // 4}" for i in range(2, 14)]
    whole = packing.share_chunks(packing.pieces(batch.table, 8, 16), [batch.chunks[1]])
    assert whole == [[batch.chunks[1]]]  # a whole chunk is sent as stored
