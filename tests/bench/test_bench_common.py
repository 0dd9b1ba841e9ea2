"""The stacks the benchmarks start (bench/_common.py) are closed as a real run is: the stand-in
and the sampler take the benchmark's token from their environment, the sampler sends it to
the stand-in, and the trainer stand-in sends it to the sampler. Real processes, as the
benchmarks run them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from bench._common import AUTH, RUN_TOKEN, sampler_process, standin_process, trainer_loop


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def test_a_bench_stack_is_closed_with_its_token_and_runs_with_it(tmp_path: Path) -> None:
    assert len(RUN_TOKEN) >= 16 and AUTH == {"Authorization": f"Bearer {RUN_TOKEN}"}
    with standin_process(tmp_path, 0.0) as standin:
        assert httpx.get(standin.url + "/health", timeout=10).status_code == 200
        assert httpx.get(standin.url + "/v1/models", timeout=10).status_code == 401
        assert httpx.get(standin.url + "/v1/models", headers=AUTH, timeout=10).status_code == 200
        with sampler_process(tmp_path / "run", inference_urls=[standin.url], env="tests.support.envs:CountEnv",
                             prompts_per_step=2, num_generations=2, max_tokens=4, max_staleness=1) as sampler:
            for path in ("/status", "/weights_version", "/batch?step=0&timeout=0"):
                assert httpx.get(sampler.url + path, timeout=10).status_code == 401, path
            # Batches are made only if the sampler's calls to the stand-in carry the token, and
            # taken and answered only with the trainer stand-in's.
            records = asyncio.run(trainer_loop(sampler.url, 2, 0.0, deadline_s=120))
            assert [r["samples"] for r in records] == [4, 4]
            status = httpx.get(sampler.url + "/status", headers=AUTH, timeout=10).json()
            assert status["versions"]["published"] == 2
            assert status["inference_servers"][0]["failures"] == 0, status["inference_servers"]
            # In their environment, never on a command line (`ps` shows those to everyone).
            for pid in (standin.pid, sampler.pid):
                assert RUN_TOKEN.encode() not in _cmdline(pid)
