"""Synchronous on-policy training: fresh groups from the step's own version only."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.sampler.strategies.base import Strategy

if TYPE_CHECKING:
    from services.sampler.config import SamplerSettings


class OnPolicy(Strategy):
    """max_staleness 0: batch N only from version N; generation and training alternate."""

    name = "on_policy"

    def __init__(self, settings: SamplerSettings):
        super().__init__(settings)
        self.max_staleness = 0
