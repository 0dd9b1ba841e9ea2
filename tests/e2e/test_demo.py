"""`tandem demo` end to end: real processes (demo, inference, sampler, embedded Redis,
trainer), a few steps of the toy task.

* A short run: while it trains, an observer long-polls the sampler's `GET /batch` for
  every step (reading never pops, so the trainer is unaffected) and watches the
  inference server's `GET /weight_info`. Checked: every sample of batch N has
  `policy_version` in [N - k, N]; the trainer published versions 1..N in order and the
  served version never went backwards and ends at N; the summary holds an eval result;
  every recorded child pid, the embedded redis-server included, is gone afterwards.
* A child killed with SIGKILL makes the demo exit 1 with that child's log tail.
* SIGTERM to the demo stops every child and exits 128 + 15.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from services.demo.processes import pid_alive
from shared.token_guard import bearer_headers
from tests.support.servers import REPO, free_port

STEPS = 6
K = 1
# The run's token, given to the demo as a user would (TANDEM_API_TOKEN) so that the observer
# can read the sampler and the inference server, which both need it (every route but /health).
TOKEN = "demo-test-token"


def start_demo(run_dir: Path, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["TANDEM_API_TOKEN"] = TOKEN
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "demo", "--run-dir", str(run_dir), *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: the demo then stops its own children (a SIGKILL would orphan them, still
        # training, into the next tests); SIGKILL only if it does not exit in time.
        proc.terminate()  # our own child, by its Popen handle
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"tandem demo did not exit within {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
    return proc.returncode, out, err


def wait_for_processes(run_dir: Path, proc: subprocess.Popen, names: set[str], timeout: float) -> dict[str, int]:
    """The pids from run_dir/processes.json once it names all of `names`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"demo exited with {proc.returncode} while waiting for {sorted(names)}:\n"
                        f"{proc.stdout.read()}\n{proc.stderr.read()}")
        try:
            children = json.loads((run_dir / "processes.json").read_text())["children"]
            if names <= set(children):
                return {name: int(info["pid"]) for name, info in children.items()}
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    pytest.fail(f"run_dir/processes.json did not list {sorted(names)} within {timeout}s")


def wait_for_steps(run_dir: Path, proc: subprocess.Popen, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"demo exited early with {proc.returncode}"
        try:
            lines = (run_dir / "trainer_metrics.jsonl").read_text().splitlines()
            if sum('"event": "step"' in line for line in lines) >= n:
                return
        except OSError:
            pass
        time.sleep(0.1)
    pytest.fail(f"the trainer did not log {n} steps within {timeout}s")


def assert_all_gone(pids: dict[str, int], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids.values()):
        time.sleep(0.05)
    left = {name: pid for name, pid in pids.items() if pid_alive(pid)}
    assert not left, f"processes left behind: {left}"


class Observer(threading.Thread):
    """Reads every batch from the sampler and the served weight version as the demo runs."""

    def __init__(self, sampler_url: str, inference_url: str, steps: int, proc: subprocess.Popen):
        super().__init__(daemon=True)
        self.sampler_url, self.inference_url, self.steps, self.proc = sampler_url, inference_url, steps, proc
        self.batches: dict[int, dict] = {}
        self.served: list[int] = []
        self.error: str | None = None

    def _served_version(self, client: httpx.Client) -> None:
        try:
            response = client.get(f"{self.inference_url}/weight_info", timeout=2)
            if response.status_code == 200:
                self.served.append(int(response.json()["weight_version"]))
        except (httpx.HTTPError, ValueError, KeyError):
            pass

    def run(self) -> None:
        deadline = time.monotonic() + 100
        with httpx.Client(headers=bearer_headers(TOKEN)) as client:
            step = 0
            while step < self.steps and time.monotonic() < deadline and self.proc.poll() is None:
                self._served_version(client)
                try:
                    response = client.get(f"{self.sampler_url}/batch", params={"step": step, "timeout": 0.5},
                                          timeout=5)
                except httpx.HTTPError:
                    time.sleep(0.2)  # the sampler is still starting
                    continue
                if response.status_code == 200:
                    self.batches[step] = response.json()
                    step += 1
                elif response.status_code not in (204, 409):
                    self.error = f"GET /batch?step={step}: {response.status_code} {response.text[:300]}"
                    return
            # Keep watching the served version until the demo stops the server.
            while self.proc.poll() is None and time.monotonic() < deadline:
                self._served_version(client)
                time.sleep(0.1)


@pytest.mark.parametrize("trainer", [
    "native",
    pytest.param("trl", marks=[pytest.mark.slow,  # ~35 s; tests/trl trains through the bridge in `make test`
                               pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                                                  reason="needs the trl extra: pip install -e '.[trl]'")]),
])
def test_demo_trains_within_the_staleness_bound_and_leaves_nothing_running(tmp_path: Path, trainer: str) -> None:
    """With either trainer: the native one, or TRL's GRPOTrainer fed by the sampler (its metrics and
    summary under run_dir/trl, in the native trainer's format)."""
    run_dir = tmp_path / "demo"
    sampler_port, inference_port = free_port(), free_port()
    proc = start_demo(run_dir, "--trainer", trainer, "--steps", str(STEPS), "--max-staleness", str(K), "--seed", "3",
                      "--port", str(sampler_port), "--inference-port", str(inference_port),
                      "--eval-every", "3", "--eval-examples", "16", "--prompts-per-step", "4",
                      "--num-generations", "4", "--micro-batch-size", "8")
    observer = Observer(f"http://127.0.0.1:{sampler_port}", f"http://127.0.0.1:{inference_port}", STEPS, proc)
    observer.start()
    code, out, err = finish(proc, 110)
    observer.join(10)
    assert code == 0, f"demo failed ({code})\nstdout:\n{out}\nstderr:\n{err}"

    # Every sample of batch N was generated by weights of version N-k..N.
    assert observer.error is None, observer.error
    assert sorted(observer.batches) == list(range(STEPS)), f"observer saw batches {sorted(observer.batches)}"
    for step, batch in observer.batches.items():
        assert batch["step"] == step
        assert len(batch["samples"]) == 16
        versions = {s["policy_version"] for s in batch["samples"]}
        assert all(max(0, step - K) <= v <= step for v in versions), (step, versions)

    # Versions only move forward: published 1..N in order, served never backwards, ending at N.
    trainer_dir = run_dir if trainer == "native" else run_dir / "trl"
    records = [json.loads(line) for line in (trainer_dir / "trainer_metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    assert [r["version"] for r in steps] == list(range(1, STEPS + 1))
    assert all(r["staleness_max"] <= K for r in steps)
    assert observer.served and observer.served == sorted(observer.served), observer.served

    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("steps", "wall_seconds", "eval_reward_before", "eval_reward_after", "staleness_mean",
                "trainer_wait_fraction"):
        assert key in summary, key
    assert summary["steps"] == STEPS and summary["trainer"] == trainer
    assert summary["inference_weight_version"] == str(STEPS)  # the last checkpoint reached inference
    assert observer.served[-1] == STEPS
    assert isinstance(summary["eval_reward_before"], float) and isinstance(summary["eval_reward_after"], float)
    assert 0.0 <= summary["staleness_mean"] <= K and 0.0 <= summary["trainer_wait_fraction"] <= 1.0
    assert summary["dashboard_url"] == f"http://127.0.0.1:{sampler_port}/"
    # The dashboard's address is printed with the token (the page keeps it in a cookie).
    assert f"dashboard: http://127.0.0.1:{sampler_port}/?token={TOKEN}" in out and "eval reward" in out

    # Clean shutdown: every child exited by itself on SIGTERM, nothing is left running.
    pids = {**summary["pids"]}
    assert set(pids) == {"inference", "sampler", "trainer", "redis-server"}
    # uvicorn re-raises SIGTERM after its graceful shutdown, so -15 is a clean exit; -9 is not.
    assert summary["exit_codes"]["trainer"] == 0
    assert summary["exit_codes"]["sampler"] in (0, -signal.SIGTERM), summary["exit_codes"]
    assert summary["exit_codes"]["inference"] in (0, -signal.SIGTERM), summary["exit_codes"]
    assert summary["processes_left"] == {}
    assert_all_gone(pids)
    for name in ("inference", "sampler", "trainer"):
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0


@pytest.mark.slow  # ~35 s: a whole demo; the native demo test stays in `make test`
def test_a_dying_child_stops_the_demo_with_its_log_tail(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo"
    proc = start_demo(run_dir, "--steps", "500", "--eval-every", "0", "--no-progress")
    pids = wait_for_processes(run_dir, proc, {"inference", "sampler", "trainer", "redis-server"}, 60)
    wait_for_steps(run_dir, proc, 1, 60)
    os.kill(pids["inference"], signal.SIGKILL)
    code, out, err = finish(proc, 45)
    assert code == 1, f"stdout:\n{out}\nstderr:\n{err}"
    assert f"inference (pid {pids['inference']}) was killed by signal 9" in err
    # The tail of the child's own log: uvicorn's access lines for the sampler's requests.
    assert "logs/inference.log" in err and "HTTP/1.1\" 200 OK" in err
    assert not (run_dir / "summary.json").exists()
    assert_all_gone(pids)


@pytest.mark.slow  # ~35 s: a whole demo; the native demo test stays in `make test`
def test_sigterm_stops_every_child(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo"
    proc = start_demo(run_dir, "--steps", "500", "--eval-every", "0", "--no-progress")
    # As soon as every child exists (the trainer may still be importing torch).
    pids = wait_for_processes(run_dir, proc, {"inference", "sampler", "trainer", "redis-server"}, 60)
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc, 45)
    assert code == 128 + signal.SIGTERM, f"stdout:\n{out}\nstderr:\n{err}"
    assert "interrupted by SIGTERM" in err
    assert_all_gone(pids)


def test_refuses_a_run_dir_it_did_not_create(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    code, _, err = finish(start_demo(tmp_path, "--steps", "1"), 60)
    assert code == 1 and "was not created by `tandem demo`" in err
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_bad_settings_exit_2_naming_the_fix(tmp_path: Path) -> None:
    code, _, err = finish(start_demo(tmp_path / "d", "--prompts-per-step", "3", "--num-generations", "3",
                                     "--micro-batch-size", "2"), 60)
    assert code == 2 and "micro_batch_size 2 does not divide the batch" in err
    code, _, err = finish(start_demo(tmp_path / "d", "--preset", "huge"), 60)
    assert code == 2 and "unknown preset 'huge'" in err
