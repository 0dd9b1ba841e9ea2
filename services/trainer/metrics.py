"""Trainer observability: JSONL metrics (mirrored to W&B / TensorBoard with report_to), a progress bar.

`run_dir/trainer_metrics.jsonl` gets one JSON object per line, appended and flushed as
it happens, so a crashed run keeps everything up to the crash and a resumed run appends:

* `{"event": "step", "step": N, "version": N+1, "loss": ..., "reward_mean": ..., ...}`
  after every optimizer step (keys: `step_record` in services/trainer/step_record.py);
* `{"event": "eval", "step": N, "version": v, "reward": ..., "result": {...}}` when an
  eval result arrives;
* `{"event": "start" | "end", ...}` around a run.

With `report_to` (shared/tracking.py, docs/tracking.md) the step and eval records also go to
W&B and/or TensorBoard, at the record's step: a step record's numbers under the names of its
line (`loss`, `reward_mean`, ...), an eval record's under `eval/` (`eval/reward`,
`eval/result/reward_mean`, ...: eval and step records share names such as `version`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.tracking import Reporter

log = logging.getLogger("tandem.trainer.metrics")

METRICS_FILE = "trainer_metrics.jsonl"


def json_safe(value: Any) -> Any:
    # JSON has no NaN/inf; write null rather than produce an unreadable line.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def eval_reward(result: dict[str, Any] | None) -> float | None:
    """The headline reward of an eval result, whatever the sampler names it."""
    if not result:
        return None
    for key in ("reward_mean", "mean_reward", "reward", "accuracy", "score"):
        value = result.get(key)
        if isinstance(value, (int, float)):
            return float(value)
    return None


class MetricsLogger:
    """Appends JSONL records; hands the numbers of step and eval records to a tracking reporter."""

    def __init__(self, run_dir: Path | str, *, enabled: bool = True, reporter: Reporter | None = None):
        self.path = Path(run_dir) / METRICS_FILE
        self.enabled = enabled
        self.reporter = reporter
        self._fh = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Open for the whole run (closed in close()): one line-buffered append per record.
        self._fh = open(self.path, "a", buffering=1)  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        if not self._fh:
            return
        record = {"time": time.time(), **record}
        self._fh.write(json.dumps(json_safe(record), default=str) + "\n")
        if self.reporter is not None and record.get("event") in ("step", "eval"):
            self.reporter.log(reported(record), int(record.get("step") or 0))

    def close(self) -> None:
        """Closes the file; the reporter is its owner's to close."""
        if self._fh:
            self._fh.close()
            self._fh = None


def reported(record: dict[str, Any]) -> dict[str, Any]:
    """What a step or eval record reports to W&B / TensorBoard: its values but the axis (`step`),
    the wall clock (`time`) and the kind (`event`); an eval's under `eval/`. The reporter keeps
    the numbers and flattens `result` into `eval/result/...`."""
    values = {k: v for k, v in record.items() if k not in ("event", "step", "time")}
    if record.get("event") == "eval":
        return {f"eval/{k}": v for k, v in values.items()}
    return values


class ProgressBar:
    """The trainer's one-line live progress bar on rank 0 (rich), or nothing."""

    def __init__(self, total: int, start: int, enabled: bool):
        self._progress = None
        self._task = None
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        self._progress = RichProgress(
            TextColumn("[bold]train[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            transient=False,
        )
        self._task = self._progress.add_task("waiting for batch", total=max(total, 1), completed=start)
        self._progress.start()

    def update(self, completed: int, description: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, description=description)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def describe(record: dict[str, Any]) -> str:
    """The progress line for one step record."""

    def fmt(key: str, spec: str) -> str:
        value = record.get(key)
        return format(value, spec) if isinstance(value, (int, float)) else "-"

    return (
        f"step {record.get('step')} reward {fmt('reward_mean', '.3f')} loss {fmt('loss', '.4f')} "
        f"stale {fmt('staleness_mean', '.2f')}/{fmt('staleness_max', 'd')} "
        f"wait {fmt('batch_wait_s', '.2f')}s train {fmt('train_s', '.2f')}s "
        f"{fmt('tokens_per_s', '.0f')} tok/s"
    )
