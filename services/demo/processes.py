"""Child processes of the demo: start, watch, stop — always by the child's own pid.

Each child runs in its own session (`start_new_session`), so a Ctrl-C in the terminal
reaches only the demo, which then stops the children in order instead of every process
getting SIGINT at once. A child's stdout and stderr go to `run_dir/logs/<name>.log`.
Stopping is SIGTERM to the child's pid, a wait of `timeout` seconds, then SIGKILL to the
same pid: no process is ever looked up by name or pattern.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from services.procs import free_port, pid_alive  # noqa: F401 - re-exported for the demo


def pid_command(pid: int) -> str:
    """The command line of `pid` ('' if unknown), to check a recorded pid was not reused."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def stop_pid(pid: int, timeout: float, expect: str = "") -> bool:
    """SIGTERM `pid`, wait up to `timeout` s, then SIGKILL it. For processes that are not our
    children (the sampler's redis-server): `expect` must occur in its command line, so a pid
    recycled by an unrelated process is left alone. Returns True if it had to be signalled."""
    if not pid_alive(pid) or (expect and expect not in pid_command(pid)):
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if pid_alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return True


class Child:
    """One service process: `tandem <command> ...` with its log file."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str], cwd: Path | None = None):
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 -- open for the child's lifetime
        self._log.write(f"$ {' '.join(self.argv)}\n".encode())
        self._log.flush()
        self.popen = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env=env, cwd=cwd, start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.rstrip("\n").splitlines()[-lines:])

    def terminate(self) -> None:
        """Ask the child to stop (SIGTERM to its pid); does not wait."""
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def wait_stopped(self, timeout: float) -> int:
        """Wait up to `timeout` s for the exit, then SIGKILL the pid; returns the exit code."""
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)
        self._log.close()
        return self.popen.returncode

    def stop(self, timeout: float) -> int:
        self.terminate()
        return self.wait_stopped(timeout)


class ChildDied(RuntimeError):
    """A child exited while the demo still needed it."""

    def __init__(self, child: Child):
        self.child = child
        code = child.returncode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
        super().__init__(
            f"{child.name} (pid {child.pid}) {how} before the demo finished. "
            f"Last lines of {child.log_path}:\n{child.log_tail()}"
        )


def wait_healthy(url: str, child: Child, timeout: float, check: Callable[[], None] | None = None) -> None:
    """Poll `url` until it answers 2xx; raise ChildDied if the child exits first and
    TimeoutError (naming what it waited for) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: object = None
    # One client for the whole wait: `httpx.get` builds a client, and with it an SSL context, per
    # call (20-40 ms of CPU), which at ten polls a second took a third of a core from the very
    # start-up it waits for.
    with httpx.Client(timeout=2.0) as client:
        while True:
            if child.returncode is not None:
                raise ChildDied(child)
            if check is not None:
                check()
            try:
                response = client.get(url)
                if response.status_code < 300:
                    return
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                last = exc
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{child.name} (pid {child.pid}) did not answer {url} within {timeout:.0f}s "
                    f"(last: {last!r}); last lines of {child.log_path}:\n{child.log_tail()}"
                )
            time.sleep(0.1)

