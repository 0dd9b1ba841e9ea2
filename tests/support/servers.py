"""Start real servers on free ports and wait until they answer.

* `UvicornThread(app).start()` serves an ASGI app from a background thread (its own
  event loop); `.url`, `.stop()`.
* `ServiceProcess([...argv], name=..., ready_url=...)` runs a command in its own process
  group (so `kill -9` drills are real), logs to a file, `.wait_ready()`, `.kill()`,
  `.terminate()`, `.log_tail()`.
* `start_redis(dir)` runs a private `redis-server` (never the machine's 6379).
* `start_sampler_process(...)` / `start_standin(...)` are the usual combinations.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import uvicorn

from services.procs import free_port  # noqa: F401 - tests import it from here


@contextmanager
def refused_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port where every connection is refused while the block runs: bound here and never
    listened on. A port from free_port() that nobody listens on is not that: another test's
    server may take it meanwhile, and answer (a 401 where a refusal was meant)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        yield sock.getsockname()[1]

REPO = Path(__file__).resolve().parents[2]
_ACCESS_LINE = re.compile(r'^INFO: +[0-9.:\[\]a-f]+ - "')


def _listening(session: int, port: int) -> bool:
    """Whether a process of session `session` (a ServiceProcess and whatever it started) holds a
    TCP socket listening on `port`, read from /proc: the server that answered is the one a test
    started, not another test's that took the same free port first (free_port only finds a
    port free at that moment; parallel workers start servers all the time)."""
    inodes = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3]) != session:
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not ours to read
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            # state 0A = LISTEN; local address "HEXIP:HEXPORT"; field 9 the socket's inode.
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port and fields[9] in inodes:
                return True
    return False


def wait_http(url: str, timeout: float, what: str, proc: ServiceProcess | None = None) -> None:
    """Wait until `url` answers (below 500); with `proc`, until `proc`'s own server does."""
    deadline = time.monotonic() + timeout
    last = None
    port = urlsplit(url).port
    while time.monotonic() < deadline:
        if proc is not None and proc.popen.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.popen.returncode} before answering {url}:\n{proc.log_tail()}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                if proc is None or port is None or _listening(proc.pid, port):
                    return
                last = f"port {port} answered, but not from {what} (pid {proc.pid}): another server holds it"
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.05)
    tail = f"\n{proc.log_tail()}" if proc is not None else ""
    raise TimeoutError(f"{what} did not answer {url} within {timeout}s (last error: {last!r}){tail}")


class UvicornThread:
    def __init__(self, app: Any, port: int | None = None, host: str = "127.0.0.1"):
        self.port = port or free_port()
        self.host = host
        # As `tandem sampler` serves (services/sampler/entrypoint.py: longer than clients keep theirs).
        config = uvicorn.Config(app, host=host, port=self.port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=5, timeout_keep_alive=75)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> UvicornThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"server on port {self.port} failed to start (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server on port {self.port} did not start within {timeout}s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


class ServiceProcess:
    def __init__(self, argv: list[str], *, name: str, log_path: Path, env: dict[str, str] | None = None,
                 ready_url: str | None = None):
        self.name = name
        self.log_path = log_path
        self.ready_url = ready_url
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                      cwd=REPO, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait_ready(self, timeout: float = 60.0) -> ServiceProcess:
        if self.ready_url:
            wait_http(self.ready_url, timeout, self.name, self)
        return self

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the log, without uvicorn's access lines (a polling test writes thousands)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        lines = [line for line in text.splitlines() if not _ACCESS_LINE.match(line)]
        return "\n".join(lines)[-chars:]

    def kill(self) -> None:
        """SIGKILL, no cleanup: the crash drill."""
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)
        self._log.close()

    def terminate(self, timeout: float = 20.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        self._log.close()
        return self.popen.returncode


def start_redis(data_dir: Path, port: int | None = None, appendfsync: str = "everysec",
                appendonly: bool = True) -> tuple[ServiceProcess, str]:
    """A private redis-server with AOF on (unless `appendonly` is False), on `port` or a free one."""
    import redis

    from services.sampler.storage.redis_server import redis_binary

    port = port or free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    proc = ServiceProcess(
        [redis_binary(), "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data_dir),
         "--appendonly", "yes" if appendonly else "no", "--appendfsync", appendfsync, "--save", ""],
        name="redis-server", log_path=data_dir / "redis.log",
    )
    deadline = time.monotonic() + 20
    while True:
        try:
            if redis.Redis(port=port, socket_timeout=1).ping():
                break
        except redis.RedisError:
            if time.monotonic() > deadline or proc.popen.poll() is not None:
                raise RuntimeError(f"redis-server did not start:\n{proc.log_tail()}")
            time.sleep(0.02)
    return proc, f"redis://127.0.0.1:{port}/0"


def start_standin(token_latency: float = 0.0, version: str = "0", api_token: str | None = None) -> UvicornThread:
    """The stand-in served from a thread; with `api_token` every route but /health needs it."""
    from services.inference.standin import create_standin_app

    return UvicornThread(create_standin_app(token_latency, version, api_token)).start()


def sampler_argv(port: int, **settings: Any) -> list[str]:
    argv = [sys.executable, "-m", "services.cli", "sampler", "--port", str(port)]
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            argv += [flag, ",".join(map(str, value))]
        else:
            argv += [flag, str(value)]
    return argv


# Run dirs of every sampler process started here: the embedded Redis of each runs in its
# own session and outlives a killed sampler, so the test session kills them at its end.
SAMPLER_RUN_DIRS: set[Path] = set()


def start_sampler_process(run_dir: Path, *, port: int | None = None, process_env: dict[str, str] | None = None,
                          **settings: Any) -> ServiceProcess:
    port = port or free_port()
    SAMPLER_RUN_DIRS.add(Path(run_dir))
    proc = ServiceProcess(
        sampler_argv(port, run_dir=run_dir, **settings), name="sampler",
        log_path=run_dir / "sampler.log", ready_url=f"http://127.0.0.1:{port}/health", env=process_env,
    )
    proc.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return proc.wait_ready()


def kill_embedded_redis(run_dir: Path) -> None:
    """Kill the embedded redis-server a sampler left under `run_dir` (tests clean up after drills)."""
    import json

    info = run_dir / "redis" / "server.json"
    if info.exists():
        try:
            os.kill(json.loads(info.read_text())["pid"], signal.SIGKILL)
        except (ProcessLookupError, ValueError, KeyError):
            pass
