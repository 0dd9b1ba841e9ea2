"""Fixtures for the TRL integration tests: the real stack on the toy task.

The tiny model comes from tests/trainer/conftest.py (the same session fixture, not a copy);
`toy_stack` is that directory's `stack` with the demo's task and batch (toy parity, 8 prompts
x 16 generations, 4 tokens), so that a few steps show the model learning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.servers import UvicornThread, kill_embedded_redis, start_sampler_process
from tests.trainer.conftest import tiny_model_dir  # noqa: F401  (the session fixture, shared)

TOKEN = "trl-test-token"


@pytest.fixture
def make_toy_stack(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Callable[..., Any]]:  # noqa: F811
    """make_toy_stack(**sampler_settings) -> (sampler process, inference thread): a real sampler
    (subprocess, embedded Redis) on the toy task and the real CPU inference server serving the
    tiny model (in-process), reloading every published version."""
    from services.inference.config import InferenceSettings
    from services.inference.server import create_app

    started: list[tuple[Any, UvicornThread, Path]] = []

    def make(**overrides: Any) -> tuple[Any, UvicornThread]:
        inference = UvicornThread(create_app(InferenceSettings(model=str(tiny_model_dir)))).start()
        run_dir = tmp_path / f"sampler-{len(started)}"
        settings: dict[str, Any] = {
            "inference_urls": [inference.url], "env": "toy", "prompts_per_step": 8, "num_generations": 16,
            "max_tokens": 4, "max_staleness": 1, "temperature": 1.0, "eval_examples": 64, "api_token": TOKEN,
            "rollout_log": False,
        }
        settings.update(overrides)
        sampler = start_sampler_process(run_dir, **settings)
        started.append((sampler, inference, run_dir))
        return sampler, inference

    yield make
    for sampler, inference, run_dir in started:
        # SIGKILL: every test has its own run directory; the embedded Redis runs in its own session.
        sampler.kill()
        kill_embedded_redis(run_dir)
        inference.stop()
