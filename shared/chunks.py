"""The chunked batch format: how a sealed batch is stored in Redis and sent to trainers.

A batch is a sequence of **chunks**. A chunk holds consecutive whole groups (at least one
group; about `chunk_bytes` of them) in columns, so that nothing in it needs a Python object
per token to write or to read:

    b"TCK1" | header length (u32 LE) | header (msgpack) | zero padding to 8 | data

* token fields (`codec.ARRAY_FIELDS`: ids, logprobs, loss mask): one typed little-endian
  array per field holding every sample's values back to back, plus an int64 offsets array
  (samples + 1 entries);
* scalar numbers (reward, advantage, policy_version, ...): one float64 or int64 array per
  key, when every sample has the same Python type for it (so a value never changes type);
* strings (ids, texts, finish_reason): UTF-8 bytes back to back plus int64 offsets;
* anything else (dicts, lists, None, mixed types): a msgpack list in the header;
* `absent`: per key, the samples that lack it (samples may carry extra keys).

Every array starts at a multiple of 8 bytes from the chunk's start, and a chunk's length is
a multiple of 8, so chunks laid end to end keep every array aligned.

A **frame** (media type `FRAMES`, what `GET /batch` answers a trainer with) is

    b"TBT1" | header length (u32 LE) | header (msgpack: step, stats, rank, world_size,
    num_samples, chunk lengths) | zero padding to 8 | chunk | chunk | ...

where the chunks are the stored bytes themselves: the sampler sends them without copying,
and `decode_frame` turns a received body into `BatchArrays` (numpy views of the body, one
set per chunk) without touching the numbers one by one.
"""

from __future__ import annotations

import gc
import mmap
import struct
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from shared.chunk_columns import _CODES, _DTYPE, _I8, Columns, _offsets, columns_of, slice_columns  # noqa: F401 - re-exported
from shared.codec import EXT_DTYPES, FRAMES  # noqa: F401 - FRAMES is re-exported

CHUNK_MAGIC, FRAME_MAGIC = b"TCK1", b"TBT1"
_PREFIX = struct.Struct("<4sI")


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: building many small objects (headers, sample
    dicts) otherwise sets off collections that walk every live object, often costing more
    than the work itself. Nothing made here forms reference cycles."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def alloc(size: int) -> Any:
    """A zeroed, writable buffer of `size` bytes. Large ones are private anonymous mappings
    asking for huge pages: first-touching 1 GiB page by page cost ~0.6-0.9 s on the 2-core
    machine (page faults; a shared mapping, mmap's default, never gets huge pages), against
    ~0.2 s with huge pages, and a mapping goes back to the system as soon as nothing uses it,
    where malloc'd memory may linger in the heap."""
    if size < 1 << 20:
        return bytearray(size)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # pragma: no cover - kernels without transparent huge pages
            pass
    return buf


def _pad8(n: int) -> int:
    return (n + 7) & ~7


# --- chunks ----------------------------------------------------------------------------

def _dtype_of(values: np.ndarray | list[np.ndarray]) -> np.dtype:
    if isinstance(values, np.ndarray):
        return values.dtype.newbyteorder("<")
    # Over the distinct dtypes (a column usually has one), not over every sample's array.
    return np.result_type(*set(map(_DTYPE, values))).newbyteorder("<") if values else EXT_DTYPES[1]


def _layout(cols: Columns) -> tuple[bytes, list[tuple[int, np.dtype, int, Any]], int]:
    """Where everything of `cols` goes in its chunk: the bytes before the data (prefix, header,
    padding), each array's (offset in the data, dtype, count, values), and the data's length."""
    places: list[tuple[int, np.dtype, int, Any]] = []
    cursor = 0

    def place(values: np.ndarray | list[np.ndarray], dtype: np.dtype | None = None) -> list[int]:
        nonlocal cursor
        dtype = dtype or _dtype_of(values)
        count = len(values) if isinstance(values, np.ndarray) else sum(map(len, values))
        at = cursor
        places.append((at, dtype, count, values))
        cursor = _pad8(cursor + count * dtype.itemsize)
        return [at, count]

    header: dict[str, Any] = {"n": cols.n}
    arrays = {}
    for key, (values, offsets) in cols.arrays.items():
        dtype = _dtype_of(values)
        arrays[key] = [_CODES[dtype], *place(values, dtype), place(offsets)[0]]
    header["arrays"] = arrays
    header["numbers"] = {k: [_CODES[_dtype_of(v)], place(v)[0]] for k, v in cols.numbers.items()}
    header["texts"] = {k: [*place(v), place(o)[0]] for k, (v, o) in cols.texts.items()}
    header["lists"] = cols.lists
    header["absent"] = cols.absent
    head = msgpack.packb(header, use_bin_type=True)
    lead = _PREFIX.pack(CHUNK_MAGIC, len(head)) + head + bytes(_pad8(_PREFIX.size + len(head)) - _PREFIX.size - len(head))
    return lead, places, cursor


def encode_chunk(cols: Columns, take: Callable[[int], Any] = alloc) -> Any:
    """Lay `cols` out as one chunk: every number copied once, into the chunk's buffer, which
    `take(size)` gives (any writable buffer of that size; its old bytes are all overwritten,
    padding included, so a reused one serves: recv_buffers.RecvBuffers.take)."""
    lead, places, size = _layout(cols)
    start = len(lead)
    buf = take(start + size)
    view = memoryview(buf).cast("B")
    view[:start] = lead
    for at, dtype, count, values in places:
        if not count:
            continue
        target = np.frombuffer(view, dtype, count, start + at)
        if isinstance(values, np.ndarray):
            target[...] = values
        else:
            np.concatenate(values, out=target, casting="safe")
        end = start + at + count * dtype.itemsize
        view[end:_pad8(end)] = bytes(_pad8(end) - end)  # the padding, zero as the format says
    return buf


# Arrays at least this large are sent as views of their own memory by `chunk_pieces`; smaller
# ones (and headers, offsets, padding) are copied into joined bytes: fewer, larger writes.
VIEW_BYTES = 64 << 10


def chunk_pieces(cols: Columns, view_bytes: int = VIEW_BYTES) -> list[Any]:
    """`encode_chunk(cols)`'s bytes as pieces to send one after the other, without laying the
    chunk out in memory of its own: each array of at least `view_bytes` that is contiguous and
    of its chunk dtype already (a slice of a stored chunk's column) is a view of its own memory,
    the rest (header, offsets, small arrays, padding) is copied into bytes between them.
    `b"".join(chunk_pieces(cols)) == bytes(encode_chunk(cols))`, always."""
    lead, places, _ = _layout(cols)
    out: list[Any] = []
    small = bytearray(lead)
    for _, dtype, count, values in places:
        if not count:
            continue
        nbytes = count * dtype.itemsize
        if (isinstance(values, np.ndarray) and values.dtype == dtype and values.flags.c_contiguous
                and nbytes >= view_bytes):
            if small:
                out.append(small)
                small = bytearray()
            out.append(memoryview(values.view(np.uint8)))
        else:
            joined = values if isinstance(values, np.ndarray) else np.concatenate(values)
            small += memoryview(np.ascontiguousarray(joined, dtype).view(np.uint8))
        small += bytes(_pad8(nbytes) - nbytes)
    if small:
        out.append(small)
    return out


def encode_samples(samples: list[dict[str, Any]], take: Callable[[int], Any] = alloc) -> Any:
    """One chunk holding `samples` (sample dicts; token fields as lists or numpy arrays), in a
    buffer from `take` (encode_chunk)."""
    with gc_paused():
        return encode_chunk(columns_of(samples), take)


def _header(buffer: memoryview, magic: bytes, what: str) -> tuple[dict[str, Any], int]:
    if len(buffer) < _PREFIX.size:
        raise ValueError(f"{what}: {len(buffer)} bytes is too short")
    found, size = _PREFIX.unpack_from(buffer, 0)
    if found != magic:
        raise ValueError(f"{what}: starts with {bytes(found)!r}, expected {magic!r}")
    end = _PREFIX.size + size
    if end > len(buffer):
        raise ValueError(f"{what}: header of {size} bytes overruns the {len(buffer)}-byte buffer")
    try:
        header = msgpack.unpackb(buffer[_PREFIX.size:end], raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ValueError(f"{what}: its header is not valid msgpack ({exc})") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{what}: its header is a {type(header).__name__}, not a map")
    return header, _pad8(end)


def decode_chunk(buffer: Any) -> Columns:
    """The columns of one chunk, as numpy views of `buffer` (nothing is copied: a writable
    buffer, such as the bytearray a client receives into, gives writable arrays). A damaged
    chunk raises ValueError."""
    try:
        return _decode_chunk(buffer)
    except (KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"batch chunk: damaged header ({type(exc).__name__}: {exc})") from exc


class _Lists(Mapping):
    """A chunk header's `lists` (key -> one value per sample), each key's msgpack decoded on
    first use: building those Python objects (a dict of rewards and a list of versions per
    sample) was ~80% of decoding a chunk (~0.1 ms of ~0.12 ms for 455 samples), paid by
    every trainer for every chunk whether or not it reads them."""

    def __init__(self, raw: bytes, spans: dict[str, tuple[int, int]]):
        self._raw, self._spans, self._done = raw, spans, {}

    def __getitem__(self, key: str) -> list:
        value = self._done.get(key)
        if value is None:
            a, b = self._spans[key]
            value = self._done[key] = msgpack.unpackb(self._raw[a:b], raw=False, strict_map_key=False)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._spans)

    def __len__(self) -> int:
        return len(self._spans)


def _chunk_header(view: memoryview) -> tuple[dict[str, Any], int]:
    """A chunk's header as `_header` reads it, except that `lists` is a `_Lists`: its values
    are skipped over (checked, not built) until asked for."""
    if len(view) < _PREFIX.size or _PREFIX.unpack_from(view, 0)[0] != CHUNK_MAGIC:
        return _header(view, CHUNK_MAGIC, "batch chunk")  # its error
    size = _PREFIX.unpack_from(view, 0)[1]
    raw = bytes(view[_PREFIX.size:_PREFIX.size + size])
    if len(raw) < size:
        return _header(view, CHUNK_MAGIC, "batch chunk")
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(raw)
    header: dict[str, Any] = {}
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key != "lists":
                header[key] = unpacker.unpack()
                continue
            spans = {}
            for _ in range(unpacker.read_map_header()):
                name = unpacker.unpack()
                at = unpacker.tell()
                unpacker.skip()
                spans[name] = (at, unpacker.tell())
            header[key] = _Lists(raw, spans)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ValueError(f"batch chunk: its header is not valid msgpack ({exc})") from exc
    if unpacker.tell() != size:
        raise ValueError(f"batch chunk: its header has {size - unpacker.tell()} bytes past its end")
    return header, _pad8(_PREFIX.size + size)


def _decode_chunk(buffer: Any) -> Columns:
    view = memoryview(buffer).cast("B")
    header, start = _chunk_header(view)
    n = header["n"]
    absent = {k: list(v) for k, v in header["absent"].items()}

    def count(key: str) -> int:
        return n - len(absent.get(key, ()))

    def array(dtype: np.dtype, at: int, length: int) -> np.ndarray:
        return np.frombuffer(view, dtype, length, start + at)

    cols = Columns(n, absent=absent, lists=header["lists"])
    for key, (code, at, length, offsets_at) in header["arrays"].items():
        cols.arrays[key] = (array(EXT_DTYPES[code], at, length), array(_I8, offsets_at, count(key) + 1))
    for key, (code, at) in header["numbers"].items():
        cols.numbers[key] = array(EXT_DTYPES[code], at, count(key))
    for key, (at, length, offsets_at) in header["texts"].items():
        cols.texts[key] = (array(np.dtype(np.uint8), at, length), array(_I8, offsets_at, count(key) + 1))
    return cols


def keys_of(cols: Columns) -> list[str]:
    """Every key of the chunk's samples, in the order `samples_of` gives them."""
    return [*cols.arrays, *cols.numbers, *cols.texts, *cols.lists]


def values_of(cols: Columns, key: str) -> list[Any]:
    """`key`'s value in each sample that has it, in order: a token field as numpy views, every
    other value as a Python value."""
    if key in cols.arrays:
        values, offsets = cols.arrays[key]
        bounds = offsets.tolist()
        return [values[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]
    if key in cols.numbers:
        return cols.numbers[key].tolist()
    if key in cols.texts:
        values, offsets = cols.texts[key]
        data, bounds = values.tobytes(), offsets.tolist()
        try:
            return [data[bounds[i]:bounds[i + 1]].decode() for i in range(len(bounds) - 1)]
        except UnicodeDecodeError as exc:  # damaged bytes: the same error as any other damage
            raise ValueError(f"batch chunk: text column {key!r} is not UTF-8 ({exc.reason} at byte "
                             f"{exc.start} of a sample's text): the chunk is damaged") from None
    return cols.lists[key]


def samples_of(cols: Columns) -> list[dict[str, Any]]:
    """Sample dicts: token fields as numpy views, every other value as a Python value."""
    n = cols.n
    keys = keys_of(cols)
    columns = {key: values_of(cols, key) for key in keys}
    if not cols.absent:
        return [dict(zip(keys, row)) for row in zip(*columns.values())] if keys else [{} for _ in range(n)]
    samples: list[dict[str, Any]] = [{} for _ in range(n)]
    for key, values in columns.items():
        missing = set(cols.absent.get(key, ()))
        indices = [i for i in range(n) if i not in missing] if missing else range(n)
        for i, value in zip(indices, values):
            samples[i][key] = value
    return samples


def samples_of_chunks(buffers: list[Any]) -> list[dict[str, Any]]:
    """The samples of these chunks (stored bytes), in order, as `samples_of` makes them."""
    with gc_paused():
        return [sample for buffer in buffers for sample in samples_of(decode_chunk(buffer))]


def slice_chunk(buffer: Any, start: int, stop: int, take: Callable[[int], Any] = alloc) -> Any:
    """A new chunk holding samples start..stop-1 of the chunk in `buffer` (in a buffer from `take`)."""
    return encode_chunk(slice_columns(decode_chunk(buffer), start, stop), take)


def slice_pieces(buffer: Any, start: int, stop: int) -> list[Any]:
    """`slice_chunk(buffer, start, stop)`'s bytes as `chunk_pieces`: its large arrays are views
    of `buffer` (keep it unchanged until they are sent), only its header, offsets and small
    arrays are new bytes."""
    return chunk_pieces(slice_columns(decode_chunk(buffer), start, stop))


# --- frames ----------------------------------------------------------------------------

def is_frames(content_type: str | None) -> bool:
    """Whether a Content-Type header names the `FRAMES` media type."""
    return bool(content_type) and content_type.split(";")[0].strip().lower() == FRAMES


def frame_head(*, step: int, stats: dict[str, Any], chunk_lengths: list[int], num_samples: int,
               rank: int = 0, world_size: int = 1) -> bytes:
    """The bytes before the chunks in a `FRAMES` body."""
    for length in chunk_lengths:
        if length % 8:
            raise ValueError(f"a chunk of {length} bytes is not a multiple of 8 (not made by encode_chunk)")
    head = msgpack.packb({"step": step, "stats": stats, "rank": rank, "world_size": world_size,
                          "num_samples": num_samples, "chunks": chunk_lengths}, use_bin_type=True)
    start = _pad8(_PREFIX.size + len(head))
    return _PREFIX.pack(FRAME_MAGIC, len(head)) + head + bytes(start - _PREFIX.size - len(head))


@dataclass
class BatchArrays:
    """A decoded `FRAMES` body: the batch's (or one rank's share's) chunks as columns of numpy
    views of the received buffer. `column(field)` joins a token field over the chunks (one
    copy); `samples()` makes sample dicts (one Python dict per sample, views per token field)."""

    step: int
    stats: dict[str, Any]
    rank: int
    world_size: int
    num_samples: int
    chunks: list[Columns]

    def column(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(values, offsets) of a token field over the whole share; sample i's values are
        values[offsets[i]:offsets[i + 1]]. One chunk: views, no copy."""
        parts = self.per_chunk(name)
        if len(parts) == 1:
            return parts[0]
        values = np.concatenate([v for v, _ in parts])
        return values, _offsets(np.concatenate([np.diff(o) for _, o in parts]))

    def tensors(self, name: str) -> list[tuple[Any, Any]]:
        """(values, offsets) of a token field per chunk as torch tensors sharing the received
        buffer (no copy: every dtype of the format is one torch has). Needs torch."""
        import torch

        return [(torch.from_numpy(v), torch.from_numpy(o)) for v, o in self.per_chunk(name)]

    def per_chunk(self, name: str) -> list[tuple[np.ndarray, np.ndarray]]:
        """(values, offsets) of a token field in each chunk: views, no copy."""
        parts = [c.arrays[name] for c in self.chunks if name in c.arrays]
        if len(parts) != len(self.chunks):
            raise KeyError(f"{name!r} is not a typed array in every chunk of this batch")
        return parts

    def samples(self) -> list[dict[str, Any]]:
        with gc_paused():
            return [sample for chunk in self.chunks for sample in samples_of(chunk)]

    def as_dict(self) -> dict[str, Any]:
        """The contract's batch structure ({"step", "samples", "stats", ...})."""
        body: dict[str, Any] = {"step": self.step, "samples": self.samples(), "stats": self.stats}
        if self.world_size > 1:
            body["rank"], body["world_size"] = self.rank, self.world_size
        return body


def decode_frame(buffer: Any) -> BatchArrays:
    """A `FRAMES` body (any buffer; keep it alive as long as the arrays) as `BatchArrays`."""
    view = memoryview(buffer)
    header, at = _header(view, FRAME_MAGIC, "batch body")
    try:
        with gc_paused():
            chunks = _chunks_at(view, at, header["chunks"])
        arrays = BatchArrays(header["step"], header["stats"], header["rank"], header["world_size"],
                             header["num_samples"], chunks)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"batch body: damaged header ({type(exc).__name__}: {exc})") from exc
    got = sum(c.n for c in chunks)
    if got != arrays.num_samples:
        raise ValueError(f"batch body: its chunks hold {got} samples, its header says {arrays.num_samples}")
    return arrays


def _chunks_at(view: memoryview, at: int, lengths: list[int]) -> list[Columns]:
    chunks = []
    for length in lengths:
        if at + length > len(view):
            raise ValueError(f"batch body: a chunk of {length} bytes at {at} overruns the {len(view)}-byte body "
                             "(a truncated response?)")
        chunks.append(decode_chunk(view[at:at + length]))
        at += length
    return chunks
