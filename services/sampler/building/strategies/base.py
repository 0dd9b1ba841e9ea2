"""Sampling strategies: how rollouts become the batch for a step.

A strategy answers two questions, and the service asks nothing else of it:
* `required_version(step)`: the oldest weights version allowed for fresh rollouts of batch
  `step`. The producer starts generating the batch once a server serves at least that
  version, and `GET /batch` answers 409 while the published version is below it.
* `assemble(ctx)`: the samples of batch `ctx.step`, built from `ctx.fresh(...)` (new,
  scored groups for the step's prompts) and whatever state the strategy keeps.

Batch reuse (`num_iterations`) is common to all strategies: the version rule and the
reuse count are the contract's (shared/contract.py): a reused batch follows its base step,
and a reused sample's staleness grows by one per reuse (honestly reported per step).

Custom strategies are loaded by import path, `strategy = "my_pkg.module:MyStrategy"`: a
`Strategy` subclass constructed with the sampler settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shared import contract

if TYPE_CHECKING:
    from services.sampler.config import SamplerSettings
    from services.sampler.storage.replay_store import ReplayPool
    from services.sampler.building.sources import FreshGroups


@dataclass
class BuildContext:
    """What a strategy may use to build batch `step`."""

    step: int
    min_version: int
    source: FreshGroups
    # The run's replay pool in Redis (services/sampler/storage/replay_store.py), shared by replicas.
    replay_pool: ReplayPool
    env_name: str
    # Builds are numbered in the order the producer starts them (0, 1, ... per process);
    # strategies with shared state use it to act in that order.
    ticket: int = 0
    stats: dict[str, Any] = field(default_factory=dict)

    async def fresh(self, count: int, *, offset: int = 0) -> list[list[dict[str, Any]]]:
        """`count` fresh scored groups (each a list of sample dicts) for this step."""
        groups, fresh_stats = await self.source.groups(self.step, count, self.min_version, offset=offset)
        for key, value in fresh_stats.as_stats().items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key in self.stats:
                self.stats[key] += value
            else:
                self.stats[key] = value
        return [g.samples(g.info.get("lesson", self.env_name)) for g in groups]


class Strategy:
    name = "base"

    def __init__(self, settings: SamplerSettings):
        self.settings = settings
        self.max_staleness = settings.max_staleness
        self.num_iterations = settings.num_iterations

    def base_step(self, step: int) -> int:
        """The step whose generated samples batch `step` serves (itself without reuse)."""
        return contract.base_step(step, self.num_iterations)

    def required_version(self, step: int) -> int:
        return contract.oldest_allowed_version(step, self.max_staleness, self.num_iterations)

    async def assemble(self, ctx: BuildContext) -> list[dict[str, Any]]:
        groups = await ctx.fresh(self.settings.prompts_per_step)
        return [sample for group in groups for sample in group]

    def snapshot(self) -> dict[str, Any]:
        return {"name": self.name, "max_staleness": self.max_staleness, "num_iterations": self.num_iterations}
