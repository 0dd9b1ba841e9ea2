"""The environment interface: what the sampler needs to turn prompts into scored rollouts.

An environment owns a dataset of examples with stable global `prompt_id`s, formats
prompts, runs a rollout (single-turn by default: one prompt, `n` completions) and scores
completions with weighted async reward functions. The sampler owns everything else:
dataset order, group expansion, advantages, staleness.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Split = Literal["train", "eval"]


@dataclass(frozen=True)
class Example:
    """One prompt. `prompt_id` is unique across splits and stable across runs."""

    prompt_id: str
    prompt: str
    answer: Any = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Completion:
    """One generated completion, as the inference server returned it."""

    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    # Weight versions that produced the tokens, oldest first (from `weight_versions` spans).
    versions: list[int] = field(default_factory=list)
    # 1 where the trainer learns from the token; None means every completion token.
    loss_mask: list[int] | None = None


class Generate(Protocol):
    """What the sampler hands to `rollout`: completions for one prompt."""

    def __call__(self, prompt: str, *, n: int, **sampling: Any) -> Awaitable[list[Completion]]: ...


RewardFn = Callable[[Example, Completion], Awaitable[float]]


@dataclass(frozen=True)
class Reward:
    name: str
    fn: RewardFn
    weight: float = 1.0


class Environment:
    """Base class; subclasses set `name` and `rewards` and implement `examples`."""

    name: str = "env"
    rewards: Sequence[Reward] = ()
    # Sampling defaults the environment needs (e.g. stop strings); the sampler's settings win.
    sampling: dict[str, Any] = {}

    def examples(self, split: Split) -> Sequence[Example]:
        raise NotImplementedError

    def format_prompt(self, example: Example) -> str:
        return example.prompt

    async def rollout(self, generate: Generate, example: Example, n: int, **sampling: Any) -> list[Completion]:
        return await generate(self.format_prompt(example), n=n, **sampling)

    async def score(self, example: Example, completion: Completion) -> tuple[float, dict[str, float]]:
        """Weighted sum of the reward functions, and each one's raw value by name."""
        values = await asyncio.gather(*(r.fn(example, completion) for r in self.rewards))
        by_name = {r.name: float(v) for r, v in zip(self.rewards, values)}
        total = sum(r.weight * by_name[r.name] for r in self.rewards)
        return float(total), by_name
