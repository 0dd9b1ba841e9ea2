"""Strategies: built-ins by name, or any `package.module:Class` import path (a `Strategy`
subclass, constructed with the sampler settings). The interface is in `base.py`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.sampler.rollouts.plugins import load_by_path
from services.sampler.building.strategies.base import BuildContext, Strategy

if TYPE_CHECKING:
    from services.sampler.config import SamplerSettings

BUILTINS = {
    "off_policy": "services.sampler.building.strategies.off_policy:OffPolicy",
    "on_policy": "services.sampler.building.strategies.on_policy:OnPolicy",
    "replay": "services.sampler.building.strategies.replay:Replay",
}


def load_strategy(settings: SamplerSettings) -> Strategy:
    """The strategy `settings.strategy` names: a built-in or 'package.module:Class'."""
    name = "on_policy" if settings.on_policy and settings.strategy == "off_policy" else settings.strategy
    strategy = load_by_path(BUILTINS.get(name, name), "strategy", list(BUILTINS))(settings)
    if not isinstance(strategy, Strategy):
        raise ValueError(f"strategy {name!r} is a {type(strategy).__name__}, not a Strategy subclass")
    return strategy


__all__ = ["BUILTINS", "BuildContext", "Strategy", "load_strategy"]
