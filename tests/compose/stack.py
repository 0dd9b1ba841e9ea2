"""`docker compose --profile cpu up` of the real docker-compose.yml, watched from outside.

Everything goes through the compose file a user runs: the only inputs are environment
variables it already reads (the API token, the sampler's host port, the step count) and a
project name of our own, so a user's stack on the same daemon is never touched. Every request
to the sampler carries the run's token, as a user's client would: only /health and /metrics
answer without it.
"""

from __future__ import annotations

import functools
import json
import secrets
import shutil
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import msgpack

from services.procs import free_port
from shared.token_guard import bearer_headers
from tests.compose.engine import Engine, compose_command
from tests.reliability import support as reliability_support

REPO = Path(__file__).resolve().parents[2]
PROJECT = "tandemcheck"
LABEL = f"label=com.docker.compose.project={PROJECT}"


# The drills' poll, at half a second: each look is a `docker inspect` or a GET /status.
wait_for = functools.partial(reliability_support.wait_for, interval=0.5)


class Stack:
    def __init__(self, engine: Engine, steps: int):
        self.engine, self.steps = engine, steps
        self.sampler_port = free_port()
        # The variable that published the inference port before it was closed, set all the
        # same: the exposure phase checks that nothing answers there (a `ports:` put back fails it).
        self.old_inference_port = free_port()
        self.url = f"http://127.0.0.1:{self.sampler_port}"
        self.token = secrets.token_hex(16)
        self.auth = bearer_headers(self.token)
        # Variables the compose file reads; COMPOSE_PROFILES is left to .env and --profile, and
        # TANDEM_BIND unset (TANDEM_ is dropped), so the sampler is published on its default, loopback.
        self.env = {k: v for k, v in engine.env.items() if not k.startswith(("TANDEM_", "COMPOSE_"))}
        self.env.update(TANDEM_API_TOKEN=self.token, TANDEM_SAMPLER_PORT=str(self.sampler_port),
                        TANDEM_INFERENCE_PORT=str(self.old_inference_port), TANDEM_MAX_STEPS=str(steps),
                        TANDEM_REPORT_TO="tensorboard")  # checked by the tracking phase

    # -- compose and docker ------------------------------------------------------------------
    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [*compose_command(), "-p", PROJECT, "--profile", "cpu", *args]
        result = subprocess.run(cmd, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)}: exit {result.returncode}\n{result.stdout[-3000:]}"
                                 f"\n{result.stderr[-3000:]}\n{self.logs()}")
        return result

    def container(self, service: str) -> str:
        out = self.engine.docker("ps", "-aq", "--filter", LABEL, "--filter",
                                 f"label=com.docker.compose.service={service}").stdout.split()
        assert len(out) == 1, f"{service}: containers {out}"
        return out[0]

    def state(self, service: str) -> dict[str, Any]:
        info = json.loads(self.engine.docker("inspect", self.container(service)).stdout)[0]
        state = info["State"]
        return {"status": state["Status"], "health": (state.get("Health") or {}).get("Status"),
                "exit": state["ExitCode"], "started": state["StartedAt"], "restarts": info["RestartCount"],
                "pid": state["Pid"]}

    def port_bindings(self, service: str) -> dict[str, list[dict[str, str]]]:
        """The ports the container publishes on the host, as Docker holds them:
        {"8100/tcp": [{"HostIp": "127.0.0.1", "HostPort": "..."}]}; {} when none."""
        info = json.loads(self.engine.docker("inspect", self.container(service)).stdout)[0]
        return {port: list(bound) for port, bound in (info["HostConfig"].get("PortBindings") or {}).items() if bound}

    def exec_python(self, service: str, code: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """`code` run by the Python of `service`'s container (its environment): a client inside
        the compose network."""
        return self.engine.docker("exec", self.container(service), "python", "-c", code, timeout=timeout)

    def logs(self, tail: int = 40) -> str:
        try:
            result = self.compose("logs", "--no-color", "--tail", str(tail), timeout=60, check=False)
            return "compose logs:\n" + result.stdout[-8000:]
        except Exception as exc:  # noqa: BLE001 - diagnostics only
            return f"(no logs: {exc!r})"

    def leftovers(self) -> dict[str, list[str]]:
        return {kind: self.engine.docker(*cmd, "--filter", LABEL).stdout.split()
                for kind, cmd in (("containers", ("ps", "-aq")), ("networks", ("network", "ls", "-q")),
                                  ("volumes", ("volume", "ls", "-q")))}

    # -- the sampler, from the host ------------------------------------------------------------
    def status(self) -> dict[str, Any] | None:
        try:
            response = httpx.get(f"{self.url}/status", headers=self.auth, timeout=10)
            return response.json() if response.status_code == 200 else None
        except httpx.HTTPError:
            return None

    def published(self) -> int:
        status = self.status()
        return (status or {}).get("versions", {}).get("published") or 0

    def trainer_metrics(self) -> list[dict[str, Any]]:
        out = self.engine.docker("exec", self.container("sampler-cpu"), "cat",
                                 "/data/trainer/trainer_metrics.jsonl", check=False).stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]


class BatchRecorder(threading.Thread):
    """Reads every sealed batch as the sampler serves it (msgpack bytes), while the trainer
    trains: the sampler keeps only `keep_batches` behind the published version, so the end
    of the run is too late to read them all. Reads do not consume anything."""

    def __init__(self, url: str, token: str):
        super().__init__(daemon=True)
        self.url, self.batches, self.stopped, self.errors = url, {}, threading.Event(), 0
        self.auth = bearer_headers(token)

    def run(self) -> None:
        with httpx.Client(timeout=10, headers=self.auth) as http:
            while not self.stopped.is_set():
                try:
                    sealed = http.get(f"{self.url}/status").json()["steps"]["sealed_steps"] or []
                    for step in sealed:
                        if step not in self.batches:
                            got = http.get(f"{self.url}/batch", params={"step": step, "timeout": 0},
                                           headers={"Accept": "application/msgpack"})
                            if got.status_code == 200:
                                self.batches[step] = got.content
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    self.errors += 1  # the sampler or Redis is down: the drills do that
                self.stopped.wait(0.3)

    def read(self, step: int) -> tuple[int | None, bytes]:
        """The sampler's answer for batch `step` now: (HTTP status or None when it cannot be
        reached, the body)."""
        try:
            got = httpx.get(f"{self.url}/batch", params={"step": step, "timeout": 0},
                            headers={"Accept": "application/msgpack", **self.auth}, timeout=10)
        except httpx.HTTPError:
            return None, b""
        return got.status_code, got.content


def refused(host: str, port: int, timeout: float = 5) -> bool:
    """True when nothing accepts a TCP connection at host:port (refused, or unreachable)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return False
    except OSError:
        return True


def host_addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback: where a port published on 0.0.0.0
    would answer, and one bound to 127.0.0.1 must not."""
    if shutil.which("ip"):
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=False).stdout
        found = [line.split()[3].split("/")[0] for line in out.splitlines() if len(line.split()) > 3]
    elif shutil.which("hostname"):
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=False).stdout
        found = [a for a in out.split() if "." in a]
    else:
        found = []
    return [a for a in found if not a.startswith("127.")]


def check_no_batch_lost(steps: int, records: list[dict[str, Any]], batches: dict[int, bytes]) -> dict[str, Any]:
    """The trainer stepped 0..steps-1 once each and published versions 1..steps in order, and
    every batch it trained on was read from the sampler, each group in one batch only."""
    step_records = [r for r in records if r.get("event") == "step"]
    assert [r["step"] for r in step_records] == list(range(steps)), \
        f"trainer steps {[r['step'] for r in step_records]}"
    assert [r["version"] for r in step_records] == list(range(1, steps + 1)), "published versions have a gap"
    missing = sorted(set(range(steps)) - set(batches))
    assert not missing, f"batches never seen sealed: {missing}"
    groups: dict[str, int] = {}
    for step in range(steps):
        batch = msgpack.unpackb(batches[step])
        assert batch["step"] == step, (batch["step"], step)
        for sample in batch["samples"]:
            first = groups.setdefault(sample["group_id"], step)
            assert first == step, f"group {sample['group_id']} served in batches {first} and {step}"
    return {"steps": steps, "groups": len(groups)}


def check_learns(records: list[dict[str, Any]], window: int = 10, margin: float = 0.15) -> dict[str, float]:
    """The train reward of the last `window` steps beats the first `window`'s by `margin`."""
    rewards = [r["reward_mean"] for r in records if r.get("event") == "step"]
    first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
    assert last >= first + margin, f"train reward {first:.3f} over the first {window} steps, {last:.3f} over the last"
    return {"reward_first": round(first, 3), "reward_last": round(last, 3)}
