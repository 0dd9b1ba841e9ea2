"""Fresh groups for a step: prompt choice (dataset order, curriculum) and dynamic sampling.

Prompt slot j of step N reads global index N*P + j (P = prompts_per_step) of its lesson's
seeded dataset order. With `filter_zero_variance`, groups whose rewards are all equal
carry no GRPO signal and are dropped; replacements come from a separate, equally seeded
"extra" stream, at most `max_oversample` extra groups per slot. When that bound is hit the
batch is filled with the dropped groups it has (advantage 0, so harmless) rather than
spinning, and the batch stats say so (`filter_exhausted`).

A group with a non-finite reward, or whose environment failed every retry (`Group.invalid`,
set by `Rollouts.group`), is never kept,
filter or not: it is replaced from the same extra stream within the same bound. Only when
the bound is spent and the batch is still short (zero-variance groups fill first) does the
build fail, with an error naming the environments that need fixing; the
producer retries it and /status shows the error meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.sampler.building.curriculum import Curriculum
from services.sampler.rollouts.rollout import ENV_FAILED, Group, Rollouts
from services.sampler.rollouts.seeds import DatasetOrder, derive_seed

log = logging.getLogger("tandem.sampler.sources")

EXTRA_STREAM = 0x5EED  # offsets the seed of the refill stream's dataset order


@dataclass
class FreshStats:
    generated: int = 0
    dropped: int = 0
    nonfinite: int = 0
    exhausted: bool = False
    by_lesson: dict[str, list[float]] = field(default_factory=dict)

    def as_stats(self) -> dict[str, Any]:
        return {
            "groups_generated": self.generated,
            "groups_dropped": self.dropped,
            "drop_rate": self.dropped / self.generated if self.generated else 0.0,
            "groups_nonfinite": self.nonfinite,
            "filter_exhausted": self.exhausted,
            "lesson_reward_mean": {k: sum(v) / len(v) for k, v in self.by_lesson.items() if v},
        }


def zero_variance(group: Group) -> bool:
    return max(group.rewards) - min(group.rewards) < 1e-9


class FreshGroups:
    def __init__(self, rollouts_for: Callable[[str | None], Rollouts], *, env_name: str,
                 prompts_per_step: int, seed: int, filter_zero_variance: bool,
                 max_oversample: float, curriculum: Curriculum | None):
        self.rollouts_for = rollouts_for
        self.env_name = env_name
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.filter = filter_zero_variance
        self.max_extra_per_slot = max_oversample
        self.curriculum = curriculum
        self._extra_orders: dict[str, DatasetOrder] = {}
        self.extra_stride = prompts_per_step * (math.ceil(max_oversample) + 1)
        # Totals since start, for /status.
        self.total_generated = 0
        self.total_dropped = 0
        self.total_nonfinite = 0
        self.exhausted_batches = 0

    def _lessons(self, step: int, count: int, stream: int = 0) -> list[str]:
        if self.curriculum is None:
            return [self.env_name] * count
        return self.curriculum.pick(step, count, stream)

    def _extra_order(self, lesson: str, size: int) -> DatasetOrder:
        order = self._extra_orders.get(lesson)
        if order is None:
            order = self._extra_orders[lesson] = DatasetOrder(size, derive_seed(self.seed, EXTRA_STREAM, lesson))
        return order

    async def _one(self, lesson: str, index: int, extra: bool, step: int, group_id: str,
                   min_version: int) -> Group:
        rollouts = self.rollouts_for(lesson if self.curriculum else None)
        order = self._extra_order(lesson, len(rollouts.train)) if extra else rollouts.order
        example = rollouts.train[order[index]]
        for attempt in range(3):
            group = await rollouts.group(example, group_id, min_version=min_version,
                                         seed=derive_seed(self.seed, step, group_id, attempt))
            if min(group.policy_versions) >= min_version:
                group.info["lesson"] = lesson
                group.finish(lesson)
                return group
        raise RuntimeError(
            f"group {group_id} kept coming back with weights older than version {min_version} "
            f"(got {group.policy_versions}); is an inference server mislabelled?"
        )

    def _sort(self, groups: list[Group], kept: list[Group], flat: list[Group], invalid: list[Group]) -> None:
        for group in groups:
            if group.invalid is not None:
                invalid.append(group)
            elif self.filter and zero_variance(group):
                flat.append(group)
            else:
                kept.append(group)

    async def groups(self, step: int, count: int, min_version: int, *, offset: int = 0) -> tuple[list[Group], FreshStats]:
        """`count` groups for slots offset..offset+count-1 of `step`."""
        stats = FreshStats()
        lessons = self._lessons(step, self.prompts_per_step + offset + count)[offset:offset + count]
        base = step * self.prompts_per_step
        main = await asyncio.gather(*(
            self._one(lesson, base + offset + j, False, step, f"s{step}-g{offset + j}", min_version)
            for j, lesson in enumerate(lessons)
        ))
        stats.generated += len(main)
        kept: list[Group] = []
        flat: list[Group] = []  # zero-variance groups the filter dropped
        invalid: list[Group] = []  # groups with a non-finite reward: never kept
        self._sort(main, kept, flat, invalid)
        budget = math.floor(self.max_extra_per_slot * count)
        used = 0
        while len(kept) < count and used < budget:
            wave = min(count - len(kept), budget - used)
            extra_lessons = self._lessons(step, offset + used + wave, stream=1)[offset + used:]
            # Refill prompts of different steps (and of a later call with an offset) do not collide.
            extra_base = step * self.extra_stride + offset * math.ceil(self.max_extra_per_slot) + used
            batch = await asyncio.gather(*(
                self._one(lesson, extra_base + i, True, step, f"s{step}-x{offset}-{used + i}", min_version)
                for i, lesson in enumerate(extra_lessons)
            ))
            used += wave
            stats.generated += len(batch)
            self._sort(batch, kept, flat, invalid)
        stats.dropped = len(flat)
        stats.nonfinite = len(invalid)
        if len(kept) < count and flat:
            stats.exhausted = True
            missing = min(count - len(kept), len(flat))
            log.warning("step %d: only %d of %d groups have reward variance after %d extra groups; "
                        "filling with %d zero-variance groups", step, len(kept), count, used, missing)
            kept += flat[:missing]
        if len(kept) < count:
            envs = ", ".join(sorted({g.info.get("lesson", self.env_name) for g in invalid}))
            failed = [g.invalid for g in invalid if g.invalid and g.invalid.startswith(ENV_FAILED)]
            cause, advice = (("failed in their environment", f"fix environment {envs} (last error: {failed[-1]})")
                             if failed else
                             ("had non-finite rewards", f"fix the reward function of {envs} so it returns finite numbers"))
            raise RuntimeError(
                f"step {step}: {len(invalid)} group(s) {cause} and the refill bound "
                f"(max_oversample {self.max_extra_per_slot:g}: {budget} extra groups) is spent with {len(kept)} of "
                f"{count} usable groups; {advice}"
            )
        kept = kept[:count]
        for group in kept:
            stats.by_lesson.setdefault(group.info.get("lesson", self.env_name), []).extend(group.rewards)
        self.total_generated += stats.generated
        self.total_dropped += stats.dropped
        self.total_nonfinite += stats.nonfinite
        self.exhausted_batches += int(stats.exhausted)
        if self.curriculum is not None:
            await self.curriculum.observe(stats.by_lesson)
        return kept, stats

    def snapshot(self) -> dict[str, Any]:
        return {
            "filter_zero_variance": self.filter,
            "groups_generated": self.total_generated,
            "groups_dropped": self.total_dropped,
            "drop_rate": self.total_dropped / self.total_generated if self.total_generated else 0.0,
            "groups_nonfinite": self.total_nonfinite,
            "exhausted_batches": self.exhausted_batches,
        }
