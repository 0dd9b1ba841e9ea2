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

The writer is a producer `on_sealed` hook; it runs in a worker thread
(`asyncio.to_thread`) so encoding and disk I/O never block the event loop. A batch is
written by the process that sealed it, right after the seal: a process killed in that
instant leaves that one step without a file (the batch itself is safe in Redis).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("tandem.sampler.rollout_log")

# Sample keys with their own column; anything else goes to `extra`.
_COLUMNS = (
    "prompt_id", "group_id", "sample_index", "env", "prompt_text", "completion_text",
    "prompt_token_ids", "completion_token_ids", "completion_logprobs", "loss_mask",
    "reward", "rewards", "advantage", "policy_version", "finish_reason", "versions",
    "use_count", "created_at",
)


def schema():  # -> pyarrow.Schema; pyarrow is imported lazily (only the writer thread needs it)
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


class RolloutLog:
    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.files_written = 0
        self.rows_written = 0
        self.last_file: str | None = None
        self.last_error: str | None = None

    def path_for(self, step: int) -> Path:
        return self.directory / f"step-{step:06d}.parquet"

    async def on_sealed(self, payload: dict[str, Any]) -> None:
        try:
            path = await asyncio.to_thread(self.write, payload)
        except Exception as exc:
            self.last_error = f"step {payload['step']}: {type(exc).__name__}: {exc}"
            raise
        self.files_written += 1
        self.rows_written += len(payload["samples"])
        self.last_file = str(path)
        self.last_error = None

    def write(self, payload: dict[str, Any]) -> Path:
        import pyarrow as pa
        import pyarrow.parquet as pq

        step, samples, stats = payload["step"], payload["samples"], payload.get("stats", {})
        columns: dict[str, list[Any]] = {name: [] for name in schema().names}
        for s in samples:
            columns["step"].append(step)
            for name in _COLUMNS:
                columns[name].append(s.get(name))
            columns["rewards"][-1] = list((s.get("rewards") or {}).items())
            columns["staleness"].append(step - s["policy_version"])
            columns["sealed_at"].append(stats.get("sealed_at"))
            extra = {k: v for k, v in s.items() if k not in _COLUMNS}
            columns["extra"].append(json.dumps(extra, default=str) if extra else None)
        table = pa.Table.from_pydict(columns, schema=schema().with_metadata(
            {"tandem.stats": json.dumps(stats, default=str)}))
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path_for(step)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, path)
        return path

    def snapshot(self) -> dict[str, Any]:
        return {"directory": str(self.directory), "files_written": self.files_written,
                "rows_written": self.rows_written, "last_file": self.last_file, "last_error": self.last_error}
