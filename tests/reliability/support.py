"""Helpers for the reliability drills: processes we can kill, Redis we can restart on the
same port, and readers that compare what the sampler serves byte for byte.

Every helper that starts something registers its cleanup with a `Cleanup` (the `cleanup`
fixture), which runs even when the drill fails half-way: processes are stopped by pid,
embedded redis-servers by the pid in `run_dir/redis/server.json`.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis as redis_py

from shared.token_guard import TOKEN_ENV, bearer_headers
from tests.support.route_walk import check_closed
from tests.support.servers import ServiceProcess, free_port, start_redis

MSGPACK = {"Accept": "application/msgpack"}


class Cleanup:
    """Callbacks run in reverse order; one failing does not stop the others."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[], Any]] = []

    def add(self, callback: Callable[[], Any]) -> None:
        self._callbacks.append(callback)

    def run(self) -> None:
        errors = []
        while self._callbacks:
            try:
                self._callbacks.pop()()
            except Exception as exc:  # noqa: BLE001 - clean up everything, report after
                errors.append(exc)
        if errors:
            raise RuntimeError(f"cleanup failed: {errors!r}")


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05,
             detail: Callable[[], str] | None = None) -> Any:
    """Poll `predicate` until it returns something truthy; fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f"\n{detail()}" if detail else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{extra}")
        time.sleep(interval)


def freeze(pid: int, cleanup: Cleanup) -> Callable[[], None]:
    """SIGSTOP `pid` (a hang: its sockets accept connections, nothing answers); returns the
    thaw (SIGCONT), which `cleanup` runs too, before it stops anything, so a failed test leaves
    nothing frozen. Thawing twice is harmless."""
    os.kill(pid, signal.SIGSTOP)

    def thaw() -> None:
        os.kill(pid, signal.SIGCONT)

    cleanup.add(thaw)
    return thaw


def kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def embedded_redis(run_dir: Path) -> dict[str, int] | None:
    """{"pid", "port"} of the embedded redis-server a sampler started under `run_dir`."""
    info = Path(run_dir) / "redis" / "server.json"
    try:
        return json.loads(info.read_text())
    except (OSError, ValueError):
        return None


def kill_embedded_redis(run_dir: Path) -> None:
    info = embedded_redis(run_dir)
    if info:
        kill_pid(info["pid"])


def stop_process(proc: ServiceProcess) -> None:
    """SIGKILL the process group if it still runs (cleanup after a drill, not the drill)."""
    if proc.popen.poll() is None:
        try:
            os.killpg(proc.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.popen.wait(10)
    except subprocess.TimeoutExpired:
        pass
    proc._log.close()


def start_redis_at(data_dir: Path, port: int | None = None, cleanup: Cleanup | None = None,
                   appendfsync: str = "everysec") -> tuple[ServiceProcess, str]:
    """A private redis-server with AOF (`appendfsync` everysec unless told) on `port` (or a free
    one), stopped by `cleanup`."""
    proc, url = start_redis(data_dir, port=port, appendfsync=appendfsync)
    if cleanup is not None:
        cleanup.add(lambda: stop_process(proc))
    return proc, url


def start_standin_process(log_dir: Path, cleanup: Cleanup, token_latency: float = 0.0,
                          port: int | None = None, api_token: str | None = None,
                          relabels_on_reload: bool = False) -> ServiceProcess:
    """The inference stand-in as its own process, so that it can be killed -9 (and started
    again on the same `port`: a fresh process, labelled version "0", as a restarted server is).
    `api_token` reaches it in its environment (TANDEM_API_TOKEN), never on its command line."""
    port = port or free_port()
    proc = ServiceProcess(
        [sys.executable, "-m", "services.inference.standin", "--port", str(port),
         "--token-latency", str(token_latency), *(["--relabels-on-reload"] if relabels_on_reload else [])],
        name="standin", log_path=log_dir / f"standin-{port}.log", ready_url=f"http://127.0.0.1:{port}/health",
        env={TOKEN_ENV: api_token} if api_token else None,
    )
    cleanup.add(lambda: stop_process(proc))
    proc.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return proc.wait_ready(60)


def run_token() -> str:
    """A fresh run token for one drill: its stack is closed, as every run is since issue 41."""
    return secrets.token_urlsafe(16)


def assert_guarded(url: str, path: str, what: str) -> None:
    """`GET url+path` is refused (401) without a token and with a wrong one: the drill's stack
    really is closed, so a drill that passes also shows its clients send the run's token."""
    with httpx.Client(base_url=url, timeout=30) as http:
        leaks = check_closed(http, [("GET", path)])
    assert not leaks, f"{what} is not guarded (not 401): {leaks}"


def sealed_steps(url: str, token: str | None = None) -> list[int]:
    return httpx.get(f"{url}/status", timeout=30, headers=bearer_headers(token)).json()["steps"]["sealed_steps"]


def batch_bytes(url: str, step: int, timeout: float = 0.0, token: str | None = None) -> bytes | None:
    """Batch `step` exactly as stored (msgpack); None when it is not sealed (yet). `token`: the
    run's token, for a sampler started with one."""
    response = httpx.get(f"{url}/batch", params={"step": step, "timeout": timeout},
                         headers={**MSGPACK, **bearer_headers(token)}, timeout=timeout + 30)
    if response.status_code == 204:
        return None
    assert response.status_code == 200, (step, response.status_code, response.text[:300])
    return response.content


def redis_keys(redis_url: str, namespace: str) -> dict[str, Any]:
    """The run's durable state as Redis holds it: sealed batches (their manifests: batch:<step>;
    chunks are batch:<step>:<build>:<i>), the sealed index, claims."""
    client = redis_py.Redis.from_url(redis_url, socket_timeout=5)
    try:
        prefix = f"tandem:{namespace}:"
        keys = [k.decode() for k in client.scan_iter(match=prefix + "*", count=1000)]
        names = [k[len(prefix + "batch:"):] for k in keys if k.startswith(prefix + "batch:")]
        batches = sorted(int(name) for name in names if ":" not in name)
        claims = {k: client.get(k) for k in keys if k.startswith(prefix + "claim:")}
        sealed = sorted(int(s) for s in client.zrange(prefix + "sealed", 0, -1))
        meta = {k.decode(): v.decode() for k, v in client.hgetall(prefix + "meta").items()}
        return {"batches": batches, "sealed": sealed, "claims": claims, "meta": meta}
    finally:
        client.close()


class Trainer(threading.Thread):
    """A trainer's loop on `SamplerClient` (its own event loop): batch N, 'train', publish N+1,
    with a checkpoint path when `checkpoints` (the stand-in accepts any path)."""

    def __init__(self, url: str, steps: int, train_seconds: float = 0.4, checkpoints: bool = False,
                 retry_for: float = 60.0, first_step: int = 0, api_token: str | None = None,
                 report_every: float = 30.0):
        super().__init__(daemon=True)
        self.url, self.steps, self.train_seconds, self.api_token = url, steps, train_seconds, api_token
        self.checkpoints, self.retry_for, self.first_step = checkpoints, retry_for, first_step
        self.report_every = report_every  # the client's wait_log_interval
        self.batches: list[dict[str, Any]] = []
        self.published: list[int] = []
        self.waits: list[float] = []  # per step: seconds blocked on the sampler (fetch + publish)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._loop())
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def run_here(self) -> Trainer:
        """Run the loop in the calling thread; raise what it raised."""
        self.run()
        if self.error is not None:
            raise AssertionError(f"the trainer failed: {self.error!r}") from self.error
        return self

    async def _loop(self) -> None:
        from shared.client import SamplerClient

        async with SamplerClient(self.url, poll_timeout=5, retry_for=self.retry_for, api_token=self.api_token,
                                 report_every=self.report_every) as client:
            for step in range(self.first_step, self.first_step + self.steps):
                asked = time.monotonic()
                self.batches.append(await client.get_batch_raw(step, timeout=90))
                waited = time.monotonic() - asked
                await asyncio.sleep(self.train_seconds)
                asked = time.monotonic()
                await client.publish_weights(step + 1, f"/ckpt/step-{step + 1}" if self.checkpoints else None)
                self.waits.append(waited + time.monotonic() - asked)
                self.published.append(step + 1)


def finish_after_restart(trainer: Trainer, url: str, detail: Callable[[], str] | None = None,
                         timeout: float = 90.0) -> float:
    """Wait for `trainer` to finish once Redis is back; the seconds it took. A trainer still
    running after `timeout` fails the drill with where the sampler stands."""
    restarted = time.monotonic()
    trainer.join(timeout)
    if trainer.is_alive():
        status = httpx.get(f"{url}/status", timeout=30, headers=bearer_headers(trainer.api_token)).json()
        raise AssertionError(f"the trainer did not finish within {timeout:.0f}s of Redis coming back: "
                             f"{len(trainer.batches)} batches; sampler steps: {status['steps']}; versions: "
                             f"{status['versions']}" + (f"\n{detail()}" if detail else ""))
    return time.monotonic() - restarted


def check_batches(trainer: Trainer, max_staleness: int = 1) -> None:
    """Every step came once, no group twice, and every sample within the staleness bound."""
    steps = [b["step"] for b in trainer.batches]
    assert steps == list(range(trainer.first_step, trainer.first_step + trainer.steps)), steps
    steps_of_group: dict[str, set[int]] = {}
    for batch in trainer.batches:
        for sample in batch["samples"]:
            steps_of_group.setdefault(sample["group_id"], set()).add(batch["step"])
    assert all(len(s) == 1 for s in steps_of_group.values()), "a group was served in two batches"
    samples = [s for b in trainer.batches for s in b["samples"]]
    assert len(samples) == len({(s["group_id"], s.get("sample_index")) for s in samples}), "a sample came twice"
    for batch in trainer.batches:
        for sample in batch["samples"]:
            assert batch["step"] - max_staleness <= sample["policy_version"] <= batch["step"], (
                batch["step"], sample["policy_version"])
