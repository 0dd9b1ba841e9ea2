"""Training through a verifiers taskset: Tandem's trainer, the sampler (a subprocess, env
`verifiers:tandem-vf-parity`) and the real CPU inference server of the tiny model. The
taskset is the toy task as verifiers writes it, made one a fresh model learns in a few steps
behind a chat template: any lowercase letter is a right answer (`accept`). A fresh model
starts about a quarter of its answers with one; GRPO raises that within a few steps."""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

import pytest

from services.trainer.config import TrainerSettings
from services.trainer.trainer import train
from shared.settings import build
from tests.support.servers import UvicornThread, kill_embedded_redis, start_sampler_process
from tests.vf.conftest import PLUGINS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

TOKEN = "vf-training-token"
STEPS = 10


async def test_the_tiny_model_learns_through_a_verifiers_taskset(tiny_model: Path, tmp_path: Path) -> None:
    from services.inference.config import InferenceSettings
    from services.inference.server import create_app

    inference = UvicornThread(create_app(InferenceSettings(model=str(tiny_model)))).start()
    sampler_dir = tmp_path / "sampler"
    sampler = None
    try:
        # 4 prompts x 16 generations of 4 tokens; lr 1e-2 (10 steps: 0.30 -> 0.85 when written).
        sampler = start_sampler_process(
            sampler_dir, process_env={"PYTHONPATH": os.pathsep.join([str(PLUGINS), os.getcwd()])},
            inference_urls=[inference.url], env="verifiers:tandem-vf-parity",
            env_args=json.dumps({"taskset": {"size": 512, "accept": string.ascii_lowercase}}), prompts_per_step=4, num_generations=16,
            max_tokens=4, max_staleness=1, temperature=1.0, api_token=TOKEN, seed=0, rollout_log=False)
        settings = build(TrainerSettings, {k: str(v) for k, v in {
            "model": tiny_model, "sampler_url": sampler.url, "run_dir": tmp_path / "trainer", "api_token": TOKEN,
            "per_device_batch_size": 64, "grad_accum_steps": 1, "max_steps": STEPS, "learning_rate": 1e-2,
            "eval_at_start": False, "eval_at_end": False, "progress": False, "keep_checkpoints": 1, "seed": 0,
        }.items()})
        summary = await train(settings)
        assert summary["final_version"] == STEPS, summary
        steps = [r for r in map(json.loads, (tmp_path / "trainer" / "trainer_metrics.jsonl").read_text().splitlines())
                 if r["event"] == "step"]
        rewards = [r["reward_mean"] for r in steps]
        first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
        print(f"verifiers letters task: reward first 3 steps {first:.3f}, last 3 {last:.3f}: {rewards}")
        assert last >= first + 0.25, rewards
    finally:
        if sampler is not None:
            sampler.kill()
        kill_embedded_redis(sampler_dir)
        inference.stop()
