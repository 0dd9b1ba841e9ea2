"""Packing a batch into chunks (shared/chunks.py), and which chunks hold a rank's share.

A batch's samples are cut into chunks at group boundaries, each about `chunk_bytes` (a
group larger than that is a chunk by itself), so a rank's share is whole chunks plus at
most a part of one chunk at each end: reading it costs O(share + chunk), never O(batch).
"""

from __future__ import annotations

import asyncio
import json
import operator
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.sampler.storage.chunk_files import ChunkFiles, EarlyWrite
from shared import chunks as chunk_format
from shared.recv_buffers import RecvBuffers

DEFAULT_CHUNK_BYTES = 4 << 20

# Chunk buffers come back here when the last reference to a chunk is gone (the batch trimmed
# or evicted from the store's memory, its last response sent), and the next batch is packed
# into them: on the 2-core VM, first-touching fresh memory cost more than the copies into it
# (64 MiB of chunks: ~45 ms packing into fresh mappings against ~10 ms of copying, and far more
# when the host has taken the freed pages back: recv_buffers.py). It keeps as many as the last
# batch packed had chunks (one batch's worth: with keep_batches = 1, the sampler's peak already
# held two batches while the newest was built; now that peak stays mapped). The 1 MiB grain
# keeps a 4.1 MiB chunk's mapping at 5 MiB, of which only what is written is ever resident.
CHUNK_BUFFERS = RecvBuffers(keep=0, grain=1 << 20)


@dataclass
class SealedBatch:
    """A batch as stored: its chunks (None until read) and the manifest describing them."""

    step: int
    build: str
    stats: dict[str, Any]
    table: list[tuple[int, int]]  # (samples, bytes) per chunk
    chunks: list[Any] | None = None
    # Where the chunks are files (chunk_files.py): the build's directory; None: Redis strings.
    files: str | None = None
    # The chunks' file writes begun while they were packed (pack_writing), until the seal takes them.
    early: EarlyWrite | None = None

    @property
    def num_samples(self) -> int:
        return sum(n for n, _ in self.table)

    @property
    def nbytes(self) -> int:
        return sum(b for _, b in self.table)

    def manifest(self) -> tuple[str, str]:
        """(table, stats) as the manifest stores them."""
        return json.dumps(self.table), json.dumps(self.stats)

    @classmethod
    def from_manifest(cls, step: int, fields: dict[bytes, bytes]) -> SealedBatch:
        table = [(int(n), int(b)) for n, b in json.loads(fields[b"table"])]
        files = fields.get(b"dir")
        return cls(step, fields[b"build"].decode(), json.loads(fields[b"stats"]), table,
                   files=files.decode() if files is not None else None)


_SIZED = ("prompt_token_ids", "completion_token_ids", "completion_logprobs", "loss_mask",
          "prompt_text", "completion_text")


def _approx_bytes(sample: dict[str, Any]) -> int:
    """About what `sample` takes in a chunk: its token arrays and texts (the rest is small)."""
    size = 256
    for key in _SIZED:
        value = sample.get(key)
        if value is not None:
            if isinstance(value, np.ndarray):
                size += value.nbytes
            else:
                size += len(value) * (1 if isinstance(value, str) else 8)
    return size


_NBYTES = operator.attrgetter("nbytes")


def _sizes(samples: list[dict[str, Any]]) -> np.ndarray:
    """`_approx_bytes` of every sample, a column at a time: one C-level pass per field when the
    field's values are all numpy arrays or all strings (the usual batch), per sample otherwise
    (that per-sample Python work was a large part of packing a GiB: 117k samples)."""
    n = len(samples)
    sizes = np.full(n, 256, np.int64)
    for key in _SIZED:
        values = _column(samples, key)
        kinds = set(map(type, values))
        if kinds == {np.ndarray}:
            sizes += np.fromiter(map(_NBYTES, values), np.int64, n)
        elif kinds == {str}:
            sizes += np.fromiter(map(len, values), np.int64, n)
        elif kinds != {type(None)}:
            sizes += np.fromiter((_approx_bytes({key: v}) - 256 for v in values), np.int64, n)
    return sizes


def _column(samples: list[dict[str, Any]], key: str) -> list[Any]:
    """`[s.get(key) for s in samples]`, in one C-level pass when every sample has the key."""
    try:
        return list(map(operator.itemgetter(key), samples))
    except KeyError:
        return [s.get(key) for s in samples]


def estimate_bytes(samples: list[dict[str, Any]]) -> int:
    """About how large `samples` pack, from the first few (without touching every sample)."""
    if not samples:
        return 0
    head = samples[:8]
    return sum(_approx_bytes(s) for s in head) * len(samples) // len(head)


def group_runs(samples: list[dict[str, Any]], chunk_bytes: int) -> list[tuple[int, int]]:
    """[start, stop) sample ranges of about `chunk_bytes`, cut only where group_id changes: a
    run ends at the first group boundary where its samples' `_approx_bytes` reach
    `chunk_bytes` (a group larger than that is a run by itself)."""
    n = len(samples)
    if n == 0:
        return [(0, 0)]
    ids = _column(samples, "group_id")
    # Sample i starts a group when its id differs from sample i-1's; cut only there.
    starts = np.flatnonzero(np.fromiter(map(operator.ne, ids[1:], ids[:-1]), bool, n - 1)) + 1
    ends = np.zeros(n + 1, np.int64)  # ends[i]: the bytes of samples before i
    np.cumsum(_sizes(samples), out=ends[1:])
    at_starts = ends[starts]  # strictly increasing: every sample counts >= 256 bytes
    runs, start = [], 0
    while True:
        # The first boundary past `start` with at least chunk_bytes (and at least one sample) before it.
        j = int(np.searchsorted(at_starts, ends[start] + max(chunk_bytes, 1)))
        if j == len(starts):
            break
        cut = int(starts[j])
        runs.append((start, cut))
        start = cut
    runs.append((start, n))
    return runs


def pack(step: int, samples: list[dict[str, Any]], stats: dict[str, Any],
         chunk_bytes: int = DEFAULT_CHUNK_BYTES, *, build: str | None = None,
         on_chunk: Callable[[int, Any], None] | None = None) -> SealedBatch:
    """Batch `step` as chunks: each sample's numbers copied once, into its chunk. `on_chunk(i,
    buffer)` is called as each chunk is done."""
    runs = group_runs(samples, chunk_bytes)
    CHUNK_BUFFERS.set_keep(len(runs))
    buffers = []
    for a, b in runs:
        buffers.append(chunk_format.encode_samples(samples[a:b], CHUNK_BUFFERS.take))
        if on_chunk is not None:
            on_chunk(len(buffers) - 1, buffers[-1])
    table = [(b - a, len(buf)) for (a, b), buf in zip(runs, buffers)]
    return SealedBatch(step, build or uuid.uuid4().hex[:16], stats, table, buffers)


async def pack_writing(step: int, samples: list[dict[str, Any]], stats: dict[str, Any], chunk_bytes: int,
                       files: ChunkFiles | None) -> SealedBatch:
    """`pack` in a worker thread (the event loop goes on answering meanwhile; the copies release
    the GIL). With `files`, each chunk's write and fsync begin as soon as it is packed, so that
    the disk works while the next chunks are packed instead of after all of them (measured on
    the 2-core machine: packing ~1.3 GB/s, writing ~1.7 GB/s, one after the other ~0.7 GB/s);
    the seal still waits for every chunk to be durable (Store.seal, ChunkFiles.write)."""
    build = uuid.uuid4().hex[:16]
    early = EarlyWrite(files, step, build) if files is not None else None
    try:
        batch = await asyncio.to_thread(pack, step, samples, stats, chunk_bytes, build=build,
                                        on_chunk=early.submit if early is not None else None)
    except BaseException:
        if early is not None:  # a chunk that cannot be packed, or a shutdown: no file of it stays
            early.abandon()
        raise
    batch.early = early
    return batch


@dataclass(frozen=True)
class Piece:
    """Samples start..stop-1 of chunk `index` (the whole chunk when they are all of it)."""

    index: int
    start: int
    stop: int
    whole: bool


def share_range(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank `rank`'s contiguous sample range; ValueError when `total` does not split evenly.
    Equal contiguous slices keep groups whole whenever the share is a multiple of the group
    size (samples are stored group by group); otherwise groups are split, unavoidably."""
    if total % world_size:
        raise ValueError(f"a batch of {total} samples cannot be split evenly over world_size={world_size}")
    share = total // world_size
    return rank * share, (rank + 1) * share


def share_chunks(parts: list[Piece], buffers: list[Any]) -> list[list[Any]]:
    """The chunks of a share, each as the pieces to send one after the other: a whole chunk as
    stored (one piece), a chunk its edges cut (at most two per share) as
    `chunk_format.slice_pieces`: a new header and offsets, and views of the stored chunk's
    large arrays. No buffer is taken and no token array copied: laying the edges out in
    buffers of their own went to fresh mappings right after a seal (the seal's packing had
    just taken every pooled one), 13-26 ms for both edges of a 1 GiB batch's ws-8 share in the
    sampler on the 2-core VM, against 1.1-3.9 ms for the pieces (~0.6 ms an edge unloaded)."""
    return [[buf] if p.whole else chunk_format.slice_pieces(buf, p.start, p.stop)
            for p, buf in zip(parts, buffers)]


def joined(chunk: list[Any]) -> Any:
    """One of `share_chunks`'s chunks as one buffer (the stored one when it is whole)."""
    return chunk[0] if len(chunk) == 1 else b"".join(chunk)


def pieces(table: list[tuple[int, int]], start: int, stop: int) -> list[Piece]:
    """The chunk pieces holding samples start..stop-1 of a batch with this chunk table."""
    out = []
    first = 0
    for index, (n, _) in enumerate(table):
        lo, hi = max(start, first), min(stop, first + n)
        if lo < hi:
            out.append(Piece(index, lo - first, hi - first, lo == first and hi == first + n))
        first += n
    return out
