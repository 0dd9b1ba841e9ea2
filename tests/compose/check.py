"""`make compose-check`: docker-compose.yml's CPU stack run for real, end to end.

    python -m tests.compose.check [--steps 100] [--runs 1] [--seed S] [--cache ~/.cache/tandem-compose]

Phases (each timed, then the total):
  engine     the Docker engine `docker` reaches, or a private dockerd (tests/compose/engine.py)
  base       which registry images can be pulled; a local base when they cannot
  images     tandem:cpu built from docker/Dockerfile as the compose file says, and the Redis
             image; local stand-ins for registry images that cannot be pulled (images.py)
  gpu-image  the gpu target's build steps, on tandem:cpu standing in for the vLLM image (which
             cannot be pulled here): the dependency list minus torch/vllm, the package, the CLI
  up         `docker compose --profile cpu up -d`: model-init finishes, redis, inference-cpu and
             sampler-cpu healthy (docker inspect), the trainer running
  exposure   nothing open on the host unless asked: the sampler's port published on 127.0.0.1
             alone (not on this machine's other addresses), the inference server's not at all
             (no binding, `compose port` empty, the port the file used to publish refused)
  endpoints  the run's token at the doors: the sampler answers 401 without it (GET /status,
             GET /batch, the dashboard's login page) and 200 with it, /health and /metrics
             without it; the dashboard's ?token= link logs a browser in; inside the compose
             network the inference server keeps /health open and the rest behind the token
  sampler    the sampler container's process killed mid-run (SIGKILL): its restart policy brings it back, healthy,
             and the published version moves on
  redis      the Redis container's process killed mid-run (AOF, appendfsync always): back by its restart
             policy; every batch sealed before the kill is served byte for byte after it
  finish     the trainer exits 0 after --steps steps: steps 0..N-1 once each, versions 1..N,
             every batch seen sealed and no group in two batches (no batch lost), and the
             train reward rose (the run learns)
  tracking   the stack ran with TANDEM_REPORT_TO=tensorboard: the trainer's TensorBoard scalars on
             the data volume are its trainer_metrics.jsonl, step for step; the sampler's batch
             stats are there too, at the trainer's steps
  down       `docker compose down -v` leaves no container, network or volume of the project

The moments of the two kills are drawn per run (--seed makes them repeatable; the seed is
printed): the sampler is killed once the trainer has published a version drawn from an eighth
to three eighths of --steps, Redis from a half to three quarters. `--runs N` builds the images
once and runs the stack from `up` to `down` N times, stopping at the first failure: the fault
drills' 30-in-a-row is `--runs 30`.

Exit status 0: passed; 1: a check failed; 3: skipped (no engine can run here; says why).
A private dockerd is stopped by its pid at the end whatever happened, and its mounts undone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.compose import images
from tests.compose.engine import Engine, Skip, start
from tests.compose.stack import (BatchRecorder, Stack, check_learns, check_no_batch_lost, host_addresses, refused,
                                 wait_for)
from tests.support.tracking import tensorboard_scalars

SKIPPED = 3
MIN_STEPS = 16  # room for both kills, two versions after each, and a run that learns
REDIS_IMAGE = "redis:7.4-alpine"  # docker-compose.yml's; asserted by tests/compose/test_check.py


class Phases:
    def __init__(self) -> None:
        self.times: list[tuple[str, float]] = []
        self.started = time.monotonic()

    def run(self, name: str, body: Callable[[], Any], show: bool = True) -> Any:
        print(f"[{name}] ...", flush=True)
        began = time.monotonic()
        try:
            result = body()
        finally:
            self.times.append((name, time.monotonic() - began))
        print(f"[{name}] ok in {self.times[-1][1]:.1f} s{': ' + str(result) if result and show else ''}", flush=True)
        return result

    def summary(self) -> str:
        parts = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in self.times)
        return f"{parts}; total {time.monotonic() - self.started:.0f} s"


def wait_healthy(stack: Stack, timeout: float = 240) -> dict[str, str]:
    def ready() -> dict[str, str] | None:
        states = {s: stack.state(s) for s in ("redis", "inference-cpu", "sampler-cpu")}
        init = stack.state("model-init")
        assert not (init["status"] == "exited" and init["exit"] != 0), f"model-init exited {init['exit']}"
        if all(st["health"] == "healthy" for st in states.values()) and init["status"] == "exited":
            return {s: st["health"] for s, st in states.items()} | {"model-init": f"exit {init['exit']}"}
        return None
    return wait_for(ready, timeout, "redis, inference-cpu and sampler-cpu healthy")


def check_exposure(stack: Stack) -> dict[str, Any]:
    """Nothing open on the host unless asked (TANDEM_BIND is unset: the default)."""
    sampler = stack.port_bindings("sampler-cpu")
    assert sampler == {"8100/tcp": [{"HostIp": "127.0.0.1", "HostPort": str(stack.sampler_port)}]}, sampler
    assert not refused("127.0.0.1", stack.sampler_port), "the sampler's published port does not answer on 127.0.0.1"
    elsewhere = host_addresses()
    for address in elsewhere:
        assert refused(address, stack.sampler_port), f"the sampler answers on {address}:{stack.sampler_port}"
    for service in ("inference-cpu", "redis", "trainer-cpu"):
        bound = stack.port_bindings(service)
        assert not bound, f"{service} publishes {bound}"
    port = stack.compose("port", "inference-cpu", "8000", check=False)
    assert not port.stdout.strip(":\n "), f"`compose port inference-cpu 8000` says {port.stdout!r}"
    assert refused("127.0.0.1", stack.old_inference_port), \
        f"something answers on TANDEM_INFERENCE_PORT ({stack.old_inference_port}), which the file no longer publishes"
    return {"sampler": f"127.0.0.1:{stack.sampler_port} only"
            + (f" (refused on {', '.join(elsewhere)})" if elsewhere else " (no other address to try)"),
            "inference-cpu": f"not published (`compose port` {port.stdout.strip()!r}, "
                             f"exit {port.returncode}; {stack.old_inference_port} refused)"}


# Run by the sampler container's Python, inside the compose network: the inference server is
# reached there only. The token is the one compose gave the sampler (TANDEM_API_TOKEN), which
# must be the inference server's too. Prints {path: [status without the token, status with it]}.
INFERENCE_PROBE = """
import json, os, urllib.error, urllib.request
token = os.environ["TANDEM_API_TOKEN"]
def get(path, headers):
    try:
        with urllib.request.urlopen(urllib.request.Request("http://inference-cpu:8000" + path, headers=headers),
                                    timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code
print(json.dumps({p: [get(p, {}), get(p, {"Authorization": "Bearer " + token})]
                  for p in ("/health", "/metrics", "/v1/models", "/is_paused")}))
"""


def check_endpoints(stack: Stack) -> dict[str, Any]:
    """The run's token at the doors: closed without it but for /health and /metrics."""
    seen: dict[str, Any] = {}
    sealed = (stack.status() or {}).get("steps", {}).get("sealed_steps") or [0]
    batch = {"step": sealed[-1], "timeout": 0}
    for path, params, want in (("/status", None, (200,)), ("/batch", batch, (200, 204, 410))):
        without = httpx.get(f"{stack.url}{path}", params=params, timeout=10)
        assert without.status_code == 401, f"GET {path} without the token: {without.status_code} {without.text[:200]}"
        given = httpx.get(f"{stack.url}{path}", params=params, headers=stack.auth, timeout=10)
        assert given.status_code in want, f"GET {path} with the token: {given.status_code} {given.text[:200]}"
        wrong = httpx.get(f"{stack.url}{path}", params=params, headers={"Authorization": "Bearer not-the-token"},
                          timeout=10)
        assert wrong.status_code == 401, f"GET {path} with a wrong token: {wrong.status_code}"
        seen[f"GET {path}"] = f"{without.status_code} without, {given.status_code} with the token"
    for path, marker in (("/health", ""), ("/metrics", "tandem_")):
        open_ = httpx.get(f"{stack.url}{path}", timeout=10)
        assert open_.status_code == 200 and marker in open_.text, (path, open_.status_code, open_.text[:200])
        seen[f"GET {path}"] = f"{open_.status_code} without the token"
    # The dashboard as a person opens it: the login page without the token, then the link
    # the sampler printed, whose token the browser keeps (a cookie) for the pages after it.
    html = {"Accept": "text/html"}
    login = httpx.get(f"{stack.url}/", headers=html, timeout=10)
    assert login.status_code == 401 and "run token" in login.text, (login.status_code, login.text[:200])
    with httpx.Client(timeout=10, headers=html, follow_redirects=True) as browser:
        page = browser.get(f"{stack.url}/", params={"token": stack.token})
        assert page.status_code == 200 and "<html" in page.text.lower(), (page.status_code, page.text[:200])
        assert "token=" not in str(page.url), f"the token stayed in the address bar: {page.url}"
        again = browser.get(f"{stack.url}/status")
        assert again.status_code == 200, f"GET /status with the dashboard's cookie: {again.status_code}"
    seen["dashboard"] = f"{login.status_code} without the token, {len(page.text)} bytes from the ?token= link"
    logged = [line for line in stack.compose("logs", "--no-color", "sampler-cpu", timeout=60).stdout.splitlines()
              if "dashboard: http://" in line]
    assert logged and f"?token={stack.token}" in logged[-1], f"the sampler's log gives no dashboard link: {logged}"
    probe = stack.exec_python("sampler-cpu", INFERENCE_PROBE, timeout=90)
    inside = json.loads(probe.stdout.strip().splitlines()[-1])
    assert inside["/health"] == [200, 200], inside
    for path in ("/metrics", "/v1/models", "/is_paused"):
        assert inside[path] == [401, 200], f"inference-cpu {path} (without, with the token): {inside[path]}"
    seen["inference-cpu (inside the network)"] = inside
    return seen


def kill_and_recover(stack: Stack, service: str, at_version: int, timeout: float = 120,
                     when_back: Callable[[], dict[str, Any]] | None = None,
                     just_before: Callable[[], None] | None = None,
                     known: dict[str, Any] | None = None) -> dict[str, Any]:
    """Crash `service` once the trainer has published `at_version`; wait for the restart policy
    to start it again, healthy, and for the trainer to publish two more versions.

    The crash is SIGKILL to the container's main process (its pid on this host), as the OOM
    killer or a fatal error would end it. `docker kill` would not do: Docker counts it as a
    manual stop and ignores the restart policy (measured on Docker 20.10: status exited,
    RestartCount 0), so the service stays down until `docker compose up -d` or `docker start`.

    Nothing slow stands between the drawn version and the kill: the toy trainer publishes a
    version every ~0.1 s, and a half-second poll, a `docker inspect` (seconds on a loaded
    machine) and batch reads there once let the run end before the kill. So the container's
    state is `known` (read earlier) or read before the wait, the version is polled every 20 ms,
    and `just_before` must be quick (a few requests)."""
    before = known or stack.state(service)
    assert before["pid"] > 0, f"{service} has no process: {before}"
    version = wait_for(lambda: (v := stack.published()) >= at_version and v, 300, f"published version {at_version}",
                       interval=0.02)
    if just_before:
        just_before()
    os.kill(before["pid"], signal.SIGKILL)
    killed = time.monotonic()
    assert version < stack.steps, f"{service} was killed after the run's last version ({version}): not mid-run"
    wait_for(lambda: (st := stack.state(service))["started"] != before["started"] and st["status"] == "running",
             timeout, f"{service} restarted by its restart policy after docker kill")
    # At once, not after the healthcheck's next round (5 s): the trainer resumes as soon as the
    # service answers, and what `when_back` reads may be trimmed a few steps later.
    checked = when_back() if when_back else {}
    wait_for(lambda: stack.state(service)["health"] == "healthy", timeout, f"{service} healthy again")
    back = time.monotonic() - killed
    going_on = min(version + 2, stack.steps)
    wait_for(lambda: stack.published() >= going_on, timeout, f"the run going on after the kill (version {going_on})")
    return {"killed at version": version, "healthy again after s": round(back, 1),
            "restarts": stack.state(service)["restarts"], **checked}


def drill_redis(stack: Stack, recorder: BatchRecorder, at_version: int, known: dict[str, Any]) -> dict[str, Any]:
    """Kill Redis's process; from the moment its container runs again (before the trainer moves on and the
    sampler trims them), every batch sealed before the kill and still kept is served byte for
    byte as it was read before (the AOF, fsynced per write, kept them)."""
    before: dict[int, bytes] = {}

    def snapshot() -> None:
        # The batches sealed now, read now: the newest, those the sampler keeps longest after
        # the kill (the trainer trims 8 behind its version and steps every ~0.1 s once Redis is
        # back). The recorder's copies lag ~0.3 s and were found all trimmed. A few requests.
        sealed = (stack.status() or {}).get("steps", {}).get("sealed_steps") or []
        for step in sealed:
            code, content = recorder.read(step)
            if code == 200:
                before[step] = content

    def compare() -> dict[str, Any]:
        assert before, "no sealed batch could be read just before the kill"
        # Polled from the moment Redis's container runs again: 503 while the sampler has not
        # reconnected, then each batch once: 200 (the same bytes) or 410 (trimmed since, allowed).
        compared, trimmed, left = 0, 0, dict(before)

        def settle() -> bool:
            nonlocal compared, trimmed
            for step, content in sorted(left.items()):
                code, again = recorder.read(step)
                if code == 200:
                    assert again == content, f"batch {step}, read before Redis was killed, differs after"
                    compared += 1
                elif code == 410:
                    trimmed += 1
                else:
                    assert code in (None, 502, 503, 504), f"batch {step} after the Redis kill: HTTP {code}"
                    return False  # Redis or the sampler not back yet
                del left[step]
            return True
        wait_for(settle, 120, "the batches sealed before the Redis kill, read again", interval=0.1)
        assert compared, f"every batch sealed before the kill was trimmed before it could be compared: {sorted(before)}"
        return {"batches compared byte for byte": f"{compared} of {len(before)} ({trimmed} trimmed since)"}

    return kill_and_recover(stack, "redis", at_version, when_back=compare, just_before=snapshot, known=known)


def finish(stack: Stack, recorder: BatchRecorder, timeout: float) -> dict[str, Any]:
    state = wait_for(lambda: (st := stack.state("trainer-cpu"))["status"] == "exited" and st, timeout,
                     f"the trainer finishing {stack.steps} steps")
    assert state["exit"] == 0, f"the trainer exited {state['exit']}\n{stack.logs()}"
    recorder.stopped.set()
    recorder.join(10)
    records = stack.trainer_metrics()
    summary = check_no_batch_lost(stack.steps, records, recorder.batches)
    assert stack.published() == stack.steps, f"published version {stack.published()}, not {stack.steps}"
    return summary | check_learns(records) | {"trainer restarts": state["restarts"]}


def check_tracking(stack: Stack) -> dict[str, Any]:
    """What the services reported to TensorBoard (TANDEM_REPORT_TO=tensorboard, set by Stack),
    copied off the data volume and read with TensorBoard's own reader."""

    records = [r for r in stack.trainer_metrics() if r.get("event") == "step"]
    with tempfile.TemporaryDirectory(prefix="tandem-compose-tb-") as tmp:
        def copied() -> dict[str, Any] | None:
            # The sampler still runs: its writer flushes every few seconds, so wait for its points.
            stack.engine.docker("cp", f"{stack.container('sampler-cpu')}:/data/tensorboard", tmp)
            got = {side: tensorboard_scalars(Path(tmp) / "tensorboard" / side) for side in ("trainer", "sampler")}
            return got if got["sampler"] else None
        got = wait_for(copied, 60, "the sampler's TensorBoard points on the data volume")
    trainer, sampler = got["trainer"], got["sampler"]
    loss = dict(trainer.get("loss", []))
    want = {r["step"]: r["loss"] for r in records if isinstance(r.get("loss"), (int, float))}
    assert loss.keys() == want.keys(), f"TensorBoard loss steps {sorted(loss)} != trainer steps {sorted(want)}"
    assert all(abs(loss[k] - want[k]) <= 1e-5 * max(1.0, abs(want[k])) for k in want), "loss values differ"
    reward_steps = sorted(step for step, _ in sampler.get("reward_mean", []))
    assert reward_steps and reward_steps[-1] >= stack.steps // 2, f"sampler reward_mean steps {reward_steps}"
    return {"trainer tags": len(trainer), "sampler tags": len(sampler), "loss points": len(loss)}


def down(stack: Stack) -> dict[str, Any]:
    stack.compose("down", "-v", "--remove-orphans", timeout=180)
    left = stack.leftovers()
    assert not any(left.values()), f"left behind by down -v: {left}"
    return {"left behind": "nothing"}


def kill_moments(rng: random.Random, steps: int) -> dict[str, int]:
    """The published versions at which the sampler and Redis are killed: the sampler from an
    eighth to three eighths of the run, Redis from a half to three quarters, so the two drills
    do not overlap and each recovery has steps left to show the run going on."""
    assert steps >= MIN_STEPS, f"--steps {steps}: the drills need at least {MIN_STEPS}"
    return {"sampler": rng.randint(steps // 8, 3 * steps // 8), "redis": rng.randint(steps // 2, 3 * steps // 4)}


def run_stack(stack: Stack, phases: Phases, kill_at: dict[str, int]) -> None:
    """One run of the stack, `up` to `down`; a failed check raises, and the caller takes the stack down."""
    print(f"  kills at versions: {kill_at}", flush=True)
    stack.compose("down", "-v", "--remove-orphans", timeout=180)  # a previous run's leftovers
    recorder = BatchRecorder(stack.url, stack.token)

    def up() -> dict[str, str]:
        stack.compose("up", "-d", "--no-build", timeout=600)
        recorder.start()
        return wait_healthy(stack)
    phases.run("up", up)
    redis = stack.state("redis")  # its pid and start, read now: stable until its kill, and slow to read
    phases.run("exposure", lambda: check_exposure(stack))
    phases.run("endpoints", lambda: check_endpoints(stack))
    phases.run("sampler", lambda: kill_and_recover(stack, "sampler-cpu", at_version=kill_at["sampler"]))
    phases.run("redis", lambda: drill_redis(stack, recorder, at_version=kill_at["redis"], known=redis))
    phases.run("finish", lambda: finish(stack, recorder, timeout=600))
    phases.run("tracking", lambda: check_tracking(stack))
    phases.run("down", lambda: down(stack))
    print(f"  {phases.summary()}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="trainer steps (TANDEM_MAX_STEPS)")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "tandem-compose",
                        help="debootstrap rootfs and the private daemon's data root (images, build cache)")
    parser.add_argument("--runs", type=int, default=1,
                        help="run the stack from up to down this many times (images built once), stopping at a failure")
    parser.add_argument("--seed", type=int, default=None, help="draws the kill moments (default: a random seed, printed)")
    parser.add_argument("--no-gpu-steps", dest="gpu_steps", action="store_false",
                        help="skip building the gpu target's steps on the CPU image")
    args = parser.parse_args(argv)
    if args.steps < MIN_STEPS or args.runs < 1:
        parser.error(f"--steps must be at least {MIN_STEPS} and --runs at least 1")
    args.cache.mkdir(parents=True, exist_ok=True)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    print(f"seed {seed}: the kill moments are drawn from it", flush=True)
    phases = Phases()
    engine: Engine | None = None
    stack: Stack | None = None
    try:
        try:
            engine = phases.run("engine", lambda: start(args.cache), show=False)
        except Skip as why:
            print(f"SKIPPED: {why}")
            return SKIPPED
        print(f"  {'private dockerd, pid ' + str(engine.proc.pid) if engine.private else 'the reachable engine'}")
        try:
            builder = phases.run("base", lambda: images.Builder(engine, args.cache), show=False)
        except Skip as why:
            print(f"SKIPPED: {why}")
            return SKIPPED
        try:
            phases.run("images", lambda: images.build_ours(builder)
                       + [f"{REDIS_IMAGE}: {images.ensure_redis(engine, REDIS_IMAGE, args.cache)}"])
            if args.gpu_steps:
                phases.run("gpu-image", lambda: images.build_gpu_steps(builder))
        finally:
            builder.close()
        for run in range(1, args.runs + 1):
            if args.runs > 1:
                print(f"== run {run} of {args.runs}", flush=True)
            stack = Stack(engine, args.steps)
            if run > 1:
                phases = Phases()
            run_stack(stack, phases, kill_moments(rng, args.steps))
            stack = None
            print(f"== {run} run{'s' if run > 1 else ''} in a row passed", flush=True)
        print(f"PASSED: {args.runs} run{'s' if args.runs > 1 else ''} in a row (seed {seed}); last: {phases.summary()}")
        return 0
    except (AssertionError, RuntimeError) as failure:
        print(f"FAILED (seed {seed}): {failure}")
        if stack is not None:
            print(stack.logs())
        print(phases.summary())
        return 1
    finally:
        # Each step on its own, so that an interrupted `down` still stops the daemon.
        try:
            if stack is not None:
                stack.compose("down", "-v", "--remove-orphans", timeout=180, check=False)
        finally:
            if engine is not None and engine.private:
                engine.stop()
                print("private dockerd stopped")


if __name__ == "__main__":
    sys.exit(main())
