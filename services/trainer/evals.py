"""The trainer's evals (rank 0): each asks the sampler for one (`POST /eval`), waits for its
result, and writes it to the metrics as an "eval" line. An eval never takes training down: a
failure is recorded as one, with its error."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from services.trainer.metrics import MetricsLogger, eval_reward
from shared.client import SamplerClient

log = logging.getLogger("tandem.trainer")


class Evals:
    def __init__(self, client: SamplerClient, metrics: MetricsLogger, *, examples: int | None, timeout: float):
        self.client, self.metrics = client, metrics
        self.examples, self.timeout = examples, timeout
        self.records: list[dict[str, Any]] = []  # every eval's line, in the order they finished
        self._tasks: list[asyncio.Task] = []

    def start(self, step: int, version: int, label: str) -> asyncio.Task:
        """Run one in the background; the task, which `wait` also waits for."""
        task = asyncio.create_task(self.run(step, version, label))
        self._tasks.append(task)
        return task

    async def wait(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks)

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def run(self, step: int, version: int, label: str) -> dict[str, Any]:
        started = time.monotonic()
        record: dict[str, Any] = {"event": "eval", "label": label, "step": step, "version": version}
        try:
            eval_id = await self.client.start_eval(num_examples=self.examples)
            result = await self.client.wait_eval(eval_id, timeout=self.timeout)
            record.update(eval_id=eval_id, status=result.status, result=result.result,
                          error=result.error, reward=eval_reward(result.result))
        except Exception as exc:  # noqa: BLE001 -- an eval must never take training down
            log.warning("eval %s at version %d failed: %s", label, version, exc)
            record.update(status="failed", error=f"{type(exc).__name__}: {exc}", reward=None)
        record["seconds"] = time.monotonic() - started
        self.records.append(record)
        self.metrics.write(record)
        log.info("eval %s (version %d): reward %s in %.1fs", label, version, record.get("reward"), record["seconds"])
        return record
