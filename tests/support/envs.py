"""A small deterministic environment for sampler tests (no model needed)."""

from __future__ import annotations

from services.sampler.envs.base import Completion, Environment, Example, Reward


async def _has_digit(example: Example, completion: Completion) -> float:
    return float(any(ch.isdigit() for ch in completion.text))


async def _length(example: Example, completion: Completion) -> float:
    return min(len(completion.token_ids), 8) / 8


class CountEnv(Environment):
    """`size` prompts "count <i>"; rewards: any digit in the output, and output length."""

    name = "count"
    rewards = (Reward("digit", _has_digit, 1.0), Reward("length", _length, 0.5))

    def __init__(self, size: int = 50):
        self.size = int(size)

    def examples(self, split):
        return [Example(f"count/{split}/{i}", f"count {i}", answer=i) for i in range(self.size)]
