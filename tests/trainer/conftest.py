"""Fixtures for the trainer tests: a tiny HF model directory and synthetic batches.

The model comes from the real `init-model` tiny preset (Llama, character tokenizer,
vocab ~100); the samples are random but shaped exactly like the sampler's.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from shared.wire import Sample


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model: Path) -> Path:
    return tiny_model


def make_samples(n: int, seed: int = 0, vocab: int = 90, *, max_prompt: int = 7, max_completion: int = 6,
                 policy_version: int = 0) -> list[Sample]:
    """n samples with varied prompt/completion lengths, some masked tokens, mixed advantages."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        P, C = rng.randint(2, max_prompt), rng.randint(1, max_completion)
        mask = [1] * C
        if C > 2 and i % 3 == 0:
            mask[rng.randrange(C)] = 0  # e.g. a tool-output token the model must not learn
        reward = rng.random()
        out.append(Sample(
            prompt_id=f"p{i // 2}", group_id=f"g{i // 2}",
            prompt_token_ids=[rng.randrange(4, vocab) for _ in range(P)],
            completion_token_ids=[rng.randrange(4, vocab) for _ in range(C)],
            # Near a uniform policy's logprob (ln 1/101 ~ -4.6) so IS weights are O(1).
            completion_logprobs=[-4.6 + rng.uniform(-0.5, 0.5) for _ in range(C)],
            loss_mask=mask, reward=reward, advantage=rng.choice([-1.0, 1.0]) * (0.5 + reward),
            policy_version=policy_version, finish_reason="stop",
        ))
    return out


@pytest.fixture
def samples() -> list[Sample]:
    return make_samples(8)
