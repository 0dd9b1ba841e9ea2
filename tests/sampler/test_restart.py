"""A sampler killed with -9 and restarted keeps every sealed batch and resumes generation."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from services.procs import pid_alive
from tests.reliability.support import embedded_redis, wait_for
from tests.support.servers import free_port, kill_embedded_redis, start_sampler_process


def test_kill_9_and_restart_keeps_sealed_batches(run_dir, standin):
    port = free_port()
    settings = dict(inference_urls=[standin.url], env="tests.support.envs:CountEnv",
                    prompts_per_step=2, num_generations=4, max_tokens=6, max_staleness=1)
    sampler = start_sampler_process(run_dir, port=port, **settings)
    url = f"http://127.0.0.1:{port}"
    try:
        before = {}
        for step in range(5):
            response = httpx.get(f"{url}/batch", params={"step": step, "timeout": 30}, timeout=60)
            assert response.status_code == 200, response.text
            before[step] = response.content
            assert httpx.post(f"{url}/weights_version", json={"version": step + 1}).status_code == 200
        redis_pid = json.loads((run_dir / "redis" / "server.json").read_text())["pid"]
        sampler.kill()

        sampler = start_sampler_process(run_dir, port=port, **settings)
        # The embedded Redis outlived the sampler and was reused, not restarted.
        assert json.loads((run_dir / "redis" / "server.json").read_text())["pid"] == redis_pid
        for step, content in before.items():
            again = httpx.get(f"{url}/batch", params={"step": step, "timeout": 5}, timeout=30)
            assert again.status_code == 200
            assert again.content == content, f"batch {step} changed across the restart"
        weights = httpx.get(f"{url}/weights_version").json()
        assert weights["version"] == 5
        # Generation resumes where the run stands.
        nxt = httpx.get(f"{url}/batch", params={"step": 5, "timeout": 30}, timeout=60)
        assert nxt.status_code == 200
        assert {s["policy_version"] for s in nxt.json()["samples"]} <= {4, 5}
    finally:
        sampler.terminate()
        kill_embedded_redis(run_dir)


def test_graceful_stop_and_restart_replays_the_aof(run_dir, standin):
    """A clean shutdown stops the embedded Redis; the next start reads the AOF back."""
    port = free_port()
    settings = dict(inference_urls=[standin.url], env="tests.support.envs:CountEnv",
                    prompts_per_step=2, num_generations=2, max_tokens=4)
    sampler = start_sampler_process(run_dir, port=port, **settings)
    url = f"http://127.0.0.1:{port}"
    try:
        first = httpx.get(f"{url}/batch", params={"step": 0, "timeout": 30}, timeout=60)
        assert first.status_code == 200
        # uvicorn re-raises SIGTERM after its graceful shutdown, so -15 is a clean exit too.
        assert sampler.terminate() in (0, -15)
        assert not (run_dir / "redis" / "server.json").exists()
        sampler = start_sampler_process(run_dir, port=port, **settings)
        again = httpx.get(f"{url}/batch", params={"step": 0, "timeout": 5}, timeout=30)
        assert again.content == first.content
    finally:
        sampler.terminate()
        kill_embedded_redis(run_dir)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_clean_stop_stops_the_redis_adopted_after_a_kill_9(run_dir, standin, sig):
    """A sampler killed with -9 leaves its redis-server running; the next sampler on the run_dir
    adopts it, and stopping that one cleanly stops it, as it would one it had started."""
    settings = dict(inference_urls=[standin.url], env="tests.support.envs:CountEnv", prompts_per_step=2,
                    num_generations=2, max_tokens=4)
    sampler = start_sampler_process(run_dir, **settings)
    try:
        redis_pid = embedded_redis(run_dir)["pid"]
        sampler.kill()
        assert pid_alive(redis_pid)
        sampler = start_sampler_process(run_dir, **settings)
        assert embedded_redis(run_dir)["pid"] == redis_pid, "the running redis-server was not adopted"
        assert "adopted" in sampler.log_tail()
        sampler.popen.send_signal(sig)
        assert sampler.popen.wait(30) in (0, -sig)
        wait_for(lambda: not pid_alive(redis_pid), 15, f"the adopted redis-server (pid {redis_pid}) to stop")
        assert embedded_redis(run_dir) is None
    finally:
        sampler.terminate()
        kill_embedded_redis(run_dir)


def test_the_embedded_redis_fsyncs_every_write_and_an_everysec_one_is_named(run_dir, standin, make_sampler):
    """Acknowledged means durable: the embedded Redis runs with appendfsync always; an external
    Redis that does not is accepted with a warning naming the setting (in /status too)."""
    port = free_port()
    sampler = start_sampler_process(run_dir, port=port, inference_urls=[standin.url],
                                    env="tests.support.envs:CountEnv", prompts_per_step=2, num_generations=2)
    try:
        redis = httpx.get(f"http://127.0.0.1:{port}/status", timeout=30).json()["redis"]
        assert (redis["embedded"], redis["appendonly"], redis["appendfsync"], redis["durable"]) == (
            True, "yes", "always", True), redis
        assert redis["warning"] is None
    finally:
        sampler.terminate()
        kill_embedded_redis(run_dir)
    external = make_sampler()  # the test session's Redis: appendfsync everysec
    redis = httpx.get(f"{external.url}/status", timeout=30).json()["redis"]
    assert redis["durable"] is False and redis["appendfsync"] == "everysec"
    assert "--appendfsync always" in redis["warning"] and "acknowledged" in redis["warning"]
