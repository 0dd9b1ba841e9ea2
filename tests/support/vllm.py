"""Real vLLM servers for tests: started through `tandem inference --backend vllm` (the
launcher, from .venv-vllm, which `make vllm` builds) with the tiny model from init-model.

    from tests.support.vllm import shared_vllm, stop_shared_vllm, vllm_unavailable_reason

    handle = shared_vllm(tmp_path_factory)   # ONE server per pytest process (start-up ~1 min);
                                             # pytest.skip(reason) when .venv-vllm is unusable
    handle.url            # "http://127.0.0.1:<port>"
    handle.headers        # {"Authorization": "Bearer <token>"} for a server started with
                          # VllmHandle(..., api_token=...), {} otherwise
    handle.model_dir      # the checkpoint it was started from (tiny, seed 0)
    handle.stop()         # SIGTERM through the launcher, SIGKILL to the group after a timeout
    handle.kill()         # SIGKILL to the whole process group: launcher, API server, engine
                          # core and worker, no cleanup (the crash drill)
    handle.restart()      # start again on the same port from the same checkpoint
    handle.log_tail()     # the launcher's and vLLM's output
    stop_shared_vllm()    # at session end (the tests/vllm conftest does it)

A test that changes the shared server must put it back: reload `handle.model_dir` after
loading another checkpoint, resume after pausing. Version labels move freely: read
/weight_info instead of assuming "0".

A server started with `api_token` is closed as `tandem inference --backend vllm` closes it
with the run's token (VLLM_API_KEY and shared.token_guard.VllmTokenGuard): the token goes to
the launcher in its environment (TANDEM_API_TOKEN), never on its command line. Every other
server gets no TANDEM_API_TOKEN from the caller's environment, so it is open whatever the shell
running the tests has set.

Also the probe helpers both tiers use: `probe_prompt_logprobs(url, ids)` (the sampler's
post-sync check, over HTTP) and `reference_prompt_logprobs(model_dir, ids)` (transformers,
float32, the trainer's numbers). `probe_prompt_logprobs`, `reload_method` and `sync_weights`
take `api_token=` for a guarded server.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from services.procs import free_port
from shared.token_guard import TOKEN_ENV, bearer_headers

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
STARTUP_TIMEOUT = 300.0  # measured 40-90 s on 2 cores; the first start also compiles (~30 s)


def vllm_unavailable_reason(python: Path = VLLM_PYTHON) -> str | None:
    """None when `python` has vLLM (asked without importing it); otherwise why not."""
    from services.inference.config import InferenceSettings
    from services.inference.vllm_launcher import VllmNotFound, detect

    if not python.exists():
        return f"no vLLM virtualenv at {python.parent.parent}: run `make vllm` (needs PyPI, ~3.5 GB)"
    try:
        detect(InferenceSettings(model="unused", backend="vllm", vllm_python=str(python)))
    except VllmNotFound as exc:
        return f"{python.parent.parent} is unusable ({exc}); rebuild it: rm -rf .venv-vllm && make vllm"
    return None


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # After the command name: state, ppid, pgrp.
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


class VllmHandle:
    """A vLLM server run by the launcher in a process group of its own."""

    def __init__(self, model_dir: Path, log_path: Path, *, port: int | None = None,
                 served_model_name: str = "tiny", python: Path = VLLM_PYTHON, api_token: str | None = None,
                 **settings: Any):
        self.model_dir = Path(model_dir)
        self.api_token = api_token
        self.log_path = Path(log_path)
        self.port = port or free_port()
        self.served_model_name = served_model_name
        self.argv = [sys.executable, "-m", "services.cli", "inference", "--backend", "vllm",
                     "--model", str(self.model_dir), "--port", str(self.port), "--host", "127.0.0.1",
                     "--served-model-name", served_model_name, "--vllm-python", str(python)]
        for key, value in settings.items():
            # --flag=value: a value may itself start with "--" (extra_args).
            self.argv.append(f"--{key.replace('_', '-')}={value}")
        self.weight_version = str(settings.get("weight_version", "0"))
        self.popen: subprocess.Popen | None = None
        self.startup_seconds: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        """What a client of this server sends: the bearer token when it has one."""
        return bearer_headers(self.api_token)

    def start(self, timeout: float = STARTUP_TIMEOUT) -> VllmHandle:
        """Start and wait until /health answers and the launcher set the initial version."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== starting: {' '.join(self.argv)}\n".encode())
            log.flush()
            started = time.monotonic()
            # The token in the launcher's environment only (`ps` shows command lines to everyone).
            env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV} | {"PYTHONUNBUFFERED": "1"}
            if self.api_token:
                env[TOKEN_ENV] = self.api_token
            self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                          env=env, start_new_session=True)
        deadline = started + timeout
        while True:
            if self.popen.poll() is not None:
                self._reap_group()
                raise RuntimeError(f"vLLM (launcher pid {self.popen.pid}) exited with {self.popen.returncode} "
                                   f"before it was ready; {self.log_path}:\n{self.log_tail()}")
            if self._ready():
                self.startup_seconds = time.monotonic() - started
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"vLLM at {self.url} not ready within {timeout:.0f} s; "
                                   f"{self.log_path}:\n{self.log_tail()}")
            time.sleep(0.5)

    def _ready(self) -> bool:
        try:
            if httpx.get(self.url + "/health", timeout=5).status_code != 200:
                return False
            # The launcher labels the weights right after /health first answers.
            return httpx.get(self.url + "/weight_info", timeout=5,
                             headers=self.headers).json().get("weight_version") == self.weight_version
        except (httpx.HTTPError, ValueError):
            return False

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def processes(self) -> list[int]:
        """Every live process of this server: launcher, API server, engine core, workers."""
        return _group_members(self.popen.pid) if self.popen is not None else []

    def stop(self, timeout: float = 60.0) -> None:
        """Graceful: SIGTERM to the launcher (it forwards it to vLLM); SIGKILL after `timeout`."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self._reap_group(grace=timeout)

    def kill(self) -> None:
        """SIGKILL to the whole process group, engine core and workers included."""
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._reap_group()

    def _reap_group(self, grace: float = 0.0) -> None:
        assert self.popen is not None
        pgid = self.popen.pid
        deadline = time.monotonic() + grace
        while _group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_members(pgid):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(30)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 30
        while (left := _group_members(pgid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if left:
            raise RuntimeError(f"vLLM processes {left} (group {pgid}) survived SIGKILL")

    def restart(self, timeout: float = STARTUP_TIMEOUT) -> VllmHandle:
        """Stop (if running) and start again on the same port, from `model_dir`."""
        self.stop()
        return self.start(timeout)

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


# ---------------------------------------------------------------- one server per session

_shared: VllmHandle | None = None
_shared_error: BaseException | None = None


def shared_vllm(tmp_path_factory) -> VllmHandle:
    """The session's vLLM server, started on first use; skips the calling test when
    .venv-vllm is missing or unusable. A failed start fails every caller with its cause
    instead of trying again (each attempt costs a minute)."""
    global _shared, _shared_error
    import pytest

    reason = vllm_unavailable_reason()
    if reason:
        pytest.skip(reason)
    if _shared_error is not None:
        raise RuntimeError(f"the session's vLLM server failed to start: {_shared_error}")
    if _shared is None:
        from services.inference.init_model import init_model

        root = tmp_path_factory.mktemp("vllm")
        model = init_model(root / "tiny", preset="tiny", seed=0)
        handle = VllmHandle(model, root / "vllm.log")
        atexit.register(handle.kill)  # a crashed or interrupted session leaves no vLLM behind
        try:
            handle.start()
        except BaseException as exc:
            _shared_error = exc
            raise
        _shared = handle
    return _shared


def stop_shared_vllm() -> None:
    global _shared
    if _shared is not None:
        _shared.stop()
        _shared = None


# ---------------------------------------------------------------- the probe

def probe_prompt_logprobs(url: str, ids: list[int], *, timeout: float = 60.0,
                          api_token: str | None = None) -> list[float]:
    """The sampler's post-sync probe: the log-probability the server gives each prompt token
    after the first (`prompt_logprobs: 0`, read back from vLLM's shape)."""
    r = httpx.post(url + "/v1/completions", timeout=timeout, headers=bearer_headers(api_token), json={
        "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0})
    r.raise_for_status()
    rows = r.json()["choices"][0]["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(ids), rows
    return [rows[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]


def reference_prompt_logprobs(model_dir: str | os.PathLike, ids: list[int]) -> list[float]:
    """transformers, float32: log_softmax of the logits at position i-1, taken at ids[i]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


def reload_method(url: str, *, timeout: float = 30.0, api_token: str | None = None) -> str:
    """The collective_rpc method that reloads weights on the server at `url`, decided the way
    the sampler does, without side effects: vLLM in dev mode describes its configuration at
    GET /server_info; a server started with Tandem's worker extension takes
    `tandem_reload_weights`, any other one (vLLM on GPU, Tandem's CPU server, which has no
    /server_info) `reload_weights`."""
    from services.inference.vllm_ext import EXTENSION_CLS, RELOAD_METHOD

    r = httpx.get(url + "/server_info", params={"config_format": "json"}, timeout=timeout,
                  headers=bearer_headers(api_token))
    if r.status_code != 200:
        return "reload_weights"
    parallel = (r.json().get("vllm_config") or {}).get("parallel_config") or {}
    return RELOAD_METHOD if parallel.get("worker_extension_cls") == EXTENSION_CLS else "reload_weights"


def sync_weights(url: str, weights_path: str | os.PathLike | None, version: str, *,
                 method: str | None = None, timeout: float = 120.0, api_token: str | None = None) -> dict:
    """The sampler's weight sync for one server: pause(keep) -> reload -> update_weight_version
    -> reset_prefix_cache -> resume (resume even when a step failed). Returns the reload's
    collective_rpc answer; raises httpx.HTTPStatusError when a step is refused."""
    method = method or reload_method(url, api_token=api_token)
    kwargs = {"weights_path": str(weights_path)} if weights_path is not None else {}
    with httpx.Client(base_url=url, timeout=timeout, headers=bearer_headers(api_token)) as c:
        c.post("/pause", params={"mode": "keep"}).raise_for_status()
        try:
            r = c.post("/collective_rpc", json={"method": method, "kwargs": kwargs})
            r.raise_for_status()
            c.post("/update_weight_version", json={"new_version": version}).raise_for_status()
            c.post("/reset_prefix_cache").raise_for_status()
        finally:
            c.post("/resume").raise_for_status()
    return r.json()
