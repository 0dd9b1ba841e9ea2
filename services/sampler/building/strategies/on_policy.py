"""Synchronous on-policy training: fresh groups from the step's own version only."""

from __future__ import annotations

from services.sampler.building.strategies.base import Strategy


class OnPolicy(Strategy):
    """max_staleness 0: batch N only from version N; generation and training alternate.

    The bound itself comes from the settings: choosing this strategy (or `on_policy`) makes
    the sampler's settings resolve max_staleness to 0 (shared/contract.py), so the base
    class's rule already gives version N."""

    name = "on_policy"
