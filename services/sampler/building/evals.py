"""Eval jobs: one generation per eval prompt (a whole conversation for a multi-turn
environment), greedy by default, rewards only. A single-turn environment's prompts are sent
as lists, up to `eval_concurrency` per request (one request's overhead per list, not per prompt).

Jobs live in Redis (`eval:<id>` holds the whole record as JSON) so `GET /eval/{id}`
works from any replica and after a restart; a restarted sampler re-runs jobs that were
pending or running. Eval requests pass through the shared inference pool but at most
`eval_concurrency` prompts at a time, so an eval never takes all of training's capacity.

An example whose reward (or a reward part) is NaN or infinite is left out of the means,
counted (`nonfinite_rewards` in the result, the sampler's non-finite counters) and named in
one warning per eval; an eval where no reward is finite fails with that explanation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from services.sampler.storage.keys import Keys
from services.sampler.storage.notify import Notifier
from services.sampler.storage.redis_link import RedisLink, is_outage
from services.sampler.rollouts.rollout import Rollouts, describe_rewards, nonfinite_rewards
from shared.aio import wait_event

log = logging.getLogger("tandem.sampler.evals")

KEEP_EVALS = 200


class Evals:
    def __init__(self, redis: aioredis.Redis, keys: Keys, notifier: Notifier,
                 rollouts_for: Callable[[str | None], Rollouts], *, concurrency: int,
                 default_examples: int, lessons: list[str] | None = None, link: RedisLink | None = None):
        self.r = redis
        # A finished eval's result waits out a Redis outage instead of being lost with its task.
        self.link = link
        self.keys = keys
        self.notifier = notifier
        self.rollouts_for = rollouts_for
        # Eval prompts in flight, over every eval job: a conversation takes one permit; a
        # single-turn environment's prompts go in lists of up to `concurrency`, one permit each.
        self.concurrency = concurrency
        self.semaphore = asyncio.Semaphore(concurrency)
        self._gathering = asyncio.Lock()  # one list at a time takes its permits: two never deadlock half-way
        self.default_examples = default_examples
        # Under a curriculum, an eval without an env evaluates every lesson separately.
        self.lessons = lessons
        self._tasks: set[asyncio.Task] = set()

    @contextlib.asynccontextmanager
    async def _permits(self, count: int):
        """`count` of the semaphore's permits, held together (taken one list at a time)."""
        taken = 0
        try:
            async with self._gathering:
                for _ in range(count):
                    await self.semaphore.acquire()
                    taken += 1
            yield
        finally:
            for _ in range(taken):
                self.semaphore.release()

    async def _save(self, record: dict[str, Any]) -> None:
        await self.r.set(self.keys.eval(record["eval_id"]), json.dumps(record))

    async def get(self, eval_id: str) -> dict[str, Any] | None:
        raw = await self.r.get(self.keys.eval(eval_id))
        return json.loads(raw) if raw else None

    async def recent(self, count: int) -> list[dict[str, Any]]:
        """The records of the last `count` jobs, oldest first; jobs dropped meanwhile are skipped."""
        ids = await self.r.zrange(self.keys.evals, -count, -1)
        if not ids:
            return []
        raws = await self.r.mget([self.keys.eval(i.decode()) for i in ids])
        return [json.loads(raw) for raw in raws if raw]

    async def start(self, request: dict[str, Any]) -> str:
        self.rollouts_for(request.get("env"))  # fail now, with a 4xx, if the env is unknown
        eval_id = uuid.uuid4().hex[:16]
        now = time.time()
        record = {"eval_id": eval_id, "status": "pending", "request": request, "result": None,
                  "error": None, "created_at": now, "finished_at": None}
        await self._save(record)
        await self.r.zadd(self.keys.evals, {eval_id: now})
        # Keep the job index bounded: drop the oldest jobs beyond KEEP_EVALS.
        old = await self.r.zrange(self.keys.evals, 0, -KEEP_EVALS - 1)
        if old:
            await self.r.delete(*(self.keys.eval(i.decode()) for i in old))
            await self.r.zrem(self.keys.evals, *old)
        self._spawn(record)
        return eval_id

    def _spawn(self, record: dict[str, Any]) -> None:
        task = asyncio.create_task(self._run(record), name=f"eval-{record['eval_id']}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def resume_unfinished(self) -> None:
        for eval_id in await self.r.zrange(self.keys.evals, 0, -1):
            record = await self.get(eval_id.decode())
            if record and record["status"] in ("pending", "running"):
                log.info("re-running eval %s left %s by a previous sampler", record["eval_id"], record["status"])
                self._spawn(record)

    async def wait(self, eval_id: str, timeout: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while True:
            changed = self.notifier.changed()
            record = await self.get(eval_id)
            if record is None or record["status"] in ("done", "failed"):
                return record
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return record
            if not await wait_event(changed, remaining):
                return await self.get(eval_id)

    async def _run(self, record: dict[str, Any]) -> None:
        request = record["request"]
        record["status"] = "running"
        await self._save(record)
        try:
            record["result"] = await self._evaluate(request)
            record["status"] = "done"
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("eval %s failed", record["eval_id"])
            record["status"] = "failed"
            record["error"] = f"{type(exc).__name__}: {exc}"
        record["finished_at"] = time.time()
        while True:
            try:
                await self._save(record)
                await self.r.publish(self.keys.events, f"eval:{record['eval_id']}")
                break
            except Exception as exc:
                if self.link is None or not is_outage(exc):
                    raise
                await self.link.ride_out(exc)
        self.notifier.notify()

    async def _evaluate(self, request: dict[str, Any]) -> dict[str, Any]:
        if request.get("env") or not self.lessons:
            return await self._evaluate_env(request)
        lessons = {name: await self._evaluate_env({**request, "env": name}) for name in self.lessons}
        return {
            "env": "curriculum",
            "lessons": lessons,
            "num_examples": sum(r["num_examples"] for r in lessons.values()),
            "nonfinite_rewards": sum(r["nonfinite_rewards"] for r in lessons.values()),
            "reward_mean": float(np.mean([r["reward_mean"] for r in lessons.values()])),
            "policy_version": min(r["policy_version"] for r in lessons.values()),
        }

    async def _evaluate_env(self, request: dict[str, Any]) -> dict[str, Any]:
        rollouts = self.rollouts_for(request.get("env"))
        examples = list(rollouts.env.examples("eval"))
        n = request.get("num_examples") or self.default_examples
        examples = examples[:n]
        if not examples:
            raise ValueError(f"environment {rollouts.env.name!r} has no eval examples")
        sampling = {"temperature": request.get("temperature", 0.0),
                    "max_tokens": request.get("max_tokens") or rollouts.max_tokens}
        if request.get("seed") is not None:
            sampling["seed"] = request["seed"]
        min_version = rollouts.pool.max_version() or 0

        run_id = uuid.uuid4().hex[:8]  # names the trajectories' sessions (session affinity)

        async def one(example):
            # A multi-turn environment's whole conversation, greedy, as in training.
            async with self.semaphore:
                completion, (total, parts) = await rollouts.sample_one(
                    example, min_version=min_version, sampling=sampling, label=f"eval/{run_id}/{example.prompt_id}")
            return example, completion, total, parts

        async def each(chunk):
            # A single-turn environment's prompts, one request per list (Rollouts.sample_each).
            async with self._permits(len(chunk)):
                done = await rollouts.sample_each(chunk, min_version=min_version, sampling=sampling)
            return [(ex, completion, total, parts) for ex, (completion, (total, parts)) in zip(chunk, done)]

        if rollouts.multiturn:
            scored = await asyncio.gather(*(one(ex) for ex in examples))
        else:
            size = max(1, self.concurrency)
            chunks = await asyncio.gather(*(each(examples[i:i + size]) for i in range(0, len(examples), size)))
            scored = [row for chunk in chunks for row in chunk]
        totals = [total for _, _, total, _ in scored]
        all_parts = [parts for *_, parts in scored]
        bad = set(nonfinite_rewards(totals, all_parts))
        if bad:
            order = sorted(bad)
            rollouts.nonfinite.add(rollouts.nonfinite.rewards, (rollouts.env.name, "eval"), len(bad))
            labels = [f"prompt {ex.prompt_id}" for ex, *_ in scored]
            log.warning("eval of environment %r: %d of %d rewards are not finite (%s); those examples are left out "
                        "of the means. Fix the environment's reward function: it must return finite numbers",
                        rollouts.env.name, len(bad), len(scored), describe_rewards(order, totals, all_parts, labels))
        finite = [row for i, row in enumerate(scored) if i not in bad]
        if not finite:
            raise ValueError(f"every reward of the {len(scored)} eval examples of environment {rollouts.env.name!r} "
                             f"is NaN or infinite: fix the environment's reward function")
        rewards = np.array([total for _, _, total, _ in finite])
        names = sorted({name for *_, parts in finite for name in parts})
        versions = [min(c.versions) if c.versions else min_version for _, c, _, _ in scored]
        return {
            "env": rollouts.env.name,
            "num_examples": len(scored),
            "nonfinite_rewards": len(bad),
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "rewards_mean": {k: float(np.mean([p.get(k, 0.0) for *_, p in finite])) for k in names},
            "policy_version": int(min(versions)),
            "completion_tokens_mean": float(np.mean([len(c.token_ids) for _, c, _, _ in scored])),
            "examples": [
                {"prompt_id": ex.prompt_id, "prompt": ex.prompt, "completion": c.text,
                 "reward": total if i not in bad else None}
                for i, (ex, c, total, _) in enumerate(scored[:8])
            ],
        }

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
