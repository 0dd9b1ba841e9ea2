"""Environments: built-ins by name, or any `package.module:factory` import path."""

from __future__ import annotations

import importlib
from typing import Any

from services.sampler.envs.base import Completion, Environment, Example, Reward

BUILTINS = {
    "toy": "services.sampler.envs.toy:ToyEnv",
    "math": "services.sampler.envs.math:MathEnv",
}


def load_environment(name: str, **kwargs: Any) -> Environment:
    """`name` is a built-in ('toy', 'math') or 'package.module:factory'."""
    target = BUILTINS.get(name, name)
    if ":" not in target:
        raise ValueError(f"unknown environment {name!r}: use one of {sorted(BUILTINS)} or 'package.module:factory'")
    module_name, _, attr = target.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load environment {name!r}: {exc}") from None
    env = factory(**kwargs)
    if not isinstance(env, Environment):
        raise ValueError(f"environment {name!r} is a {type(env).__name__}, not an Environment")
    return env


__all__ = ["Completion", "Environment", "Example", "Reward", "load_environment"]
