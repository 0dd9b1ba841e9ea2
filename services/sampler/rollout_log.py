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
the hand-off, and builds the Arrow table on the event loop,
column by column (token columns from the arrays form in one concatenation each), yielding
to the loop every half millisecond, and hands Parquet
encoding, compression and disk I/O (which release the GIL) to a worker thread
(`asyncio.to_thread`). Converting Python objects in the worker thread instead, as an
earlier version did, holds the GIL there while the event loop needs it after every socket
read and write; under `bench throughput` that contention cost the event loop more CPU
than the conversion itself. The first batch imports pyarrow (and, through it, pandas)
in the worker thread.

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
from collections.abc import Awaitable, Callable
from itertools import repeat
from operator import itemgetter
from pathlib import Path
from typing import Any

from services.sampler import gc_tuning
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
        return _one_extra(key, samples)
    return _extras_of(samples)


def _one_extra(key: Any, samples: list[dict[str, Any]]) -> list[str | None]:
    """`_extras_of(samples)` for samples whose one key without a column, if any, is `key`."""
    out: list[str | None] = []
    memo: dict[tuple, str] = {}
    keyed = type(key) is str
    for value in [s.get(key, _ABSENT) for s in samples]:
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


def _rewards_array(samples: list[dict[str, Any]], type_: Any):  # -> pyarrow.MapArray
    """The `rewards` map column from flat keys and values: no list of pairs per sample."""
    import pyarrow as pa

    offsets, keys, values = [0], [], []
    for s in samples:
        parts = s.get("rewards")
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
            yield _rewards_array(payload["samples"], f.type)
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


def _load_pyarrow() -> None:
    """Import pyarrow and run one conversion (its first one imports pandas): ~0.3 s of CPU
    that the first batch would otherwise spend on the event loop. The ~35k objects those
    modules add are then frozen out of the collector's way, in the `tandem sampler` process
    (gc_tuning.py)."""
    import pyarrow as pa
    import pyarrow.parquet  # noqa: F401

    pa.array([0], type=pa.int64())
    gc_tuning.settle()


class RolloutLog:
    def __init__(self, directory: Path, wait_for_handoff: Callable[[int], Awaitable[Any]] | None = None):
        self.directory = Path(directory)
        self.wait_for_handoff = wait_for_handoff
        self.files_written = 0
        self.rows_written = 0
        self.last_file: str | None = None
        self.last_error: str | None = None
        self._loaded = False

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
            table = await self._table(payload)
            path = await asyncio.to_thread(self._write_table, table, payload["step"])
        except Exception as exc:
            self.last_error = f"step {payload['step']}: {type(exc).__name__}: {exc}"
            raise
        self.files_written += 1
        self.rows_written += len(payload["samples"])
        self.last_file = str(path)
        self.last_error = None

    async def _table(self, payload: dict[str, Any]):  # -> pyarrow.Table
        """`to_table` on the event loop, yielding to it every `_SLICE_SECONDS` or so (see
        the module docstring for why not in the worker thread)."""
        if not self._loaded:
            await asyncio.to_thread(_load_pyarrow)
            self._loaded = True
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
