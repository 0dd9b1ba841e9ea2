"""Environments: built-ins by name, or any `package.module:factory` import path."""

from __future__ import annotations

from typing import Any

from services.sampler.plugins import load_by_path
from services.sampler.envs.base import Completion, Environment, Example, Reward

BUILTINS = {
    "toy": "services.sampler.envs.toy:ToyEnv",
    "math": "services.sampler.envs.math:MathEnv",
}


def load_environment(name: str, **kwargs: Any) -> Environment:
    """`name` is a built-in ('toy', 'math') or 'package.module:factory'."""
    factory = load_by_path(BUILTINS.get(name, name), "environment", list(BUILTINS))
    env = factory(**kwargs)
    if not isinstance(env, Environment):
        raise ValueError(f"environment {name!r} is a {type(env).__name__}, not an Environment")
    return env


__all__ = ["Completion", "Environment", "Example", "Reward", "load_environment"]
