"""Sampling strategies: how rollouts become the batch for a step.

A strategy answers two questions, and the service asks nothing else of it:
* `required_version(step)`: the oldest weights version allowed in batch `step`. The
  producer starts generating the batch once a server serves at least that version,
  and `GET /batch` answers 409 while the published version is below it.
* `assemble(step, source)`: the groups of batch `step`, drawn from `source` (fresh
  rollouts for the step's prompts); a replay buffer or a filter would live here.

Custom strategies are loaded by import path: `strategy = "my_pkg.module:MyStrategy"`;
the class is constructed with the sampler settings.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from services.sampler.config import SamplerSettings
    from services.sampler.rollout import Group


class GroupSource(Protocol):
    async def groups_for_step(self, step: int, min_version: int) -> list[Group]: ...


class Strategy:
    name = "base"

    def __init__(self, settings: SamplerSettings):
        self.settings = settings

    def required_version(self, step: int) -> int:
        raise NotImplementedError

    async def assemble(self, step: int, source: GroupSource) -> list[Group]:
        return await source.groups_for_step(step, self.required_version(step))


class OffPolicy(Strategy):
    """Batch N uses weights of version >= N - k (k = max_staleness); k = 1 overlaps one step."""

    name = "off_policy"

    def __init__(self, settings: SamplerSettings):
        super().__init__(settings)
        self.k = settings.staleness

    def required_version(self, step: int) -> int:
        return max(0, step - self.k)


class OnPolicy(OffPolicy):
    """k = 0: batch N only from version N; generation and training alternate."""

    name = "on_policy"

    def __init__(self, settings: SamplerSettings):
        super().__init__(settings)
        self.k = 0


BUILTINS: dict[str, type[Strategy]] = {"off_policy": OffPolicy, "on_policy": OnPolicy}


def load_strategy(settings: SamplerSettings) -> Strategy:
    name = "on_policy" if settings.on_policy and settings.strategy == "off_policy" else settings.strategy
    if name in BUILTINS:
        return BUILTINS[name](settings)
    if ":" not in name:
        raise ValueError(f"unknown strategy {name!r}: use one of {sorted(BUILTINS)} or 'package.module:Class'")
    module_name, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load strategy {name!r}: {exc}") from None
    strategy = cls(settings)
    if not isinstance(strategy, Strategy):
        raise ValueError(f"strategy {name!r} is a {type(strategy).__name__}, not a Strategy subclass")
    return strategy
