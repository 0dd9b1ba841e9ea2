"""What a restart does to `trainer_metrics.jsonl`, before the new run appends to it.

The promise: one step record per trained step, whatever moment the previous process died.

* **Resumed** from checkpoint step C (or from nothing: C = -1, a run killed before its first
  checkpoint starts again at step 0): the steps after C will be trained again, so their
  records from the dead run are moved to `trainer_metrics.superseded.jsonl` (kept for the
  curious, out of the way of plots); the new records of those steps say `"retrained": true`.
  When the dead run committed checkpoint C but died before writing C's line, the line comes
  back from the checkpoint (`trainer_state.json` carries the step's record), marked
  `"restored": true`. A last line cut short (a kill or a full disk mid-write) is dropped.
* **Not resumed** (`resume = false` with a history present): the file belongs to another run
  and is moved aside whole, to `trainer_metrics.<time>.jsonl`.

The file is rewritten atomically (a temporary sibling, fsync, rename): a kill during the
repair leaves the old file or the repaired one.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.trainer.checkpoint import fsync_dir
from services.trainer.metrics import json_safe

log = logging.getLogger("tandem.trainer.metrics")

SUPERSEDED_FILE = "trainer_metrics.superseded.jsonl"


@dataclass
class History:
    """What the repair found: the steps whose records it moved out (to be trained again)."""

    superseded: set[int] = field(default_factory=set)
    dropped_lines: int = 0
    restored_step: int | None = None
    archived_to: Path | None = None


def _read(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of a JSONL file and how many lines could not be read (a cut-short one)."""
    records, bad = [], 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(record, dict):
                records.append(record)
            else:
                bad += 1
    return records, bad


def _write_atomically(path: Path, records: list[dict[str, Any]], mode: str = "w") -> None:
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        if mode == "a" and path.exists():
            fh.write(path.read_text(encoding="utf-8", errors="replace"))
        for record in records:
            fh.write(json.dumps(json_safe(record), default=str) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _is_step(record: dict[str, Any]) -> bool:
    return record.get("event") == "step" and isinstance(record.get("step"), int)


def prepare(path: Path | str, *, resumed: bool, checkpoint_step: int,
            checkpoint_record: dict[str, Any] | None = None) -> History:
    """Repair `path` for a run that trains from step `checkpoint_step + 1` (see the module
    docstring); `resumed` False when this run does not continue the file's run."""
    path = Path(path)
    history = History()
    if not path.exists() or path.stat().st_size == 0:
        return history
    if not resumed:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        target = path.with_name(f"{path.stem}.{stamp}{path.suffix}")
        os.replace(path, target)
        history.archived_to = target
        log.warning("%s belongs to an earlier run (this one does not resume it): moved to %s", path, target)
        return history

    records, history.dropped_lines = _read(path)
    kept: list[dict[str, Any]] = []
    moved: list[dict[str, Any]] = []
    last_of_step: dict[int, int] = {}
    for record in records:
        if _is_step(record) and record["step"] > checkpoint_step:
            moved.append(record)
            history.superseded.add(record["step"])
            continue
        if _is_step(record):
            if record["step"] in last_of_step:  # a duplicate from an older Tandem: keep the later
                kept[last_of_step[record["step"]]] = {}
            last_of_step[record["step"]] = len(kept)
        kept.append(record)
    kept = [r for r in kept if r]
    if checkpoint_step >= 0 and checkpoint_step not in last_of_step and checkpoint_record:
        kept.append({"time": time.time(), **checkpoint_record, "restored": True})
        history.restored_step = checkpoint_step
    if moved or history.dropped_lines or history.restored_step is not None or len(kept) != len(records):
        if moved:
            _write_atomically(path.with_name(SUPERSEDED_FILE), moved, mode="a")
        _write_atomically(path, kept)
        log.info("metrics history repaired for a resume at step %d: %d record(s) of steps to be trained again "
                 "moved to %s, %d unreadable line(s) dropped%s", checkpoint_step + 1, len(moved), SUPERSEDED_FILE,
                 history.dropped_lines,
                 f", step {history.restored_step}'s record restored from its checkpoint"
                 if history.restored_step is not None else "")
    return history
