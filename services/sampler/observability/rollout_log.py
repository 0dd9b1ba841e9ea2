"""Rollout log: every sealed batch written to one Parquet file (zstd) under run_dir.

Layout: `run_dir/rollouts/step-000012.parquet`, one file per sealed batch, one row per
sample, in batch order (groups contiguous). A file appears atomically (written to a
temporary name, then renamed), so a reader never sees half a file; the directory reads
as one dataset (`pyarrow.dataset.dataset(dir)` or `pandas.read_parquet(dir)`).

Columns (a fixed schema, so files of one run concatenate):
  step, prompt_id, group_id, sample_index, env, prompt_text, completion_text,
  prompt_token_ids, completion_token_ids, completion_logprobs, loss_mask,
  reward, rewards (map name -> value), advantage, policy_version, staleness,
  finish_reason, versions, use_count, created_at, sealed_at, extra (JSON of any
  sample keys not listed here, e.g. a strategy's own fields).
The batch's stats are in the file's schema metadata under `tandem.stats` (JSON).

The writer is a producer `on_sealed` hook. It starts 20 ms after the batch has been sent to a
trainer (or after a second, when none asks for it), so that it does not share the CPU with
the hand-off, and builds the Arrow table on the event loop: from the batch's sealed chunks
when this process still holds them (`chunk_table`: their columns become Arrow arrays from the
same buffers, with no Python object per sample; ~1.3 ms against ~4 ms from the samples for
1,024 of them), else from the samples,
column by column (token columns from the arrays form in one concatenation each), yielding
to the loop every half millisecond, and hands Parquet
encoding, compression and disk I/O (which release the GIL) to a worker thread
(`asyncio.to_thread`). Converting Python objects in the worker thread instead, as an
earlier version did, holds the GIL there while the event loop needs it after every socket
read and write; under `bench throughput` that contention cost the event loop more CPU
than the conversion itself. pyarrow (and, through it, pandas) is imported before `tandem
sampler` serves (entrypoint.py); an app served in another process imports it in a worker
thread when it starts (`preload`).

Each batch gets its own file right after its hand-off (nothing is buffered across batches,
so the file layout above holds; files trail the seals by at most about a second). A process
killed between a seal and that file's rename leaves that step without a file, normally
only the last step (the batch itself stays in Redis until trimmed); a file is either
complete or absent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from itertools import repeat
from operator import itemgetter
from pathlib import Path
from typing import Any

from services.sampler.observability import gc_tuning
from shared.chunks import decode_chunk, keys_of, values_of
from shared.contract import staleness

log = logging.getLogger("tandem.sampler.rollout_log")

# Sample keys with their own column; anything else goes to `extra`.
_COLUMNS = (
    "prompt_id", "group_id", "sample_index", "env", "prompt_text", "completion_text",
    "prompt_token_ids", "completion_token_ids", "completion_logprobs", "loss_mask",
    "reward", "rewards", "advantage", "policy_version", "finish_reason", "versions",
    "use_count", "created_at",
)


def schema():  # -> pyarrow.Schema; pyarrow is imported lazily (only a sampler that seals needs it)
    import pyarrow as pa

    return pa.schema([
        ("step", pa.int64()),
        ("prompt_id", pa.string()),
        ("group_id", pa.string()),
        ("sample_index", pa.int32()),
        ("env", pa.string()),
        ("prompt_text", pa.string()),
        ("completion_text", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("completion_token_ids", pa.list_(pa.int32())),
        ("completion_logprobs", pa.list_(pa.float64())),
        ("loss_mask", pa.list_(pa.int8())),
        ("reward", pa.float64()),
        ("rewards", pa.map_(pa.string(), pa.float64())),
        ("advantage", pa.float64()),
        ("policy_version", pa.int64()),
        ("staleness", pa.int64()),
        ("finish_reason", pa.string()),
        ("versions", pa.list_(pa.int64())),
        ("use_count", pa.int32()),
        ("created_at", pa.float64()),
        ("sealed_at", pa.float64()),
        ("extra", pa.string()),
    ])


_KNOWN = frozenset(_COLUMNS)
_ABSENT = object()
_EXTRA_JSON = json.JSONEncoder(default=str)  # json.dumps(x, default=str) without a new encoder per call
_MEMO_TYPES = (str, int, bool, type(None))
# Building a table yields to the event loop whenever it has run this long without a break.
_SLICE_SECONDS = 0.0005
# After a batch's answer has gone to the socket, its reader still receives and decodes the end.
_SETTLE_SECONDS = 0.02


def _extras(samples: list[dict[str, Any]]) -> list[str | None]:
    """The `extra` column: JSON of each sample's keys without a column of their own, or None."""
    extra_keys = set().union(*samples) - _KNOWN
    if not extra_keys:
        return [None] * len(samples)
    if len(extra_keys) == 1:  # the usual batch: one extra key (the lesson), in every sample or not
        (key,) = extra_keys
        return _one_extra(key, [s.get(key, _ABSENT) for s in samples])
    return _extras_of(samples)


def _one_extra(key: Any, values: list[Any]) -> list[str | None]:
    """`_extras_of(samples)` for samples whose one key without a column, if any, is `key`:
    `values` holds each one's value for it (`_ABSENT` where it has none)."""
    out: list[str | None] = []
    memo: dict[tuple, str] = {}
    keyed = type(key) is str
    for value in values:
        if value is _ABSENT:
            out.append(None)
        elif keyed and type(value) in _MEMO_TYPES:
            one = (type(value), value)
            text = memo.get(one)
            if text is None:
                text = memo[one] = _EXTRA_JSON.encode({key: value})
            out.append(text)
        else:
            out.append(_EXTRA_JSON.encode({key: value}))
    return out


def _extras_of(samples: list[dict[str, Any]]) -> list[str | None]:
    out: list[str | None] = []
    # Samples of a batch mostly share their extras (e.g. the lesson): encode each distinct one
    # once. Only str keys and str/int/bool/None values are remembered, with their types, so
    # equal-but-different values (1, True) never share a text.
    memo: dict[tuple, str] = {}
    for s in samples:
        keys = s.keys() - _KNOWN
        if not keys:
            out.append(None)
            continue
        if len(keys) == 1:  # the usual case: one extra key (the lesson), a scalar value
            (key,) = keys
            value = s[key]
            if type(key) is str and type(value) in _MEMO_TYPES:
                one = (key, type(value), value)
                text = memo.get(one)
                if text is None:
                    text = memo[one] = _EXTRA_JSON.encode({key: value})
                out.append(text)
                continue
            extra = {key: value}
        else:
            extra = {k: v for k, v in s.items() if k not in _KNOWN}
        memo_key: tuple | None = tuple((k, type(v), v) for k, v in extra.items())
        if all(type(k) is str and t in _MEMO_TYPES for k, t, _ in memo_key):  # type: ignore[union-attr]
            text = memo.get(memo_key)  # type: ignore[arg-type]
        else:
            memo_key, text = None, None
        if text is None:
            text = _EXTRA_JSON.encode(extra)
            if memo_key is not None:
                memo[memo_key] = text
        out.append(text)
    return out


def _column(payload: dict[str, Any], name: str) -> list[Any]:
    """Column `name`'s Python values for one sealed batch (one per sample, in batch order)."""
    step, samples = payload["step"], payload["samples"]
    if name == "step":
        return [step] * len(samples)
    if name == "staleness":
        versions = list(map(itemgetter("policy_version"), samples))
        by_version = {v: staleness(step, v) for v in set(versions)}  # a batch holds a few versions
        return list(map(by_version.__getitem__, versions))
    if name == "sealed_at":
        return [payload.get("stats", {}).get("sealed_at")] * len(samples)
    if name == "extra":
        return _extras(samples)
    return [s.get(name) for s in samples]


def _rewards_array(by_sample: list[Any], type_: Any):  # -> pyarrow.MapArray
    """The `rewards` map column (each sample's `rewards` dict, or None) from flat keys and
    values: no list of pairs per sample."""
    import pyarrow as pa

    names = tuple(by_sample[0]) if by_sample and type(by_sample[0]) is dict else ()
    if names and all(type(d) is dict and tuple(d) == names for d in by_sample):
        # The usual batch: every sample has the same parts, in the same order.
        width = len(names)
        offsets = list(range(0, width * len(by_sample) + 1, width))
        keys = list(names) * len(by_sample)
        values = [d[name] for d in by_sample for name in names] if width > 1 else [d[names[0]] for d in by_sample]
    else:
        offsets, keys, values = [0], [], []
        for parts in by_sample:
            if parts:
                keys.extend(parts.keys())
                values.extend(parts.values())
            offsets.append(len(keys))
    return pa.MapArray.from_arrays(pa.array(offsets, type=pa.int32()), pa.array(keys, type=type_.key_type),
                                   pa.array(values, type=type_.item_type), type=type_)


def _list_array(values: list[Any], type_: Any):  # -> pyarrow.ListArray
    """A list column. From numpy arrays (the producer hands hooks the arrays form) it is one
    concatenation and an offsets vector, instead of a conversion of every number: a 64 MiB
    batch's token columns took the event loop hundreds of milliseconds as Python lists."""
    import numpy as np
    import pyarrow as pa

    if not values or not all(map(isinstance, values, repeat(np.ndarray))):
        return pa.array(values, type=type_)
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(list(map(len, values)), out=offsets[1:])
    flat = pa.array(np.concatenate(values), type=type_.value_type)  # checked cast, as for lists
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), flat, type=type_)


def _arrays(payload: dict[str, Any]):  # -> Iterator[pyarrow.Array], one per schema field
    import pyarrow as pa

    for f in schema():
        if f.name == "rewards":
            yield _rewards_array([s.get("rewards") for s in payload["samples"]], f.type)
        elif pa.types.is_list(f.type):
            yield _list_array(_column(payload, f.name), f.type)
        else:
            yield pa.array(_column(payload, f.name), type=f.type)


def _metadata(payload: dict[str, Any]) -> dict[str, str]:
    return {"tandem.stats": json.dumps(payload.get("stats", {}), default=str)}


def to_table(payload: dict[str, Any]):  # -> pyarrow.Table
    """One sealed batch as a table of the rollout-log schema, built column by column."""
    import pyarrow as pa

    return pa.Table.from_arrays(list(_arrays(payload)), schema=schema().with_metadata(_metadata(payload)))


def chunk_table(payload: dict[str, Any], chunks: list[Any]):  # -> pyarrow.Table | None
    """`to_table(payload)` built from the batch's sealed chunks (shared/chunks.py), which hold
    the same samples in columns: token fields, numbers and texts become Arrow arrays straight
    from those buffers, with no Python object per sample. None when a chunk is not the usual
    kind (a key some samples lack, several keys without a column of their own, chunks that do
    not hold these samples) or anything fails: the caller builds from the samples then, which
    also raises whatever that build raises."""
    tables = []
    for table in _chunk_tables(payload, chunks):
        if table is None:
            return None
        tables.append(table)
    return _joined(tables)


def _chunk_tables(payload: dict[str, Any], chunks: list[Any]):  # -> Iterator[pyarrow.Table | None]
    """One table per chunk, in order; a None (the last item) when the samples must be used."""
    import pyarrow as pa


    try:
        columns = [decode_chunk(buffer) for buffer in chunks]
        if not columns or sum(c.n for c in columns) != len(payload["samples"]):
            yield None
            return
        table_schema = schema().with_metadata(_metadata(payload))
    except Exception:  # noqa: BLE001 - the sample path decides (and reports) what is wrong
        yield None
        return
    for cols in columns:
        try:
            arrays = _chunk_arrays(payload, cols)
            table = None if arrays is None else pa.Table.from_arrays(arrays, schema=table_schema)
        except Exception:  # noqa: BLE001 - as above
            table = None
        yield table
        if table is None:
            return


def _joined(tables: list[Any]):  # -> pyarrow.Table
    import pyarrow as pa

    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)


def _chunk_arrays(payload: dict[str, Any], cols: Any) -> list[Any] | None:
    """The schema's arrays for one decoded chunk (`Columns`), or None to build from the samples."""
    import numpy as np
    import pyarrow as pa

    if cols.absent:
        return None
    n = cols.n
    present = set(keys_of(cols))
    extra_keys = present - _KNOWN
    if len(extra_keys) > 1:  # their order within each sample is not kept by the columns
        return None

    def values(key: str) -> list[Any]:
        return list(values_of(cols, key)) if key in present else [None] * n

    step, stats = payload["step"], payload.get("stats", {})
    out = []
    for f in schema():
        name = f.name
        if name == "step":
            out.append(pa.array([step] * n, type=f.type))
        elif name == "staleness":
            versions = values("policy_version")
            by_version = {v: staleness(step, v) for v in set(versions)}
            out.append(pa.array(list(map(by_version.__getitem__, versions)), type=f.type))
        elif name == "sealed_at":
            out.append(pa.array([stats.get("sealed_at")] * n, type=f.type))
        elif name == "extra":
            if extra_keys:
                (key,) = extra_keys
                out.append(pa.array(_one_extra(key, values(key)), type=f.type))
            else:
                out.append(pa.array([None] * n, type=f.type))
        elif name == "rewards":
            out.append(_rewards_array(values(name), f.type))
        elif name in cols.arrays and pa.types.is_list(f.type):
            flat, offsets = cols.arrays[name]
            out.append(pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),  # checked casts, as for lists
                                                pa.array(flat, type=f.type.value_type), type=f.type))
        elif name in cols.texts and pa.types.is_string(f.type) and cols.texts[name][1][-1] < 2**31:
            data, offsets = cols.texts[name]
            out.append(pa.StringArray.from_buffers(n, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data)))
        elif name in cols.numbers and not pa.types.is_list(f.type):
            out.append(pa.array(cols.numbers[name], type=f.type))
        elif pa.types.is_list(f.type):
            out.append(_list_array(values(name), f.type))
        else:
            out.append(pa.array(values(name), type=f.type))
    return out


def load_modules() -> None:
    """Import pyarrow and run one conversion (its first one imports pandas): ~0.3 s of CPU
    that the first batch would otherwise spend on the event loop. The ~35k objects those
    modules add are then frozen out of the collector's way, in the `tandem sampler` process
    (gc_tuning.py)."""
    fresh = "pyarrow.parquet" not in sys.modules
    import pyarrow as pa
    import pyarrow.parquet  # noqa: F401

    pa.array([0], type=pa.int64())
    if fresh:
        gc_tuning.settle()


class RolloutLog:
    """`wait_for_handoff(step)`: returns once batch `step` was sent to a reader (or gave up).
    `sealed_chunks(step)`: the chunks of batch `step` as this process sealed them, when it still
    holds them (else None); the table is then built from them (`chunk_table`)."""

    def __init__(self, directory: Path, wait_for_handoff: Callable[[int], Awaitable[Any]] | None = None,
                 sealed_chunks: Callable[[int], Awaitable[list[Any] | None]] | None = None):
        self.directory = Path(directory)
        self.wait_for_handoff = wait_for_handoff
        self.sealed_chunks = sealed_chunks
        self.files_written = 0
        self.rows_written = 0
        self.last_file: str | None = None
        self.last_error: str | None = None
        self._loaded = False
        self._loading: asyncio.Future | None = None

    def path_for(self, step: int) -> Path:
        return self.directory / f"step-{step:06d}.parquet"

    async def on_sealed(self, payload: dict[str, Any]) -> None:
        # Let the trainer have this batch first: building and compressing the file while the
        # batch is on its way would share the cores with the hand-off (bench handoff p50, 1 MiB:
        # 4.1 ms with these waits, 8.6 ms with none; 64 MiB: 193 ms, ~230 ms with 20 ms alone).
        if self.wait_for_handoff is not None:
            await self.wait_for_handoff(payload["step"])
            await asyncio.sleep(_SETTLE_SECONDS)
        try:
            table = await self._chunk_table(payload)
            if table is None:
                table = await self._table(payload)
            path = await asyncio.to_thread(self._write_table, table, payload["step"])
        except Exception as exc:
            self.last_error = f"step {payload['step']}: {type(exc).__name__}: {exc}"
            raise
        self.files_written += 1
        self.rows_written += len(payload["samples"])
        self.last_file = str(path)
        self.last_error = None

    def preload(self) -> None:
        """Start importing pyarrow in a worker thread now (the sampler's start-up), so that the
        first batch does not wait for it, nor spend its ~0.3 s of CPU among the first batches."""
        if self._loading is None:
            self._loading = asyncio.get_running_loop().run_in_executor(None, load_modules)
            self._loading.add_done_callback(lambda done: done.cancelled() or done.exception())  # seen at the first batch

    async def _load(self) -> None:
        if not self._loaded:
            self.preload()
            await asyncio.shield(self._loading)
            self._loaded = True

    async def _chunk_table(self, payload: dict[str, Any]):  # -> pyarrow.Table | None
        """`chunk_table` from the chunks this process sealed, yielding to the event loop
        between chunks; None when it does not hold them, or they cannot be used."""
        if self.sealed_chunks is None:
            return None
        try:
            chunks = await self.sealed_chunks(payload["step"])
        except Exception as exc:  # noqa: BLE001 - e.g. Redis away: the samples are at hand
            log.debug("batch %d: no sealed chunks for the rollout log (%r); building from its samples",
                      payload["step"], exc)
            return None
        if not chunks:
            return None
        await self._load()
        loop = asyncio.get_running_loop()
        tables = []
        since = loop.time()
        for table in _chunk_tables(payload, chunks):
            if table is None:
                return None
            tables.append(table)
            if loop.time() - since >= _SLICE_SECONDS:
                await asyncio.sleep(0)
                since = loop.time()
        return _joined(tables)

    async def _table(self, payload: dict[str, Any]):  # -> pyarrow.Table
        """`to_table` on the event loop, yielding to it every `_SLICE_SECONDS` or so (see
        the module docstring for why not in the worker thread)."""
        await self._load()
        import pyarrow as pa

        loop = asyncio.get_running_loop()
        arrays = []
        since = loop.time()
        for array in _arrays(payload):  # each step computes and converts one column
            arrays.append(array)
            if loop.time() - since >= _SLICE_SECONDS:
                await asyncio.sleep(0)
                since = loop.time()
        return pa.Table.from_arrays(arrays, schema=schema().with_metadata(_metadata(payload)))

    def write(self, payload: dict[str, Any]) -> Path:
        """Write one sealed batch's file, synchronously (tools and tests; the hook is `on_sealed`)."""
        return self._write_table(to_table(payload), payload["step"])

    def _write_table(self, table: Any, step: int) -> Path:
        import pyarrow.parquet as pq

        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path_for(step)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, path)
        return path

    def snapshot(self) -> dict[str, Any]:
        return {"directory": str(self.directory), "files_written": self.files_written,
                "rows_written": self.rows_written, "last_file": self.last_file, "last_error": self.last_error}
