"""Read back what the tracking backends wrote: TensorBoard event files through TensorBoard's
own `EventAccumulator`, and W&B offline runs (`run-<id>.wandb`) through W&B's own record
protos.

wandb 0.19+ no longer ships a Python reader for its transaction log, so `wandb_runs` walks
the file's framing itself: a 7-byte header (`:W&B`, a 2-byte magic, a version byte), then
LevelDB-log blocks of 32 KiB, each record a 7-byte header (crc32, length, type: full, first,
middle, last) and its bytes; a block's tail shorter than a header is padding.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in `directory`'s event files -> [(step, value)] in the order written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@dataclass
class OfflineRun:
    path: Path
    run_id: str = ""
    name: str = ""
    group: str = ""
    project: str = ""
    job_type: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)  # one dict per logged row
    exit_code: int | None = None  # None: the run never finished

    def rows_with(self, key: str) -> list[dict[str, Any]]:
        return [row for row in self.history if key in row]


def _records(path: Path):
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log (header {data[:_HEADER]!r})")
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left
            continue
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""


def read_wandb_run(path: Path) -> OfflineRun:
    from wandb.proto import wandb_internal_pb2 as pb

    run = OfflineRun(path)
    for data in _records(path):
        record = pb.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.run_id, run.name, run.group = r.run_id, r.display_name, r.run_group
            run.project, run.job_type = r.project, r.job_type
            for item in r.config.update:
                run.config[item.key] = json.loads(item.value_json)
        elif kind == "history":
            run.history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                for item in record.history.item})
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run


def wandb_runs(wandb_dir: Path) -> list[OfflineRun]:
    """Every offline run under `wandb_dir` (the `wandb/` folder W&B made)."""
    return [read_wandb_run(p) for p in sorted(wandb_dir.glob("offline-run-*/run-*.wandb"))]
