"""The producer: generates and seals batches in step order, as early as staleness allows.

For each step N from where the run stands (the published version, skipping sealed
steps), it waits until some inference server serves version >= required_version(N),
then builds batch N in its own task, so with k >= 1 generation of N+1 overlaps both
training and the tail of N. Requests only go to servers new enough for their batch.
A batch that reuses another step's samples (num_iterations > 1) is a copy of that step's
sealed batch with use counts raised. A failed build is retried with backoff; the error
is visible in /status meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from shared import codec
from services.sampler.inference_pool import InferencePool
from services.sampler.keys import Keys
from services.sampler.notify import Notifier
from services.sampler.rollout import batch_stats
from services.sampler.sources import FreshGroups
from services.sampler.store import Store
from services.sampler.strategy import BuildContext, Strategy

log = logging.getLogger("tandem.sampler.producer")


@dataclass
class Progress:
    step: int
    min_version: int
    started_at: float = field(default_factory=time.time)
    attempts: int = 0
    error: str | None = None


class Producer:
    def __init__(self, *, store: Store, notifier: Notifier, pool: InferencePool, source: FreshGroups,
                 strategy: Strategy, redis: aioredis.Redis, keys: Keys, env_name: str):
        self.store = store
        self.notifier = notifier
        self.pool = pool
        self.source = source
        self.strategy = strategy
        self.redis = redis
        self.keys = keys
        self.env_name = env_name
        self.in_progress: dict[int, Progress] = {}
        self.next_step = 0
        self.last_sealed: int | None = None
        self.last_error: str | None = None
        self.sealed_count = 0
        self._tickets = 0
        self._tasks: set[asyncio.Task] = set()
        # Called with each newly sealed batch payload (metrics, rollout logs); errors are logged.
        self.on_sealed: list[Callable[[dict[str, Any]], Awaitable[None] | None]] = []

    async def sync_versions(self) -> None:
        """Load per-server versions from Redis (another process may have synced them)."""
        for url, info in (await self.store.servers()).items():
            if info.get("version") is not None:
                for server in self.pool.servers:
                    if server.url == url and (server.version is None or info["version"] > server.version):
                        self.pool.set_version(url, int(info["version"]))

    async def _wait_until_servable(self, required: int) -> None:
        while True:
            changed = self.notifier.changed()
            await self.sync_versions()
            best = self.pool.max_version()
            if best is not None and best >= required:
                return
            await changed.wait()

    async def run(self) -> None:
        meta = await self.store.meta()
        step = max(meta["trimmed_below"], meta["version"])
        sealed = set(await self.store.sealed_steps())
        try:
            while True:
                if step in sealed or await self.store.is_sealed(step):
                    step += 1
                    continue
                self.next_step = step
                required = self.strategy.required_version(step)
                await self._wait_until_servable(required)
                ticket = None
                if self.strategy.base_step(step) == step:
                    ticket, self._tickets = self._tickets, self._tickets + 1
                task = asyncio.create_task(self._build(step, required, ticket), name=f"batch-{step}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                step += 1
                self.next_step = step
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _samples(self, step: int, required: int, ticket: int | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        base = self.strategy.base_step(step)
        if ticket is None:
            return await self._reuse(step, base), {"reused_from_step": base}
        ctx = BuildContext(step=step, min_version=required, source=self.source, redis=self.redis,
                           keys=self.keys, env_name=self.env_name, ticket=ticket)
        samples = await self.strategy.assemble(ctx)
        return samples, ctx.stats

    async def _reuse(self, step: int, base: int) -> list[dict[str, Any]]:
        """Batch `step` serves batch `base`'s samples again, one more use each."""
        while True:
            changed = self.notifier.changed()
            payload = await self.store.get_batch(base)
            if payload is not None:
                break
            await changed.wait()
        samples = codec.unpack(payload)["samples"]
        for sample in samples:
            sample["use_count"] = sample.get("use_count", 1) + (step - base)
        return samples

    async def _build(self, step: int, required: int, ticket: int | None) -> None:
        progress = self.in_progress[step] = Progress(step, required)
        delay = 0.5
        try:
            while True:
                progress.attempts += 1
                try:
                    samples, extra = await self._samples(step, required, ticket)
                    stats = {**batch_stats(step, samples, progress.started_at, time.time()), **extra}
                    payload = {"step": step, "samples": samples, "stats": stats}
                    outcome = await self.store.seal(step, codec.pack(payload))
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - keep producing; the error is surfaced in /status
                    progress.error = self.last_error = f"step {step}: {type(exc).__name__}: {exc}"
                    log.error("building batch %d failed (attempt %d): %s; retrying in %.1fs",
                              step, progress.attempts, exc, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 10.0)
            self.notifier.notify()
            if outcome == 1:
                self.sealed_count += 1
                self.last_sealed = step if self.last_sealed is None else max(self.last_sealed, step)
                self.last_error = None
                await self.store.add_batch_stats(stats)
                await self._run_hooks(payload)
                log.info("sealed batch %d: %d samples, reward %.3f, staleness mean %.2f, %.2fs",
                         step, stats["num_samples"], stats["reward_mean"], stats["staleness_mean"],
                         stats["generation_seconds"])
            elif outcome == -1:
                log.info("batch %d was trimmed before it was sealed; dropped", step)
        finally:
            self.in_progress.pop(step, None)

    async def _run_hooks(self, payload: dict[str, Any]) -> None:
        for hook in self.on_sealed:
            try:
                result = hook(payload)
                if asyncio.iscoroutine(result):
                    await result
            except Exception:  # noqa: BLE001 - an observer must never stop production
                log.exception("on_sealed hook %r failed for batch %d", hook, payload["step"])

    def snapshot(self) -> dict[str, Any]:
        return {
            "next_step": self.next_step,
            "last_sealed_step": self.last_sealed,
            "sealed_since_start": self.sealed_count,
            "in_progress": [
                {"step": p.step, "min_version": p.min_version, "started_at": p.started_at,
                 "attempts": p.attempts, "error": p.error}
                for p in sorted(self.in_progress.values(), key=lambda p: p.step)
            ],
            "last_error": self.last_error,
        }
