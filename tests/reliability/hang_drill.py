"""The hang drill of `make stress --drill hang` (issue 42): one process of a running stack frozen
with SIGSTOP (its sockets accept, nothing answers) at a chosen moment, then thawed with SIGCONT.

The stack: two stand-in inference servers as processes (reloads take 0.3 s, so a weight sync
is long enough to be caught in), an external Redis, the sampler, and a trainer that publishes a
checkpoint every step, so every version is synced. The run number picks the frozen process
(an inference server, Redis, the sampler), the moment (mid-batch: while a batch is being
built; mid-sync: while a weight sync holds a server paused; mid-swap: while a server that
syncs in one request loads a version) and how long it stays frozen
(FREEZES). What every run checks:

* while Redis is frozen, `GET /batch?timeout=1` answers 204 or 503 within its timeout + a few
  seconds; while the sampler is frozen and the freeze is long enough, the trainer's client has
  said it gets no answer;
* with one inference server frozen past the liveness check, the run goes on with the other;
* after the thaw the trainer finishes: every step once, no group twice, every sample within
  the staleness bound, versions 1..STEPS each published once;
* no inference server is left paused, and both are back in rotation at the last version.

The gate tests of each kind are in test_inference_hangs.py and test_frozen_peers.py; this drill
varies the moment and runs under load.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import httpx

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
    start_standin_process,
    stop_process,
    wait_for,
)
from tests.support.servers import start_sampler_process

TARGETS = ("inference", "redis", "sampler")
# mid-swap: while a server that syncs in one request (the CPU server's way, stand-ins started
# --relabels-on-reload) is loading; mid-sync: while a pause -> ... -> resume sync holds one paused.
MOMENTS = ("mid-batch", "mid-sync", "mid-swap")
FREEZES = (2.0, 4.0, 7.0)
STEPS = 16
CHECK_TIMEOUT = 2.0  # the sampler's server_check_timeout here
REPORT_EVERY = 2.0  # the trainer's wait_log_interval here
MARGIN = 3.0  # what a loaded machine may add to a bound


def variant(i: int) -> tuple[str, str, float]:
    """(target, moment, freeze seconds) of run `i`: every target and moment pairs with every freeze."""
    pairs = [(t, m) for t in TARGETS for m in MOMENTS]
    target, moment = pairs[i % len(pairs)]
    return target, moment, FREEZES[(i // len(pairs)) % len(FREEZES)]


class _Said(logging.Handler):
    """The trainer's client's lines about a sampler that does not answer."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.times: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "no answer from the sampler" in record.getMessage():
            self.times.append(record.created)


def hang_drill(tmp: Path, cleanup: Cleanup, target: str, moment: str, frozen_for: float) -> dict[str, Any]:
    token = run_token()
    auth = bearer_headers(token)
    servers = [start_standin_process(tmp, cleanup, token_latency=0.02, api_token=token,
                                     relabels_on_reload=moment == "mid-swap") for _ in range(2)]
    for server in servers:
        httpx.post(f"{server.url}/_standin/configure", json={"reload_delay": 0.3}, headers=auth, timeout=10)
    redis_proc, redis_url = start_redis_at(tmp / "redis", cleanup=cleanup)
    sampler = start_sampler_process(tmp / "sampler", process_env={TOKEN_ENV: token}, redis_url=redis_url,
                                    inference_urls=[s.url for s in servers], env="tests.support.envs:CountEnv",
                                    prompts_per_step=2, num_generations=2, max_tokens=6, keep_batches=32,
                                    server_check_interval=0.5, server_check_timeout=CHECK_TIMEOUT)
    cleanup.add(lambda: stop_process(sampler))
    said = _Said()
    logging.getLogger("tandem.client").addHandler(said)
    cleanup.add(lambda: logging.getLogger("tandem.client").removeHandler(said))
    trainer = Trainer(sampler.url, STEPS, checkpoints=True, api_token=token, retry_for=120, report_every=REPORT_EVERY)
    trainer.start()
    wait_for(lambda: len(trainer.published) >= 3 or trainer.error or not trainer.is_alive(), 90,
             "the trainer's first 3 steps", detail=sampler.log_tail)
    assert trainer.error is None, repr(trainer.error)

    def paused(url: str) -> bool:
        return bool(httpx.get(f"{url}/is_paused", headers=auth, timeout=10).json()["is_paused"])

    with httpx.Client(headers=auth, timeout=30) as http:
        if moment == "mid-sync":
            syncing = wait_for(lambda: next((s for s in servers if paused(s.url)), None), 60,
                               "a weight sync to pause a server", interval=0.01)
        elif moment == "mid-swap":
            syncing = wait_for(lambda: next((s for s in servers if http.get(f"{s.url}/_standin/stats").json()[
                "reloading"]), None), 60, "a server loading a version", interval=0.01)
        else:
            wait_for(lambda: http.get(f"{sampler.url}/status").json()["steps"]["in_progress"], 60,
                     "a batch being built", interval=0.01)
            syncing = None
        pid = {"inference": (syncing or servers[0]).pid, "redis": redis_proc.pid, "sampler": sampler.pid}[target]
        thaw = freeze(pid, cleanup)
        frozen, frozen_wall = time.monotonic(), time.time()
        published_at_freeze = len(trainer.published)
        if target == "redis":
            asked = time.monotonic()
            reply = http.get(f"{sampler.url}/batch", params={"step": STEPS + 20, "timeout": 1})
            took = time.monotonic() - asked
            assert reply.status_code in (204, 503), (reply.status_code, reply.text)
            assert took <= 1 + 2 + MARGIN, f"GET /batch?timeout=1 answered after {took:.1f}s with Redis frozen"
        time.sleep(max(0.0, frozen_for - (time.monotonic() - frozen)))
        if target == "inference":
            # The other server carries the run: a long freeze must not stall it.
            if frozen_for > CHECK_TIMEOUT + MARGIN:
                assert len(trainer.published) > published_at_freeze, "the run stood still while one server was frozen"
        else:
            assert trainer.is_alive(), f"the trainer stopped during the freeze: {trainer.error!r}"
        thaw()
        if target == "sampler" and frozen_for >= REPORT_EVERY + min(ANSWER_GRACE_S, REPORT_EVERY) + MARGIN:
            assert any(t >= frozen_wall for t in said.times), "the trainer's client never said the sampler is silent"

    recovered = finish_after_restart(trainer, sampler.url, detail=sampler.log_tail, timeout=120)
    assert trainer.error is None, f"the trainer gave up: {trainer.error!r}"
    check_batches(trainer)
    assert trainer.published == list(range(1, STEPS + 1)), trainer.published
    assert published_at_freeze < STEPS, "the trainer finished before the freeze: the drill tested nothing"

    def back() -> bool:
        rows = httpx.get(f"{sampler.url}/weights_version", headers=auth, timeout=10).json()["servers"]
        return all(r["state"] == "ok" and r["version"] == STEPS for r in rows) and not any(paused(s.url) for s in servers)

    wait_for(back, 30, f"both inference servers in rotation at version {STEPS} and none paused",
             detail=sampler.log_tail)
    return {"recovered": recovered, "max_wait": max(trainer.waits), "variant": f"{target} {moment} {frozen_for:g}s"}
