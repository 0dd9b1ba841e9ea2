"""Replay buffer strategy: batches mix fresh groups with groups drawn from a Redis pool.

Each batch takes `round(P * (1 - replay_ratio))` fresh groups and draws the rest from the
pool (falling back to more fresh groups when too few are eligible). A pooled group is
eligible at step N when it was created before N, has been served fewer than `max_reuse`
times and is at most `max_age` versions old (N - policy_version <= max_age). Draws are
`uniform`, by `recency` (weight 1 / (1 + age in steps)) or by `advantage` (weight mean
|advantage| of the group), from an RNG seeded by (seed, step), and happen strictly in step
order, so a run is reproducible. The pool is capped at `replay_capacity` groups (oldest
evicted first); `newest_per_prompt` retention keeps only the newest policy version's group
per prompt. Every served sample reports `use_count`, the times it has been served.

This module is the policy; the pool's state (metadata and samples per group, each draw and
each addition one atomic write) is `ctx.replay_pool`, services/sampler/storage/replay_store.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from services.sampler.building.strategies.base import BuildContext, Strategy
from shared import contract


class Replay(Strategy):
    name = "replay"

    def __init__(self, settings):
        super().__init__(settings)
        s = settings
        self.ratio = s.replay_ratio
        self.sampling = s.replay_sampling
        self.max_reuse = s.max_reuse
        self.max_age = max(s.max_age, self.max_staleness)
        self.capacity = s.replay_capacity
        self.retention = s.replay_retention
        self.seed = s.seed
        self._next_ticket = 0
        self._cond = asyncio.Condition()
        self.pool_size = 0
        self.served_from_pool = 0

    async def assemble(self, ctx: BuildContext) -> list[dict[str, Any]]:
        per_step = self.settings.prompts_per_step
        n_fresh = per_step - round(per_step * self.ratio)
        fresh = await ctx.fresh(n_fresh)
        # Draws mutate the shared pool: take them strictly in the order the producer
        # started the builds (its tickets), whatever order their fresh rollouts finish in.
        async with self._cond:
            await self._cond.wait_for(lambda: self._next_ticket >= ctx.ticket)
        try:
            drawn = await self._draw(ctx, per_step - n_fresh)
            if len(drawn) < per_step - n_fresh:
                fresh += await ctx.fresh(per_step - n_fresh - len(drawn), offset=n_fresh)
            await self._add(ctx, fresh)
        finally:
            async with self._cond:
                # A retried build (same ticket) must not skip a later build's turn.
                self._next_ticket = max(self._next_ticket, ctx.ticket + 1)
                self._cond.notify_all()
        ctx.stats.update({"replay_groups": len(drawn), "fresh_groups": len(fresh), "replay_pool_size": self.pool_size})
        return [s for group in fresh + drawn for s in group]

    async def _draw(self, ctx: BuildContext, want: int) -> list[list[dict[str, Any]]]:
        store = ctx.replay_pool
        pool = await store.entries()
        step = ctx.step
        expired = [gid for gid, m in pool.items() if contract.staleness(step, m["policy_version"]) > self.max_age]
        eligible = sorted(
            gid for gid, m in pool.items()
            if gid not in expired and m["use_count"] < self.max_reuse and m["created_step"] < step
        )
        chosen: list[str] = []
        if eligible and want > 0:
            rng = np.random.default_rng([self.seed, step, 0x7E91A])
            weights = np.array([self._weight(pool[g], step) for g in eligible], dtype=float)
            take = min(want, len(eligible))
            index = rng.choice(len(eligible), size=take, replace=False, p=weights / weights.sum())
            chosen = [eligible[i] for i in sorted(index)]
        groups = await store.samples(chosen)
        for gid, samples in zip(chosen, groups):
            uses = pool[gid]["use_count"] + 1
            for sample in samples:
                sample["use_count"] = uses
            pool[gid]["use_count"] = uses
        # Served groups stay while they may be served again; used-up and too old ones leave.
        await store.record_draw(
            {gid: pool[gid] for gid in chosen if pool[gid]["use_count"] < self.max_reuse},
            [gid for gid in chosen if pool[gid]["use_count"] >= self.max_reuse] + expired,
        )
        self.served_from_pool += len(groups)
        return groups

    def _weight(self, meta: dict[str, Any], step: int) -> float:
        if self.sampling == "recency":
            return 1.0 / (1.0 + step - meta["created_step"])
        if self.sampling == "advantage":
            return meta["priority"] + 1e-6
        return 1.0

    async def _add(self, ctx: BuildContext, groups: list[list[dict[str, Any]]]) -> None:
        """Fresh groups (served once, now) enter the pool if they may be served again."""
        store = ctx.replay_pool
        if self.max_reuse <= 1 or not groups:
            self.pool_size = await store.size()
            return
        pool = await store.entries()
        # The pool as it will be, and the writes that make it so (the last decision per group wins).
        added: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
        removed: set[str] = set()

        def remove(gid: str) -> None:
            del pool[gid]
            added.pop(gid, None)
            removed.add(gid)

        for samples in groups:
            first = samples[0]
            gid = first["group_id"]
            version = min(s["policy_version"] for s in samples)
            if self.retention == "newest_per_prompt":
                for other, m in list(pool.items()):
                    if m["prompt_id"] == first["prompt_id"] and m["policy_version"] <= version:
                        remove(other)
            meta = {"prompt_id": first["prompt_id"], "policy_version": version, "use_count": 1,
                    "created_step": ctx.step,
                    "priority": float(np.mean([abs(s["advantage"]) for s in samples]))}
            pool[gid] = meta
            added[gid] = (meta, samples)
            removed.discard(gid)
        # Capacity: evict the oldest groups (then the lowest ids) beyond the cap.
        excess = len(pool) - self.capacity
        if excess > 0:
            for gid in sorted(pool, key=lambda g: (pool[g]["created_step"], g))[:excess]:
                remove(gid)
        await store.record_add(added, removed)
        self.pool_size = len(pool)

    def snapshot(self) -> dict[str, Any]:
        return {**super().snapshot(), "replay_sampling": self.sampling, "max_reuse": self.max_reuse,
                "max_age": self.max_age, "replay_capacity": self.capacity, "pool_size": self.pool_size,
                "served_from_pool": self.served_from_pool}
