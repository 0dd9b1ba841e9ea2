"""An inference server killed -9 and restarted on its URL in the middle of a run.

It comes back serving its base weights, labelled "0". The sampler notices (the label went
backwards, the answers' weight_versions too), takes it out of rotation, loads the latest
published checkpoint into it with the usual sync and puts it back: the trainer finishes
without noticing more than a pause. When the latest version has no checkpoint_path (the
trainer pushed the weights itself) the sampler cannot do that: the server is "stale", the
cause is in /status, and GET /batch answers 503 with it after `generation_deadline`, never an
endless stream of 204s. Loading the weights into the server and labelling it brings it back.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from shared.client import SamplerClient, SamplerUnavailable
from tests.reliability.support import (
    Cleanup,
    Trainer,
    check_batches,
    kill_embedded_redis,
    start_standin_process,
    stop_process,
    wait_for,
)
from tests.support.servers import start_sampler_process

STEPS = 10
RESTART_AFTER = 3


def _server(url: str) -> dict:
    return httpx.get(f"{url}/status", timeout=10).json()["inference_servers"][0]


def _start(tmp_path: Path, cleanup: Cleanup, **settings):
    standin = start_standin_process(tmp_path, cleanup, token_latency=0.002)
    run_dir = tmp_path / "sampler"
    cleanup.add(lambda: kill_embedded_redis(run_dir))
    sampler = start_sampler_process(run_dir, inference_urls=[standin.url], env="tests.support.envs:CountEnv",
                                    prompts_per_step=2, num_generations=2, max_tokens=6,
                                    server_check_interval=0.5, **settings)
    cleanup.add(lambda: stop_process(sampler))
    return standin, sampler


def _restart(standin, tmp_path: Path, cleanup: Cleanup):
    port = int(standin.url.rsplit(":", 1)[1])
    standin.kill()
    return start_standin_process(tmp_path, cleanup, token_latency=0.002, port=port)


# In `make test` (not slow): the gate's drill for a server that dies and comes back.
def test_a_restarted_server_is_resynced_from_the_latest_checkpoint(tmp_path: Path, cleanup: Cleanup) -> None:
    standin, sampler = _start(tmp_path, cleanup)
    url = sampler.url
    Trainer(url, RESTART_AFTER, train_seconds=0.1, checkpoints=True).run_here()  # version 3: /ckpt/step-3

    # Restarted between steps: nothing but the sampler's own checks can notice it.
    standin = _restart(standin, tmp_path, cleanup)
    server = wait_for(lambda: (s := _server(url))["resyncs"] >= 1 and s["state"] == "ok" and s, 20,
                      "the sampler to re-sync the restarted server", detail=sampler.log_tail)
    assert server["version"] == RESTART_AFTER, server
    assert any("re-synced to version 3" in e["event"] for e in server["events"]), server["events"]
    stats = httpx.get(f"{standin.url}/_standin/stats").json()
    assert stats["reloads"] == [f"/ckpt/step-{RESTART_AFTER}"] and stats["version"] == str(RESTART_AFTER), stats

    # Restarted again while the trainer works: the sampler or the next publication re-syncs it,
    # answers from its base weights are never used, and nothing is lost.
    trainer = Trainer(url, STEPS - RESTART_AFTER, train_seconds=0.3, checkpoints=True, first_step=RESTART_AFTER)
    trainer.start()
    wait_for(lambda: len(trainer.published) >= 2 or not trainer.is_alive(), 60, "two more steps")
    standin = _restart(standin, tmp_path, cleanup)
    trainer.join(90)
    assert not trainer.is_alive(), f"the trainer did not finish: {_server(url)}"
    assert trainer.error is None, repr(trainer.error)
    check_batches(trainer)
    stats = httpx.get(f"{standin.url}/_standin/stats").json()
    assert stats["reloads"] and stats["reloads"][-1] == f"/ckpt/step-{STEPS}", stats
    assert stats["version"] == str(STEPS), stats
    server = _server(url)
    assert server["state"] == "ok" and server["version"] == STEPS, server
    assert sampler.popen.poll() is None


@pytest.mark.slow
def test_without_a_checkpoint_path_a_restarted_server_is_reported_and_batch_answers_503(
        tmp_path: Path, cleanup: Cleanup) -> None:
    standin, sampler = _start(tmp_path, cleanup, generation_deadline=3)
    url = sampler.url
    # Steps 0-2; version 3 published with no checkpoint_path (the trainer pushed the weights).
    Trainer(url, RESTART_AFTER, train_seconds=0.1).run_here()
    # With k = 1, batches 3 and 4 can be generated from version 3: let them seal first.
    wait_for(lambda: {3, 4} <= set(httpx.get(f"{url}/status", timeout=10).json()["steps"]["sealed_steps"]),
             30, "batches 3 and 4")
    standin = _restart(standin, tmp_path, cleanup)

    server = wait_for(lambda: (s := _server(url))["state"] == "stale" and s, 20,
                      "the sampler to mark the restarted server stale", detail=sampler.log_tail)
    assert server["version"] is None and server["in_rotation"] is False, server
    assert "serves version 0" in server["reason"] and "without a checkpoint_path" in server["reason"], server
    listed = httpx.get(f"{url}/inference_servers", timeout=10).json()
    assert listed["servers"][0]["state"] == "stale" and listed["published_version"] == RESTART_AFTER

    # The trainer goes on with the batches that exist (publishing 4 and 5 itself)...
    Trainer(url, 2, train_seconds=0.1, first_step=RESTART_AFTER).run_here()

    # ...then batch 5 needs version 4, which no server in rotation has: a 503 with the cause.
    async def batch_5() -> str:
        async with SamplerClient(url, poll_timeout=1, retry_for=4) as client:
            with pytest.raises(SamplerUnavailable) as caught:
                await client.get_batch_raw(5, timeout=60)
            return str(caught.value)

    message = asyncio.run(asyncio.wait_for(batch_5(), 60))
    assert "without a checkpoint_path" in message and standin.url in message, message
    direct = httpx.get(f"{url}/batch", params={"step": 5, "timeout": 0}, timeout=10)
    assert direct.status_code == 503 and "without a checkpoint_path" in direct.json()["detail"], direct.text
    assert "version 5 was published" in _server(url)["reason"]

    # The operator loads version 5's weights into the server and labels it: back in rotation.
    httpx.post(f"{standin.url}/update_weight_version", json={"new_version": "5"})
    wait_for(lambda: _server(url)["state"] == "ok", 20, "the relabelled server to go back into rotation")
    check_batches(Trainer(url, 2, train_seconds=0.1, first_step=5, retry_for=10).run_here())
    assert sampler.popen.poll() is None
