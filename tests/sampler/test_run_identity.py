"""A sampler refuses to continue a run directory or namespace whose run has another identity
(batch shape, environment, seed, sampling...), in one line naming each difference and how to
start afresh; harmless changes, replicas and runs from before identities are accepted."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import redis as redis_py

from tests.reliability.support import embedded_redis, wait_for
from tests.support.servers import REPO, free_port, kill_embedded_redis, sampler_argv, start_sampler_process

SHAPE = dict(env="tests.support.envs:CountEnv", prompts_per_step=2, num_generations=2, max_tokens=4)


def refused(run_dir: Path, **settings) -> str:
    """Start a sampler that must refuse: its last stderr line (the process must exit 2)."""
    result = subprocess.run(sampler_argv(free_port(), run_dir=run_dir, **settings), cwd=REPO, capture_output=True,
                            text=True, timeout=90, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


def batch(url: str, step: int = 0) -> httpx.Response:
    response = httpx.get(f"{url}/batch", params={"step": step, "timeout": 30}, timeout=60)
    assert response.status_code == 200, response.text
    return response


def test_a_run_dir_refuses_another_shape_and_seed_and_fresh_starts_afresh(run_dir, standin):
    sampler = start_sampler_process(run_dir, inference_urls=[standin.url], **SHAPE)
    try:
        first = batch(sampler.url).content
        wait_for(lambda: list((run_dir / "rollouts").glob("*.parquet")), 30, "batch 0's rollout file")
        assert sampler.terminate() in (0, -15)

        line = refused(run_dir, inference_urls=[standin.url], **{**SHAPE, "prompts_per_step": 3, "seed": 1})
        assert line.startswith("tandem sampler: namespace 'default' of the embedded Redis under "), line
        assert "prompts_per_step 2 stored, 3 given" in line and "seed 0 stored, 1 given" in line, line
        assert "--fresh" in line and "--run-dir" in line, line
        assert "num_generations" not in line, line
        # The refusing sampler stopped the embedded Redis it started; the run is intact.
        assert embedded_redis(run_dir) is None

        # Harmless changes continue the run: the stored batch is the same bytes.
        sampler = start_sampler_process(run_dir, inference_urls=[standin.url], max_concurrency=3, keep_batches=20,
                                        max_staleness=2, **SHAPE)
        assert batch(sampler.url).content == first
        assert sampler.terminate() in (0, -15)

        # --fresh: a new run with the new shape, from version 0.
        sampler = start_sampler_process(run_dir, inference_urls=[standin.url], fresh=True,
                                        **{**SHAPE, "prompts_per_step": 3})
        assert len(batch(sampler.url).json()["samples"]) == 3 * 2
        assert httpx.get(f"{sampler.url}/weights_version").json()["version"] == 0
        assert "deleted the" in sampler.log_tail() and "key(s)" in sampler.log_tail()
        # The old run's rollout files are set aside, not mixed with the new run's.
        [aside] = run_dir.glob("rollouts.before-*")
        assert (aside / "step-000000.parquet").exists()
    finally:
        sampler.terminate()
        kill_embedded_redis(run_dir)


def test_replicas_share_a_namespace_and_a_replica_with_another_run_is_refused(tmp_path, redis_url, namespace,
                                                                            standin):
    settings = dict(redis_url=redis_url, namespace=namespace, inference_urls=[standin.url], **SHAPE)
    replicas = [start_sampler_process(tmp_path / name, **settings) for name in ("a", "b")]
    try:
        first = batch(replicas[0].url).content
        assert batch(replicas[1].url).content == first
        line = refused(tmp_path / "c", **{**settings, "num_generations": 4, "env_args": '{"size": 40}'})
        assert f"namespace {namespace!r} on Redis redis://127.0.0.1:" in line, line
        assert "num_generations 2 stored, 4 given" in line and 'env_args {} stored, {"size": 40} given' in line, line
        assert "--namespace" in line, line
        # The replicas carry on.
        assert batch(replicas[1].url, 1).status_code == 200
    finally:
        for replica in replicas:
            replica.terminate()


def test_a_namespace_from_before_identities_is_adopted(make_sampler, redis_url, namespace):
    sampler = make_sampler(prompts_per_step=2, num_generations=2)
    first = batch(sampler.url).content
    sampler.stop()
    client = redis_py.Redis.from_url(redis_url)
    try:
        # What an older sampler leaves: batches and a version, no identity.
        assert client.delete(f"tandem:{namespace}:run") == 1
        sampler = make_sampler(prompts_per_step=2, num_generations=2, temperature=0.5)
        assert batch(sampler.url).content == first
        stored = client.hgetall(f"tandem:{namespace}:run")
        assert stored[b"prompts_per_step"] == b"2" and stored[b"temperature"] == b"0.5"
        sampler.stop()
    finally:
        client.close()
