"""What `tandem demo` shows while it trains: the trainer's metrics file, read as it grows, and
a progress bar (or plain lines when the output is not a terminal)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO


class MetricsTail:
    """Reads the trainer's JSONL metrics as they grow (complete lines only)."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self.steps: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._offset += end
        records = []
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == "step":
                self.steps.append(record)
            elif record.get("event") == "eval":
                self.evals.append(record)
            records.append(record)
        return records


class Display:
    """A rich progress bar on a terminal; a plain line every ~10% of the steps otherwise."""

    def __init__(self, total: int, out: TextIO, enabled: bool):
        self.total = total
        self.out = out
        self.enabled = enabled
        self.last_eval: str = "-"
        self._bar = None
        self._every = max(1, total // 10)
        if enabled and out.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bar = Progress(TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.description}"),
                                 console=Console(file=out))
            self._task = self._bar.add_task("waiting for the first batch", total=total)
            self._bar.start()

    def _print(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text, highlight=False)
        elif self.enabled:
            print(text, file=self.out, flush=True)

    def update(self, record: dict[str, Any]) -> None:
        if record.get("event") == "eval":
            reward = record.get("reward")
            self.last_eval = f"{reward:.2f}" if isinstance(reward, (int, float)) else "failed"
            self._print(f"eval ({record.get('label')}, version {record.get('version')}): "
                        f"greedy reward {self.last_eval}")
            return
        if record.get("event") != "step":
            return
        done = int(record["step"]) + 1
        line = (f"reward {record.get('reward_mean', 0.0):.2f}  eval {self.last_eval}  "
                f"stale {record.get('staleness_mean', 0.0):.2f}  wait {record.get('batch_wait_s', 0.0):.2f}s  "
                f"train {record.get('train_s', 0.0):.2f}s")
        if self._bar is not None:
            self._bar.update(self._task, completed=done, description=line)
        elif done % self._every == 0 or done == self.total:
            self._print(f"step {done}/{self.total}  {line}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
