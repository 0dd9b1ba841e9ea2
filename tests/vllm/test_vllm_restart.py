"""The shared server's lifecycle helpers (tests/support/vllm.py), which sampler-level drills
use: kill() takes down every process of the server, restart() brings it back on the same
port from the same checkpoint."""

from __future__ import annotations

import httpx
import pytest

from tests.support.vllm import VllmHandle, max_abs_diff, probe_prompt_logprobs, reference_prompt_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

IDS = [5, 17, 42, 8, 33, 60, 12, 9]


def test_kill_then_restart_on_the_same_port(vllm_server: VllmHandle) -> None:
    url, port = vllm_server.url, vllm_server.port
    processes = vllm_server.processes()
    # Launcher, API server, engine core and worker at least, all in the server's group.
    assert len(processes) >= 4, processes
    vllm_server.kill()
    assert vllm_server.processes() == [] and not vllm_server.alive()
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=5)

    vllm_server.restart()
    assert vllm_server.port == port and vllm_server.alive()
    assert httpx.get(url + "/weight_info").json() == {"weight_version": "0"}
    assert max_abs_diff(probe_prompt_logprobs(url, IDS), reference_prompt_logprobs(vllm_server.model_dir, IDS)) < 1e-3
    print(f"restart: ready in {vllm_server.startup_seconds:.0f} s")
