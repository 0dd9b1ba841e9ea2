"""kill -9 the trainer at a chosen moment, run the same command again: the run continues.

A real sampler process (embedded Redis, `keep_batches 1`, so nothing but the trainer's resume
step keeps old batches), a real CPU inference server, and the trainer as its own process with
`checkpoint_every 3`. The trainer stops at one of its drill pause points
(services/trainer/drill.py) in step 5, the drill kills it -9 there, and reruns the command
(without the pause). Step 5 is where checkpoint step-5 is due, three steps after checkpoint
step-2: the moments around it are the ones that used to leave a run unable to resume (the
sampler trimmed batch 3 while the trainer still needed it) or with a hole in its metrics.

Each drill checks: the rerun exits 0 having trained to the end; every step has exactly one
record in trainer_metrics.jsonl, on the sampler's own batch for that step, the steps trained a
second time marked `retrained` and no others; the sampler serves the final version and its
`checkpoint_path` exists; no staging directory is left; no traceback in the rerun's log.
The stack is closed with a run token of its own (the inference server, the sampler and both
trainer runs get it in their environment; every read sends it), and the drill checks the
sampler and the inference server refuse a request without it.
`make stress --drill trainer` runs the same drill 30 times, the moment varied (pause points in
different steps, and kills after a random delay).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from services.trainer import checkpoint as ckpt
from services.trainer.drill import POINTS
from services.trainer.step_record import batch_digest
from shared.client import SamplerClient
from shared.token_guard import TOKEN_ENV, bearer_headers
from tests.reliability.support import (
    Cleanup,
    assert_guarded,
    kill_embedded_redis,
    run_token,
    stop_process,
    wait_for,
)
from tests.support.servers import ServiceProcess, UvicornThread, start_sampler_process

ENV = "tests.trainer.letter_env:LetterEnv"
MAX_STEPS = 8
CHECKPOINT_EVERY = 3
KILL_STEP = 5  # checkpoint step-5 is due here; the one before is step-2


def _records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "trainer_metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def _digests(url: str, steps: list[int], token: str) -> list[str]:
    async with SamplerClient(url, retry_for=30, api_token=token) as client:
        return [batch_digest(await client.get_batch(step, timeout=30)) for step in steps]


def trainer_argv(model: Path, url: str, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "services.cli", "trainer", "--model", str(model), "--sampler-url", url,
            "--run-dir", str(run_dir), "--per-device-batch-size", "4", "--grad-accum-steps", "2",
            "--max-steps", str(MAX_STEPS), "--checkpoint-every", str(CHECKPOINT_EVERY), "--keep-published", "1",
            # bf16 versions at a small learning rate: deltas between full versions every 3 (the chain
            # crosses the kills), as a run at RL's learning rates publishes them.
            "--learning-rate", "1e-6", "--publish-dtype", "bfloat16", "--full-every", "3", "--device", "cpu", "--no-progress", "--no-eval-at-start",
            "--no-eval-at-end", "--poll-timeout", "10"]


def start_stack(tmp: Path, cleanup: Cleanup, model: Path, token: str) -> ServiceProcess:
    """A real CPU inference server and a sampler process (embedded Redis, keep_batches 1),
    both closed with the run's `token` (the sampler's through its environment); checks they
    refuse a request without it."""
    from services.inference.config import InferenceSettings
    from services.inference.server import create_app

    inference = UvicornThread(create_app(InferenceSettings(model=str(model), api_token=token))).start()
    cleanup.add(inference.stop)
    sampler_dir = tmp / "sampler"
    cleanup.add(lambda: kill_embedded_redis(sampler_dir))
    sampler = start_sampler_process(sampler_dir, process_env={TOKEN_ENV: token}, inference_urls=[inference.url],
                                    env=ENV, prompts_per_step=2, num_generations=4, max_tokens=8, max_staleness=1,
                                    keep_batches=1)
    cleanup.add(lambda: stop_process(sampler))
    assert_guarded(sampler.url, "/status", "the sampler")
    assert_guarded(inference.url, "/v1/models", "the inference server")
    return sampler


def start_trainer(tmp: Path, cleanup: Cleanup, model: Path, url: str, run_dir: Path, name: str, token: str,
                  pause: str = "") -> ServiceProcess:
    """The trainer command, the run's `token` in its environment (never on its command line);
    `pause` ("point:step") stops it at that drill point."""
    env = {"OMP_NUM_THREADS": "1", "TANDEM_TRAINER_DRILL_PAUSE": pause, "TANDEM_DRILL_DIR": str(tmp / "drill"),
           TOKEN_ENV: token}
    proc = ServiceProcess(trainer_argv(model, url, run_dir), name="trainer", log_path=tmp / f"{name}.log", env=env)
    cleanup.add(lambda: stop_process(proc))
    return proc


def check_finished(run_dir: Path, url: str, *, resume_at: int, published_at_kill: int, token: str,
                   logs: Callable[[], str]) -> list[int]:
    """After the rerun: one record per step, the retrained ones marked, the same batches, the
    final version served from a directory that exists, nothing staged left. Returns the
    retrained steps."""
    records = _records(run_dir)
    steps = [r for r in records if r.get("event") == "step"]
    numbers = [r["step"] for r in steps]
    assert numbers == list(range(MAX_STEPS)), f"steps missing or twice in the metrics: {numbers}\n{logs()}"
    retrained = [r["step"] for r in steps if r.get("retrained")]
    # The version the rerun found: the one read at the kill, or one more when the dead trainer's
    # background publication had its POST on the way (the sampler finishes a request whose
    # sender died); never more, since one publication at most is in flight.
    found = [r for r in records if r.get("event") == "start"][-1]["sampler_version"]
    assert published_at_kill <= found <= published_at_kill + 1, (found, published_at_kill)
    assert retrained == list(range(resume_at, max(found, resume_at))), (
        f"retrained {retrained}; resumed at {resume_at}, the sampler had version {found} "
        f"({published_at_kill} read at the kill)")
    # Trained on the sampler's batches: those it still keeps, and for a step trained twice,
    # the same batch both times.
    auth = bearer_headers(token)
    trimmed_below = httpx.get(f"{url}/status", timeout=30, headers=auth).json()["steps"]["trimmed_below"]
    kept = [n for n in numbers if n >= trimmed_below]
    assert [steps[n]["batch_digest"] for n in kept] == asyncio.run(_digests(url, kept, token)), "trained on other batches"
    superseded = run_dir / "trainer_metrics.superseded.jsonl"
    for line in superseded.read_text().splitlines() if superseded.exists() else []:
        old = json.loads(line)
        assert old["batch_digest"] == steps[old["step"]]["batch_digest"], f"step {old['step']} retrained on another batch"
    assert all(r.get("loss") is not None for r in steps[resume_at:]), "the resumed steps did not train"
    served = httpx.get(f"{url}/weights_version", timeout=30, headers=auth).json()
    assert served["version"] == MAX_STEPS and all(s["version"] == MAX_STEPS for s in served["servers"]), served
    assert Path(served["checkpoint_path"]).is_dir(), f"the served {served['checkpoint_path']} was deleted"
    leftovers = list(run_dir.glob("*/.tmp-*"))
    assert not leftovers, f"staging directories left behind: {leftovers}"
    return retrained


def kill_and_resume(tmp: Path, cleanup: Cleanup, model: Path, *, point: str | None = None, step: int = KILL_STEP,
                    delay: float = 0.0) -> dict[str, Any]:
    """One drill: the trainer killed -9 at pause point `point` of step `step`, or without a
    point `delay` seconds after the metrics line of step `step - 1` (anywhere in step `step`
    or the next), then the same command run again to the end. Returns what the stress report
    needs; raises AssertionError naming what broke."""
    token = run_token()
    sampler = start_stack(tmp, cleanup, model, token)
    url, run_dir = sampler.url, tmp / "trainer"
    first = start_trainer(tmp, cleanup, model, url, run_dir, "trainer-1", token, f"{point}:{step}" if point else "")
    second = None

    def logs() -> str:
        return (f"first trainer:\n{first.log_tail(3000)}\nsecond trainer:\n"
                f"{second.log_tail(4000) if second else '-'}\nsampler:\n{sampler.log_tail(2000)}")

    if point is not None:
        marker = tmp / "drill" / f"{point}-{step}"
        wait_for(lambda: marker.exists() or first.popen.poll() is not None, 180, f"the trainer to reach {point} {step}",
                 detail=logs)
        assert first.popen.poll() is None, f"the trainer exited before {point} {step}\n{logs()}"
    else:
        wait_for(lambda: sum(r.get("event") == "step" for r in _records(run_dir)) >= step
                 or first.popen.poll() is not None, 180, f"the trainer's step {step - 1}", detail=logs)
        time.sleep(delay)
        assert first.popen.poll() is None, f"the run ended before the kill; nothing was tested\n{logs()}"
    first.kill()
    published_at_kill = httpx.get(f"{url}/weights_version", timeout=30, headers=bearer_headers(token)).json()["version"]
    checkpoint_at_kill = ckpt.latest_checkpoint(run_dir)
    resume_at = checkpoint_at_kill[0] + 1 if checkpoint_at_kill else 0

    t0 = time.monotonic()
    second = start_trainer(tmp, cleanup, model, url, run_dir, "trainer-2", token)
    wait_for(lambda: second.popen.poll() is not None, 240, "the rerun to finish", interval=0.2, detail=logs)
    assert second.popen.returncode == 0, f"the rerun failed\n{logs()}"
    assert "Traceback" not in second.log_tail(100_000), logs()
    retrained = check_finished(run_dir, url, resume_at=resume_at, published_at_kill=published_at_kill, token=token,
                               logs=logs)
    return {"moment": f"{point} {step}" if point else f"{delay:.2f}s after step {step - 1}",
            "published_at_kill": published_at_kill, "resumed_at": resume_at, "retrained": len(retrained),
            "recovered": time.monotonic() - t0}


@pytest.mark.slow
@pytest.mark.parametrize("point", POINTS)
def test_a_trainer_killed_at_each_moment_of_a_checkpoint_step_resumes(point: str, tmp_path: Path, tiny_model: Path,
                                                                      cleanup: Cleanup) -> None:
    result = kill_and_resume(tmp_path, cleanup, tiny_model, point=point)
    if point in ("fetched", "trained"):
        # Killed before checkpoint step-5 committed, while version 5 may still be publishing in
        # the background (batch 5 needs only version 4): batch 3 is needed again.
        assert result["resumed_at"] == 3 and result["published_at_kill"] in (4, 5), result
    elif point in ("snapshot", "checkpoint"):
        # Version 5 is out (the snapshot of version 6 waits for it): batch 3 is needed again, two
        # behind the published version, which keep_batches 1 alone would have deleted.
        assert result["resumed_at"] == 3 and result["published_at_kill"] == 5, result
    else:
        assert result["resumed_at"] == 6, result


@pytest.mark.timeout(300)
def test_a_trainer_killed_inside_its_background_publication_resumes(tmp_path: Path, tiny_model: Path,
                                                                    cleanup: Cleanup) -> None:
    """The make-test gate of the drill above: killed with version 6 written by the background
    publication but not announced, while step 6 trains on (its checkpoint step-5 committed): the
    rerun publishes version 6 whole again and finishes, no step lost or doubled, the chain of
    deltas restarting from a full version."""
    result = kill_and_resume(tmp_path, cleanup, tiny_model, point="written")
    assert result["resumed_at"] == 6 and result["published_at_kill"] == 5, result


def random_moment(i: int) -> dict[str, Any]:
    """The stress run's i-th moment: every fourth run a kill at a random time after step 0..4 (a
    step of the tiny model takes ~0.3 s); the others cycle through the pause points, in steps
    2..6 (checkpoint steps 2 and 5 for the checkpoint points)."""
    rng = random.Random(i)
    if i % 4 == 3:
        return {"step": rng.randint(1, 5), "delay": rng.uniform(0.0, 0.4)}
    k = i - (i + 1) // 4  # pause-point runs before this one
    point, cycle = POINTS[k % len(POINTS)], k // len(POINTS)
    if point in ("checkpoint", "checkpointed"):  # only checkpoint steps pass these points
        return {"point": point, "step": (CHECKPOINT_EVERY - 1, KILL_STEP)[cycle % 2]}
    return {"point": point, "step": 2 + cycle % 5}
