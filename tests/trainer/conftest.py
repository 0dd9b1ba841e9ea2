"""Fixtures for the trainer tests: a tiny HF model directory and synthetic batches.

The model comes from the real `init-model` tiny preset (Llama, character tokenizer,
vocab ~100); the samples are random but shaped exactly like the sampler's.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from shared.wire import Sample
from tests.support.servers import UvicornThread, kill_embedded_redis, start_sampler_process

STACK_ENV = "tests.trainer.letter_env:LetterEnv"
STACK_TOKEN = "trainer-test-token"


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


@pytest.fixture
def make_stack(tmp_path: Path, tiny_model_dir: Path):
    """make_stack(**sampler_settings) -> (sampler process, inference thread): the real sampler
    (a subprocess, embedded Redis) on tests.trainer.letter_env and the real CPU inference server
    (in-process): 2 prompts x 4 generations, max_staleness 1, 8 tokens unless overridden."""
    from services.inference.config import InferenceSettings
    from services.inference.server import create_app

    started = []

    def make(**overrides):
        inference = UvicornThread(create_app(InferenceSettings(model=str(tiny_model_dir)))).start()
        settings = {"inference_urls": [inference.url], "env": STACK_ENV, "prompts_per_step": 2, "num_generations": 4,
                    "max_tokens": 8, "max_staleness": 1, "temperature": 1.0, "eval_examples": 8, "api_token": STACK_TOKEN}
        settings.update(overrides)
        sampler_dir = tmp_path / ("sampler" if not started else f"sampler-{len(started)}")
        started.append((None, inference, sampler_dir))
        sampler = start_sampler_process(sampler_dir, **settings)
        started[-1] = (sampler, inference, sampler_dir)
        return sampler, inference

    try:
        yield make
    finally:
        # SIGKILL: every test has its own run directory, and a graceful sampler shutdown
        # costs seconds per test. The embedded Redis runs in its own session: kill it too.
        for sampler, inference, sampler_dir in started:
            if sampler is not None:
                sampler.kill()
            kill_embedded_redis(sampler_dir)
            inference.stop()


@pytest.fixture
def stack(make_stack):
    """(sampler process, inference thread) with make_stack's defaults."""
    return make_stack()
