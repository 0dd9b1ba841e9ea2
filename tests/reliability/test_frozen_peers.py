"""Redis and the sampler frozen (SIGSTOP: sockets accept, nothing answers), then thawed
(issue 42). The inference-server kind is tests/reliability/test_inference_hangs.py.

* Redis: `GET /batch` never outlives its own `timeout` by more than a few seconds (a 204, or a
  503 with Retry-After saying Redis does not answer); the producer rides the freeze out, and
  afterwards every step arrives once.
* The sampler: the trainer's client says so within its `report_every` (the trainer's
  `wait_log_interval`) plus a poll's grace, keeps its state, and carries on when it thaws: no
  step twice, no version lost.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import httpx
import pytest

from shared.client import ANSWER_GRACE_S
from shared.token_guard import TOKEN_ENV, bearer_headers
from tests.reliability.support import (
    Cleanup,
    Trainer,
    check_batches,
    finish_after_restart,
    freeze,
    run_token,
    start_redis_at,
    stop_process,
    wait_for,
)
from tests.support.servers import start_sampler_process, start_standin

STEPS = 8
MARGIN = 2.0  # what a loaded machine may add to a bound


def _stack(tmp_path: Path, cleanup: Cleanup, token: str):
    standin = start_standin(token_latency=0.002, api_token=token)
    cleanup.add(standin.stop)
    redis_proc, redis_url = start_redis_at(tmp_path / "redis", cleanup=cleanup)
    sampler = start_sampler_process(tmp_path / "sampler", process_env={TOKEN_ENV: token}, redis_url=redis_url,
                                    inference_urls=[standin.url], env="tests.support.envs:CountEnv",
                                    prompts_per_step=2, num_generations=2, max_tokens=6, keep_batches=32)
    cleanup.add(lambda: stop_process(sampler))
    return redis_proc, sampler


def _finish(trainer: Trainer, url: str, sampler) -> None:
    finish_after_restart(trainer, url, detail=sampler.log_tail)
    assert trainer.error is None, f"the trainer gave up: {trainer.error!r}"
    check_batches(trainer)
    assert trainer.published == list(range(1, STEPS + 1)), trainer.published


@pytest.mark.timeout(150)
def test_a_frozen_redis_holds_no_long_poll_past_its_timeout(tmp_path: Path, cleanup: Cleanup) -> None:
    token = run_token()
    redis_proc, sampler = _stack(tmp_path, cleanup, token)
    trainer = Trainer(sampler.url, STEPS, api_token=token)
    trainer.start()
    wait_for(lambda: len(trainer.published) >= 3 or trainer.error or not trainer.is_alive(), 60,
             "the trainer's first 3 steps", detail=sampler.log_tail)
    assert trainer.error is None, repr(trainer.error)

    thaw = freeze(redis_proc.pid, cleanup)
    frozen = time.monotonic()
    with httpx.Client(headers=bearer_headers(token), timeout=60) as http:
        for timeout in (0.0, 1.0):
            # A batch far ahead: its manifest is looked up in Redis, which does not answer.
            asked = time.monotonic()
            reply = http.get(f"{sampler.url}/batch", params={"step": 40, "timeout": timeout})
            took = time.monotonic() - asked
            assert reply.status_code in (204, 503), (reply.status_code, reply.text)
            assert took <= timeout + 2.0 + MARGIN, f"GET /batch?timeout={timeout:g} answered after {took:.1f}s"
            if reply.status_code == 503:
                assert "Retry-After" in reply.headers and "Redis" in reply.json()["detail"], reply.text
    time.sleep(max(0.0, 8.0 - (time.monotonic() - frozen)))  # the freeze outlasts a poll and a step
    assert trainer.is_alive(), f"the trainer stopped during the freeze: {trainer.error!r}"
    thaw()
    assert len(trainer.published) < STEPS, "the trainer finished during the freeze: the drill tested nothing"
    _finish(trainer, sampler.url, sampler)


@pytest.mark.timeout(150)
def test_a_frozen_sampler_is_reported_and_the_trainer_carries_on(tmp_path: Path, cleanup: Cleanup,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tandem.client")
    report_every = 2.0
    token = run_token()
    _, sampler = _stack(tmp_path, cleanup, token)
    trainer = Trainer(sampler.url, STEPS, api_token=token, report_every=report_every)
    trainer.start()
    wait_for(lambda: len(trainer.published) >= 3 or trainer.error or not trainer.is_alive(), 60,
             "the trainer's first 3 steps", detail=sampler.log_tail)
    assert trainer.error is None, repr(trainer.error)

    thaw = freeze(sampler.popen.pid, cleanup)
    frozen = time.time()
    bound = report_every + min(ANSWER_GRACE_S, report_every)

    def silence_reported() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "no answer from the sampler" in r.getMessage() and r.created >= frozen]

    said = wait_for(silence_reported, bound + MARGIN + 1, "the trainer's client to say the sampler does not answer")
    assert said[0].created - frozen <= bound + MARGIN, f"said after {said[0].created - frozen:.1f}s"
    time.sleep(max(0.0, 6.0 - (time.time() - frozen)))
    assert trainer.is_alive(), f"the trainer stopped during the freeze: {trainer.error!r}"
    thaw()
    assert len(trainer.published) < STEPS, "the trainer finished during the freeze: the drill tested nothing"
    _finish(trainer, sampler.url, sampler)
