"""Environments whose reward functions return NaN or infinity, for tests/sampler/test_nonfinite.py."""

from __future__ import annotations

from services.sampler.rollouts.envs.base import Completion, Example, Reward
from tests.support.envs import CountEnv


async def _broken_for_some(example: Example, completion: Completion) -> float:
    # A third of the prompts break the reward function: NaN for 0, 6, 12, ...; inf for 3, 9, ...
    if example.answer % 6 == 0:
        return float("nan")
    if example.answer % 6 == 3:
        return float("inf")
    return len(completion.token_ids) / 8


async def _digit(example: Example, completion: Completion) -> float:
    return float(any(ch.isdigit() for ch in completion.text))


async def _always_nan(example: Example, completion: Completion) -> float:
    return float("nan")


class NanEnv(CountEnv):
    """Prompts whose number is a multiple of 3 get a NaN or infinite `score`."""

    name = "nan"
    rewards = (Reward("score", _broken_for_some, 1.0), Reward("digit", _digit, 0.5))


class AllNanEnv(CountEnv):
    """Every reward is NaN: no usable group exists."""

    name = "allnan"
    rewards = (Reward("score", _always_nan, 1.0),)
