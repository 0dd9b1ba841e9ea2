"""The demo's forked children (services/demo/forking.py), in a fresh interpreter as the demo
runs them: torch and transformers imported once, then `services.cli` commands forked from it.

* The interpreter that preloaded is single-threaded (forking is safe) and its children run
  the real commands: a refused setting exits 2 with its message in the child's log; the CPU
  inference server answers /health and a completion from the fork, SIGTERM stops it after
  its graceful shutdown, and the log's first line says it was forked.
* A second thread makes `single_threaded` say no, which is when the demo starts its children
  as fresh interpreters instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from services.demo.forking import single_threaded
from tests.support.servers import REPO, free_port

SCRIPT = r"""
import json, os, sys, time
from pathlib import Path
import httpx
from services.demo.forking import ForkedChild, limit_threads, preload
model, logs, port = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
limit_threads(1)
single = preload(model, 1)
env = {**os.environ, "TANDEM_API_TOKEN": "t", "PYTHONUNBUFFERED": "1"}
cli = [sys.executable, "-m", "services.cli"]
bad = ForkedChild("bad", cli + ["trainer", "--no-such-flag", "1"], logs / "bad.log", env)
bad_code = bad.wait_stopped(60)
srv = ForkedChild("inference", cli + ["inference", "--model", str(model), "--port", str(port),
                  "--served-model-name", "tiny", "--torch-threads", "1"], logs / "inference.log", env)
url, deadline, answer = f"http://127.0.0.1:{port}", time.monotonic() + 60, None
while time.monotonic() < deadline and srv.returncode is None:
    try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
            answer = httpx.post(url + "/v1/completions", headers={"Authorization": "Bearer t"}, timeout=30,
                                json={"model": "tiny", "prompt": "hi", "max_tokens": 3}).status_code
            break
    except httpx.HTTPError:
        time.sleep(0.1)
srv.terminate()
print(json.dumps({"single": single, "bad": bad_code, "answer": answer, "srv": srv.wait_stopped(30),
                  "pids": [os.getpid(), bad.pid, srv.pid]}))
"""


def test_children_forked_after_the_preload_run_the_real_commands(tiny_model: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model), str(tmp_path), str(free_port())],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["single"] is True, "after the preload the demo has one thread: forking is safe"
    assert len(set(result["pids"])) == 3
    assert result["bad"] == 2
    bad_log = (tmp_path / "bad.log").read_text()
    assert bad_log.startswith("$ ") and "(forked from the demo" in bad_log.splitlines()[0]
    assert "no-such-flag" in bad_log
    assert result["answer"] == 200, (tmp_path / "inference.log").read_text()[-2000:]
    # uvicorn shuts down, then re-raises the SIGTERM it caught, as in a fresh interpreter.
    assert result["srv"] in (0, -15), (tmp_path / "inference.log").read_text()[-2000:]
    assert "Finished server process" in (tmp_path / "inference.log").read_text()


def test_a_second_thread_means_no_forking() -> None:
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        assert single_threaded() is False
    finally:
        stop.set()
        other.join(5)
