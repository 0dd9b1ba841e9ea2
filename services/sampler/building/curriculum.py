"""Curriculum: which lesson (environment) each prompt slot of a step draws from.

Stages are keyed to the trainer step: stage i applies while step < until_step_i. Within a
stage, each slot picks a lesson with probability proportional to its weight, from an RNG
seeded by (seed, step, slot), so the schedule is reproducible. With `adaptive` on, each
weight is scaled by (1 - recent success rate) + a floor, so lessons the policy has
mastered are drawn less; success rates are exponential moving averages of the lesson's
mean reward (clipped to [0, 1]) kept in Redis, so they survive restarts.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from services.sampler.config import CurriculumStage

FLOOR = 0.05  # a mastered lesson keeps some weight, so forgetting is noticed
EMA = 0.3     # weight of the newest batch in the success-rate average


class Curriculum:
    def __init__(self, stages: list[CurriculumStage], *, seed: int, adaptive: bool,
                 redis: aioredis.Redis | None = None, key: str | None = None):
        self.stages = stages
        self.seed = seed
        self.adaptive = adaptive
        self.redis = redis
        self.key = key
        self.success: dict[str, float] = {}
        self.recent_reward: dict[str, float] = {}

    @property
    def lessons(self) -> list[str]:
        names: list[str] = []
        for stage in self.stages:
            names += [n for n in stage.lessons if n not in names]
        return names

    def stage_index(self, step: int) -> int:
        for i, stage in enumerate(self.stages):
            if stage.until_step is None or step < stage.until_step:
                return i
        return len(self.stages) - 1

    def weights(self, step: int) -> dict[str, float]:
        base = self.stages[self.stage_index(step)].lessons
        if not self.adaptive:
            weights = dict(base)
        else:
            weights = {n: w * ((1.0 - self.success.get(n, 0.0)) + FLOOR) for n, w in base.items()}
        total = sum(weights.values())
        return {n: w / total for n, w in weights.items()}

    def pick(self, step: int, slots: int, stream: int = 0) -> list[str]:
        """Lessons of slots 0..slots-1; a prefix of a longer pick is the same pick."""
        weights = self.weights(step)
        names = sorted(weights)
        rng = np.random.default_rng([self.seed, step, stream, 0xC0FFEE])
        choice = rng.choice(len(names), size=slots, p=[weights[n] for n in names])
        return [names[i] for i in choice]

    async def load(self) -> None:
        if self.redis is not None and self.key:
            raw = await self.redis.get(self.key)
            if raw:
                self.success = json.loads(raw)

    async def observe(self, rewards_by_lesson: dict[str, list[float]]) -> None:
        for name, rewards in rewards_by_lesson.items():
            if not rewards:
                continue
            mean = float(np.mean(rewards))
            self.recent_reward[name] = mean
            rate = min(1.0, max(0.0, mean))
            old = self.success.get(name)
            self.success[name] = rate if old is None else (1 - EMA) * old + EMA * rate
        if self.redis is not None and self.key:
            await self.redis.set(self.key, json.dumps(self.success))

    def snapshot(self, step: int) -> dict[str, Any]:
        stage = self.stages[self.stage_index(step)]
        return {
            "stage": self.stage_index(step),
            "until_step": stage.until_step,
            "weights": self.weights(step),
            "success_rate": dict(self.success),
            "recent_reward": dict(self.recent_reward),
            "adaptive": self.adaptive,
        }
