"""The default strategy: fresh groups, at most `max_staleness` versions behind the step."""

from __future__ import annotations

from services.sampler.building.strategies.base import Strategy


class OffPolicy(Strategy):
    """Batch N uses weights of version >= N - max_staleness; max_staleness 1 overlaps one step."""

    name = "off_policy"
