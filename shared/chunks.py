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
import operator
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from shared.codec import ARRAY_FIELDS, EXT_DTYPES, FRAMES, _typed  # noqa: F401 - FRAMES is re-exported

CHUNK_MAGIC, FRAME_MAGIC = b"TCK1", b"TBT1"
_PREFIX = struct.Struct("<4sI")
# dtype -> ext code; the little-endian dtypes compare (and hash) equal to native ones here.
_CODES = {dtype: code for code, dtype in EXT_DTYPES.items()}
_I8 = np.dtype("<i8")


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


# --- columns ---------------------------------------------------------------------------

@dataclass
class Columns:
    """One chunk's content in columns, before it is laid out (encode) or after (decode).

    `arrays`: field -> (values, offsets), where values may also be a list of per-sample arrays
    (what `columns_of` makes: `encode_chunk` joins them straight into the chunk); `numbers`: key -> array; `texts`: key -> (UTF-8
    bytes as a uint8 array, offsets); `lists`: key -> list; `absent`: key -> sample indices
    without the key."""

    n: int
    arrays: dict[str, tuple[np.ndarray | list[np.ndarray], np.ndarray]] = field(default_factory=dict)
    numbers: dict[str, np.ndarray] = field(default_factory=dict)
    texts: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    lists: dict[str, list] = field(default_factory=dict)
    absent: dict[str, list[int]] = field(default_factory=dict)


def _offsets(lengths: list[int] | np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, _I8)
    np.cumsum(lengths, out=out[1:])
    return out


def _array_column(values: list[Any], codes: tuple[str, ...]) -> list[np.ndarray] | None:
    """Each sample's array for one token field, or None when some value has no exact type.
    Types and dtypes are checked per distinct one, not per sample (a column of numpy arrays
    usually has one dtype): per-sample Python work was most of packing's time (~7 us a
    sample, 117k samples a GiB, against ~1 ms a GiB of copying)."""
    types = set(map(type, values))
    if all(issubclass(kind, np.ndarray) for kind in types):
        if values and set(map(_NDIM, values)) != {1}:
            return None
        for dtype in set(map(_DTYPE, values)):
            # (A big-endian array is accepted too; its chunk column is little-endian.)
            if dtype not in _CODES and dtype.newbyteorder("<") not in _CODES:
                return None
        return values
    if not all(kind is list or issubclass(kind, np.ndarray) for kind in types):
        return None
    out = []
    for value in values:  # lists (a JSON body's): each converted, as `with_arrays` would
        if type(value) is list:
            value = _typed(value, codes)
            if not isinstance(value, np.ndarray):
                return None
        elif value.ndim != 1 or (value.dtype not in _CODES and value.dtype.newbyteorder("<") not in _CODES):
            return None
        out.append(value)
    return out


_NDIM, _DTYPE = operator.attrgetter("ndim"), operator.attrgetter("dtype")


def _one_kind(arrays: list[np.ndarray]) -> bool:
    """A column has one dtype: ints and floats in one field would round ids past 2**53, so
    such a field travels as exact lists instead."""
    kinds = {dtype.kind for dtype in set(map(_DTYPE, arrays))}
    return not ("f" in kinds and kinds & {"i", "u"})


def _lengths(values: list[Any]) -> np.ndarray:
    return np.fromiter(map(len, values), _I8, len(values))


def _text_column(values: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """UTF-8 bytes back to back, and offsets. Short ASCII strings (ids, finish reasons) are
    encoded in one piece, their byte lengths being their character lengths (measured: ~40%
    less time for 455 ids); long texts are faster encoded one by one (joining 1,500-character
    strings first took ~3x as long)."""
    if values and len(values[0]) <= 64:
        joined = "".join(values)
        if joined.isascii():
            return np.frombuffer(joined.encode(), np.uint8), _offsets(_lengths(values))
    encoded = list(map(str.encode, values))
    return np.frombuffer(b"".join(encoded), np.uint8), _offsets(_lengths(encoded))


def _by_key(samples: list[dict[str, Any]]) -> tuple[dict[str, list[Any]], dict[str, list[int]]]:
    """Each key's values in the samples that have it (keys in order of first appearance), and
    the indices of the samples that lack each key that some lack."""
    n = len(samples)
    first = samples[0] if samples else {}
    # The usual chunk: every sample has the first one's keys and no other (each has at least
    # them, so the same total count means exactly them). Then a column is one C-level pass.
    if sum(map(len, samples)) == n * len(first):
        try:
            return {key: list(map(operator.itemgetter(key), samples)) for key in first}, {}
        except KeyError:
            pass
    keys: dict[str, None] = {}
    for sample in samples:
        keys.update(dict.fromkeys(sample))
    present, absent = {}, {}
    for key in keys:
        present[key] = [s[key] for s in samples if key in s]
        if len(present[key]) < n:
            absent[key] = [i for i, s in enumerate(samples) if key not in s]
    return present, absent


def columns_of(samples: list[dict[str, Any]]) -> Columns:
    """The columns of `samples` (sample dicts with lists or numpy arrays in the token fields)."""
    cols = Columns(len(samples))
    by_key, cols.absent = _by_key(samples)
    for key, present in by_key.items():
        codes = ARRAY_FIELDS.get(key)
        if codes is not None:
            arrays = _array_column(present, codes)
            if arrays is not None and _one_kind(arrays):
                cols.arrays[key] = (arrays, _offsets(_lengths(arrays)))
                continue
        kinds = set(map(type, present))
        if kinds == {float}:
            cols.numbers[key] = np.array(present, "<f8")
            continue
        if kinds == {int}:
            try:  # numpy refuses (OverflowError) a value outside int64
                cols.numbers[key] = np.array(present, "<i8")
                continue
            except OverflowError:
                pass
        if kinds == {str}:
            cols.texts[key] = _text_column(present)
        elif any(issubclass(kind, (np.ndarray, np.generic)) for kind in kinds):
            cols.lists[key] = [v.tolist() if isinstance(v, (np.ndarray, np.generic)) else v for v in present]
        else:
            cols.lists[key] = present
    return cols


def _slice_pairs(values: np.ndarray, offsets: np.ndarray, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    a, b = int(offsets[start]), int(offsets[stop])
    return values[a:b], offsets[start:stop + 1] - a


def slice_columns(cols: Columns, start: int, stop: int) -> Columns:
    """Samples start..stop-1 of `cols` (views where possible)."""
    out = Columns(stop - start)
    present_index = {}
    for key, missing in cols.absent.items():
        # Positions in the key's own column (it only holds samples that have the key).
        have = np.setdiff1d(np.arange(cols.n), missing)
        lo, hi = np.searchsorted(have, start), np.searchsorted(have, stop)
        present_index[key] = (int(lo), int(hi))
        kept = [i - start for i in missing if start <= i < stop]
        if kept:
            out.absent[key] = kept

    def span(key: str) -> tuple[int, int]:
        return present_index.get(key, (start, stop))

    for key, (values, offsets) in cols.arrays.items():
        out.arrays[key] = _slice_pairs(values, offsets, *span(key))
    for key, values in cols.numbers.items():
        lo, hi = span(key)
        out.numbers[key] = values[lo:hi]
    for key, (values, offsets) in cols.texts.items():
        out.texts[key] = _slice_pairs(values, offsets, *span(key))
    for key, values in cols.lists.items():
        lo, hi = span(key)
        out.lists[key] = values[lo:hi]
    return out


# --- chunks ----------------------------------------------------------------------------

def _dtype_of(values: np.ndarray | list[np.ndarray]) -> np.dtype:
    if isinstance(values, np.ndarray):
        return values.dtype.newbyteorder("<")
    # Over the distinct dtypes (a column usually has one), not over every sample's array.
    return np.result_type(*set(map(_DTYPE, values))).newbyteorder("<") if values else EXT_DTYPES[1]


def encode_chunk(cols: Columns, take: Callable[[int], Any] = alloc) -> Any:
    """Lay `cols` out as one chunk: every number copied once, into the chunk's buffer, which
    `take(size)` gives (any writable buffer of that size; its old bytes are all overwritten,
    padding included, so a reused one serves: recv_buffers.RecvBuffers.take)."""
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
    start = _pad8(_PREFIX.size + len(head))
    buf = take(start + cursor)
    view = memoryview(buf).cast("B")
    _PREFIX.pack_into(view, 0, CHUNK_MAGIC, len(head))
    view[_PREFIX.size:start] = head + bytes(start - _PREFIX.size - len(head))
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


def _decode_chunk(buffer: Any) -> Columns:
    view = memoryview(buffer)
    header, start = _header(view, CHUNK_MAGIC, "batch chunk")
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
        return [data[bounds[i]:bounds[i + 1]].decode() for i in range(len(bounds) - 1)]
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
