"""kill -9 drills against real processes: the sampler under a training trainer.

The trainer kill -9 / resume drill lives in tests/trainer/test_integration.py
(`test_sigkill_mid_run_then_resume`: a killed trainer resumes from its checkpoint,
re-announces its version and trains on exactly the sampler's batches, each step once);
here the sampler is the one that dies, while a real trainer process trains against it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.trainer.step_record import batch_digest
from shared.client import SamplerClient
from tests.reliability.support import (
    Cleanup,
    batch_bytes,
    embedded_redis,
    kill_embedded_redis,
    sealed_steps,
    stop_process,
    wait_for,
)
from tests.support.servers import ServiceProcess, UvicornThread, free_port, start_sampler_process

ENV = "tests.trainer.letter_env:LetterEnv"
STEPS = 8


def _step_records(run_dir: Path) -> list[dict]:
    path = run_dir / "trainer_metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line being written right now
            continue
        if record.get("event") == "step":
            records.append(record)
    return records


async def _digests(url: str, steps: list[int]) -> list[str]:
    async with SamplerClient(url, retry_for=30) as client:
        return [batch_digest(await client.get_batch(step, timeout=30)) for step in steps]


@pytest.mark.slow
def test_sampler_kill9_under_a_training_trainer(tmp_path: Path, tiny_model: Path, cleanup: Cleanup) -> None:
    from services.inference.config import InferenceSettings
    from services.inference.server import create_app

    inference = UvicornThread(create_app(InferenceSettings(model=str(tiny_model)))).start()
    cleanup.add(inference.stop)
    sampler_dir, trainer_dir = tmp_path / "sampler", tmp_path / "trainer"
    cleanup.add(lambda: kill_embedded_redis(sampler_dir))
    port = free_port()
    settings = {"inference_urls": [inference.url], "env": ENV, "prompts_per_step": 2, "num_generations": 4,
                "max_tokens": 8, "max_staleness": 1, "keep_batches": 32}
    sampler = start_sampler_process(sampler_dir, port=port, **settings)
    cleanup.add(lambda: stop_process(sampler))
    url = sampler.url

    trainer = ServiceProcess(
        [sys.executable, "-m", "services.cli", "trainer", "--model", str(tiny_model), "--sampler-url", url,
         "--run-dir", str(trainer_dir), "--per-device-batch-size", "4", "--grad-accum-steps", "2",
         "--max-steps", str(STEPS), "--learning-rate", "1e-3", "--device", "cpu", "--no-progress",
         "--no-eval-at-start", "--no-eval-at-end", "--poll-timeout", "10"],
        name="trainer", log_path=tmp_path / "trainer.log", env={"OMP_NUM_THREADS": "1"},
    )
    cleanup.add(lambda: stop_process(trainer))

    def trainer_log() -> str:
        return f"trainer log:\n{trainer.log_tail(3000)}\nsampler log:\n{sampler.log_tail(2000)}"

    # Mid-run: the trainer has trained two steps and is on its way through the rest.
    wait_for(lambda: len(_step_records(trainer_dir)) >= 2 or trainer.popen.poll() is not None, 120,
             "the trainer's second step", detail=trainer_log)
    assert trainer.popen.poll() is None, f"the trainer exited early\n{trainer_log()}"
    done_before = len(_step_records(trainer_dir))
    assert done_before < STEPS - 2, "the run was nearly over before the kill; nothing would be tested"
    before = {step: batch_bytes(url, step) for step in sealed_steps(url)}
    redis_pid = embedded_redis(sampler_dir)["pid"]

    sampler.kill()  # SIGKILL: no drain, no cleanup, claims left to lapse
    killed_at = time.time()
    time.sleep(1.0)  # the trainer now meets connection errors and retries
    assert trainer.popen.poll() is None, f"the trainer died with the sampler\n{trainer_log()}"
    sampler = start_sampler_process(sampler_dir, port=port, **settings)
    cleanup.add(lambda: stop_process(sampler))
    back_at = time.time()

    # The trainer carries on by itself and finishes the run.
    wait_for(lambda: trainer.popen.poll() is not None, 150, "the trainer to finish after the sampler restart",
             interval=0.2, detail=trainer_log)
    assert trainer.popen.returncode == 0, trainer_log()

    records = _step_records(trainer_dir)
    steps = [r["step"] for r in records]
    assert steps == list(range(STEPS)), f"steps duplicated or skipped: {steps}"
    after_restart = [r for r in records if r["time"] > back_at]
    assert after_restart, f"no step was trained after the restart (killed after {done_before} steps)"
    resumed_in = after_restart[0]["time"] - back_at
    assert resumed_in < 30, f"the trainer took {resumed_in:.1f}s to train a step after the sampler came back"

    # No sealed batch lost or changed: the same bytes before and after the kill.
    assert embedded_redis(sampler_dir)["pid"] == redis_pid, "the embedded Redis should have outlived the sampler"
    for step, content in before.items():
        assert batch_bytes(url, step) == content, f"batch {step} changed across the sampler's kill -9"
    # The trainer trained on exactly the sampler's batches, each once.
    assert [r["batch_digest"] for r in records] == asyncio.run(_digests(url, steps))
    status = httpx.get(f"{url}/status", timeout=30).json()
    assert status["versions"]["published"] == STEPS
    assert httpx.get(f"{inference.url}/is_paused", timeout=10).json()["is_paused"] is False
    print(f"sampler killed after {done_before} trained steps; restarted in {back_at - killed_at:.1f}s; "
          f"next step trained {resumed_in:.1f}s after the restart")
