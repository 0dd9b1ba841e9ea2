"""Trainer observability: JSONL metrics, optional TensorBoard, a progress bar.

`run_dir/trainer_metrics.jsonl` gets one JSON object per line, appended and flushed as
it happens, so a crashed run keeps everything up to the crash and a resumed run appends:

* `{"event": "step", "step": N, "version": N+1, "loss": ..., "reward_mean": ..., ...}`
  after every optimizer step (keys: `step_record` in services/trainer/step_record.py);
* `{"event": "eval", "step": N, "version": v, "reward": ..., "result": {...}}` when an
  eval result arrives;
* `{"event": "start" | "end", ...}` around a run.

TensorBoard is optional: with `tensorboard = true` and no TensorBoard installed the
trainer logs one warning and carries on.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

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
    """Appends JSONL records; mirrors numeric step/eval scalars to TensorBoard if enabled."""

    def __init__(self, run_dir: Path | str, *, enabled: bool = True, tensorboard: bool = False):
        self.path = Path(run_dir) / METRICS_FILE
        self.enabled = enabled
        self._fh = None
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Open for the whole run (closed in close()): one line-buffered append per record.
        self._fh = open(self.path, "a", buffering=1)  # noqa: SIM115
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
            except Exception as exc:  # noqa: BLE001 -- ImportError, or a broken install: optional
                log.warning("tensorboard = true but TensorBoard is not usable (%s); JSONL only", exc)
            else:
                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        if not self._fh:
            return
        record = {"time": time.time(), **record}
        self._fh.write(json.dumps(json_safe(record), default=str) + "\n")
        if self._tb is not None and record.get("event") in ("step", "eval"):
            step = int(record.get("step", 0))
            prefix = "train" if record["event"] == "step" else "eval"
            for key, value in record.items():
                if key not in ("step", "time", "version") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{prefix}/{key}", value, step)

    def close(self) -> None:
        if self._fh:
            self._fh.close()
            self._fh = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


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
