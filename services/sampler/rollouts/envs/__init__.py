"""Environments: built-ins by name, or any `package.module:factory` import path."""

from __future__ import annotations

import inspect
from typing import Any

from services.sampler.rollouts.plugins import load_by_path
from services.sampler.rollouts.envs.base import Completion, Environment, Example, Reward
from services.sampler.rollouts.envs.failures import EnvironmentLoadError, describe
from services.sampler.rollouts.envs.multiturn import Conversation, Message, MultiTurnEnvironment, Tool, Turn

BUILTINS = {
    "toy": "services.sampler.rollouts.envs.toy:ToyEnv",
    "math": "services.sampler.rollouts.envs.math:MathEnv",
    "parity_dialogue": "services.sampler.rollouts.envs.parity_dialogue:ParityDialogueEnv",
    "calculator": "services.sampler.rollouts.envs.calculator:CalculatorEnv",
}


def load_environment(name: str, **kwargs: Any) -> Environment:
    """`name` is a built-in (see BUILTINS), 'package.module:factory', 'verifiers:<taskset-id>'
    (a verifiers environment; `kwargs` are then its [env] block, services/sampler/rollouts/vf), or
    'reasoning_gym:<dataset>' (`kwargs` are the dataset's config, envs/reasoning_gym.py).

    Whatever fails while the environment is imported, built or checked (a taskset, a harness,
    a factory, a missing nltk resource) is raised as EnvironmentLoadError: one line with the
    environment's id, the exception and, when known, what to do (envs/failures.py)."""
    try:
        return _build(name, **kwargs)
    except Exception as exc:  # noqa: BLE001 - user code can raise anything; each is said in one line
        raise EnvironmentLoadError(describe(name, exc)) from exc


def _build(name: str, **kwargs: Any) -> Environment:
    if name.startswith("verifiers:"):
        from services.sampler.rollouts.vf.environment import VerifiersEnvironment

        return VerifiersEnvironment(name.removeprefix("verifiers:"), **kwargs)
    if name.startswith("reasoning_gym:"):
        from services.sampler.rollouts.envs.reasoning_gym import ReasoningGymEnv

        return ReasoningGymEnv(name.removeprefix("reasoning_gym:"), **kwargs)
    factory = load_by_path(BUILTINS.get(name, name), "environment", list(BUILTINS))
    try:
        env = factory(**kwargs)
    except TypeError as exc:  # most often a misspelt --env-args key: say which keys there are
        raise ValueError(f"environment {name!r}: {exc}; its arguments (--env-args) are {_arguments(factory)}") from None
    if not isinstance(env, Environment):
        raise ValueError(f"environment {name!r} is a {type(env).__name__}, not an Environment")
    check_environment(env)
    return env


def _arguments(factory: Any) -> str:
    try:
        names = [p for p in inspect.signature(factory).parameters if p not in ("self", "args", "kwargs")]
    except (TypeError, ValueError):
        return "unknown"
    return ", ".join(names) or "none"


def check_environment(env: Environment) -> None:
    """Refuse an environment's bad settings before the sampler starts, naming them."""
    if isinstance(env, MultiTurnEnvironment):
        env.check()


__all__ = ["Completion", "Conversation", "Environment", "EnvironmentLoadError", "Example", "Message",
           "MultiTurnEnvironment", "Reward", "Tool", "Turn", "check_environment", "load_environment"]
