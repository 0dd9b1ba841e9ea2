"""What the steps of one run share (`RunState`), and the summary it adds up to at the end."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class RunState:
    """What the steps of one run share: where it started, the totals for the summary, and
    the tasks in flight from one step to the next."""

    start_step: int
    wall_start: float
    last_checkpoint: Path | None = None
    published_any: bool = False  # whether this run has published weights yet (every rank)
    checkpoint_step: int | None = None  # the step of the newest full checkpoint
    skipped_no_signal: int = 0
    skipped_non_finite: int = 0
    last_step: int | None = None  # the newest step trained (every rank)
    wait_seconds: float = 0.0
    train_seconds: float = 0.0
    stale_sum: float = 0.0
    samples: float = 0.0
    first_reward: float | None = None
    last_reward: float | None = None
    prefetch: asyncio.Task | None = None  # batch N+1, fetched while step N trains
    before_eval: asyncio.Task | None = None  # awaited before version start_step + 1 is published

    def add_step(self, step: int, wait_s: float, train_s: float, sums: dict[str, float], reward_mean: float,
                 result: dict[str, Any]) -> None:
        self.last_step = step
        self.skipped_no_signal += int(result.get("skipped_no_signal", 0))
        self.skipped_non_finite += int(result.get("skipped_non_finite", 0))
        self.wait_seconds += wait_s
        self.train_seconds += train_s
        self.stale_sum += sums["stale_sum"]
        self.samples += sums["n"]
        self.first_reward = reward_mean if self.first_reward is None else self.first_reward
        self.last_reward = reward_mean

    def summary(self, max_steps: int, world_size: int, evals: list[dict[str, Any]], after: dict[str, Any] | None,
                metrics_path: str, last_published: Path | None) -> dict[str, Any]:
        """The run's summary (services/trainer/trainer.py's docstring lists its keys)."""
        final_version = max(max_steps, self.start_step)
        before = next((e for e in evals if e["label"] == "before"), None)
        wall = time.monotonic() - self.wall_start
        busy = self.wait_seconds + self.train_seconds
        return {
            "steps": max(max_steps - self.start_step, 0),
            "start_step": self.start_step,
            "final_step": final_version - 1,
            "final_version": final_version,
            "wall_seconds": wall,
            "wait_seconds": self.wait_seconds,
            "train_seconds": self.train_seconds,
            "trainer_wait_fraction": self.wait_seconds / busy if busy > 0 else 0.0,
            "staleness_mean": self.stale_sum / self.samples if self.samples else 0.0,
            "reward_mean_first": self.first_reward,
            "reward_mean_last": self.last_reward,
            "eval_reward_before": before.get("reward") if before else None,
            "eval_reward_after": after.get("reward") if after else None,
            "evals": evals,
            "last_checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "last_published": str(last_published) if last_published else None,
            "skipped_steps_no_signal": self.skipped_no_signal,
            "skipped_steps_non_finite": self.skipped_non_finite,
            "metrics_path": metrics_path,
            "world_size": world_size,
        }
