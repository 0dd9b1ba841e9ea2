"""kill -9 Redis mid-run: the sampler and its client reconnect by themselves, and nothing
acknowledged is lost.

An external Redis (AOF, fsync every second) is restarted by the drill on the same port;
the embedded one is restarted by the sampler's watchdog. A killed *process* loses no write
it acknowledged (the AOF write(2) happens before the reply; only an OS crash could lose the
last second), so every batch a client received before the crash must be served identically
afterwards, and every acknowledged version must still be published.

Every stack here is closed with a run token of its own (the stand-in, the sampler through its
environment, the trainer; every read sends it); the drills check the sampler and the stand-in
refuse a request without it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared import codec
from shared.token_guard import TOKEN_ENV, bearer_headers
from tests.reliability.support import (
    Cleanup,
    Trainer,
    assert_guarded,
    batch_bytes,
    embedded_redis,
    finish_after_restart,
    kill_embedded_redis,
    kill_pid,
    run_token,
    start_redis_at,
    stop_process,
    wait_for,
)
from tests.support.servers import start_sampler_process, start_standin

STEPS = 10
CRASH_AFTER = 3


def _check_nothing_lost(url: str, trainer: Trainer, acked_before: int, batches_before: dict[int, bytes]) -> None:
    token = trainer.api_token  # the run's, which every read here sends
    assert trainer.error is None, f"the trainer gave up: {trainer.error!r}"
    assert [b["step"] for b in trainer.batches] == list(range(STEPS))
    group_ids = [s["group_id"] for b in trainer.batches for s in b["samples"]]
    assert len(set(group_ids)) == len(group_ids) // 2, "a group was served in two batches"
    # Every batch read before the crash is still there, byte for byte...
    for step, content in batches_before.items():
        assert batch_bytes(url, step, token=token) == content, f"batch {step}, read before the crash, changed or vanished"
    # ...and every batch the trainer received is what the sampler serves now.
    with httpx.Client(timeout=30, headers=bearer_headers(token)) as http:
        for batch in trainer.batches:
            again = http.get(f"{url}/batch", params={"step": batch["step"]})
            assert again.status_code == 200 and again.json() == codec.plain(batch), f"batch {batch['step']} differs"
        published = http.get(f"{url}/weights_version").json()["version"]
    assert published >= acked_before, f"version {acked_before} was acknowledged before the crash, now {published}"
    assert published == STEPS


def _drill(url: str, token: str, crash: Any, restart: Any, outage: float = 1.5) -> float:
    """Kill, wait `outage` seconds, restart; returns the seconds from the restart to the
    trainer's last step. `token`: the run's, which the trainer and every read send."""
    trainer = Trainer(url, STEPS, api_token=token)
    trainer.start()
    wait_for(lambda: len(trainer.published) >= CRASH_AFTER or trainer.error or not trainer.is_alive(), 60,
             f"the trainer's first {CRASH_AFTER} steps")
    assert trainer.error is None, repr(trainer.error)
    acked_before = trainer.published[-1]
    batches_before = {b["step"]: batch_bytes(url, b["step"], token=token) for b in trainer.batches}
    crash()
    time.sleep(outage)  # the trainer's requests now fail (503 or transport errors) and are retried
    assert trainer.is_alive(), f"the trainer stopped during the outage: {trainer.error!r}"
    restart()
    left = STEPS - len(trainer.published)
    assert left > 0, "the trainer finished during the outage: the drill tested nothing"
    recovered = finish_after_restart(trainer, url)
    _check_nothing_lost(url, trainer, acked_before, batches_before)
    return recovered


@pytest.mark.slow
def test_external_redis_kill9_and_restart_on_the_same_port(tmp_path: Path, cleanup: Cleanup) -> None:
    external_redis_drill(tmp_path, cleanup)


def external_redis_drill(tmp_path: Path, cleanup: Cleanup, outage: float = 1.5) -> float:
    """The drill with an external Redis (AOF) killed -9 and restarted on its port after
    `outage` seconds; returns the seconds the trainer took to finish after the restart."""
    token = run_token()
    standin = start_standin(token_latency=0.002, api_token=token)
    cleanup.add(standin.stop)
    data = tmp_path / "redis"
    redis_proc, redis_url = start_redis_at(data, cleanup=cleanup)
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    sampler = start_sampler_process(tmp_path / "sampler", process_env={TOKEN_ENV: token}, redis_url=redis_url,
                                    inference_urls=[standin.url], env="tests.support.envs:CountEnv",
                                    prompts_per_step=2, num_generations=2, max_tokens=6, keep_batches=32)
    cleanup.add(lambda: stop_process(sampler))
    assert_guarded(sampler.url, "/status", "the sampler")
    assert_guarded(standin.url, "/v1/models", "the stand-in")

    def restart() -> None:
        start_redis_at(data, port=port, cleanup=cleanup)

    recovered = _drill(sampler.url, token, redis_proc.kill, restart, outage)
    status = httpx.get(f"{sampler.url}/status", timeout=30, headers=bearer_headers(token)).json()
    assert status["steps"]["sealed_steps"][:STEPS] == list(range(STEPS))
    assert sampler.popen.poll() is None
    return recovered


@pytest.mark.slow
def test_embedded_redis_kill9_is_restarted_by_the_watchdog(tmp_path: Path, cleanup: Cleanup) -> None:
    embedded_redis_drill(tmp_path, cleanup)


def embedded_redis_drill(tmp_path: Path, cleanup: Cleanup) -> float:
    """The drill with the sampler's embedded Redis killed -9 (its watchdog restarts it, within
    a second or two: the outage is the watchdog's, not the drill's)."""
    token = run_token()
    standin = start_standin(token_latency=0.002, api_token=token)
    cleanup.add(standin.stop)
    run_dir = tmp_path / "sampler"
    cleanup.add(lambda: kill_embedded_redis(run_dir))
    sampler = start_sampler_process(run_dir, process_env={TOKEN_ENV: token}, inference_urls=[standin.url],
                                    env="tests.support.envs:CountEnv", prompts_per_step=2, num_generations=2,
                                    max_tokens=6, keep_batches=32)
    cleanup.add(lambda: stop_process(sampler))
    assert_guarded(sampler.url, "/status", "the sampler")
    assert_guarded(standin.url, "/v1/models", "the stand-in")
    first = embedded_redis(run_dir)

    def crash() -> None:
        kill_pid(first["pid"])

    def restarted() -> None:
        # The watchdog notices within a second or two and restarts it on the same port.
        info = wait_for(lambda: (i := embedded_redis(run_dir)) and i["pid"] != first["pid"] and i, 20,
                        "the watchdog to restart the embedded Redis", detail=sampler.log_tail)
        assert info["port"] == first["port"]

    recovered = _drill(sampler.url, token, crash, restarted)
    assert sampler.popen.poll() is None
    return recovered


def test_a_long_poll_whose_client_disconnects_loses_nothing(tmp_path: Path, cleanup: Cleanup) -> None:
    token = run_token()
    auth = bearer_headers(token)
    standin = start_standin(api_token=token)
    cleanup.add(standin.stop)
    run_dir = tmp_path / "sampler"
    cleanup.add(lambda: kill_embedded_redis(run_dir))
    assert httpx.post(f"{standin.url}/pause", headers=auth).status_code == 200  # batch 0 cannot seal yet
    cleanup.add(lambda: httpx.post(f"{standin.url}/resume", headers=auth))
    sampler = start_sampler_process(run_dir, process_env={TOKEN_ENV: token}, inference_urls=[standin.url],
                                    env="tests.support.envs:CountEnv", prompts_per_step=2, num_generations=2,
                                    max_tokens=6)
    cleanup.add(lambda: stop_process(sampler))
    url = sampler.url

    async def abandon(n: int) -> int:
        # Clients that give up mid-poll (read timeout) or are cancelled: the server sees disconnects.
        async with httpx.AsyncClient(timeout=httpx.Timeout(5, read=0.3), headers=auth) as http:
            async def one(i: int) -> bool:
                try:
                    await http.get(f"{url}/batch", params={"step": 0, "timeout": 30}, headers={"X-Poll": str(i)})
                except httpx.ReadTimeout:
                    return True
                return False
            return sum(await asyncio.gather(*(one(i) for i in range(n))))

    assert asyncio.run(abandon(20)) == 20
    # Seal while more pollers are disconnecting.
    async def seal_during_disconnects() -> int:
        task = asyncio.create_task(abandon(20))
        await asyncio.sleep(0.15)
        async with httpx.AsyncClient(headers=auth) as http:
            assert (await http.post(f"{standin.url}/resume")).status_code == 200
        return await task

    asyncio.run(seal_during_disconnects())
    first = batch_bytes(url, 0, timeout=20, token=token)
    assert first is not None, "batch 0 was not sealed"
    assert batch_bytes(url, 0, token=token) == first, "reading a batch must never pop or change it"
    status = httpx.get(f"{url}/status", timeout=10, headers=auth).json()
    assert 0 in status["steps"]["sealed_steps"]
    assert sampler.popen.poll() is None
