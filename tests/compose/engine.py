"""A Docker engine for the compose check: the one `docker` already reaches, or a private dockerd.

The private daemon has its own data root (under the cache directory, kept between runs so
that images and build layers are reused), its own exec root, socket and pid file (in a
fresh temporary directory), and no networking of the host's: `--iptables=false
--bridge=none`. Compose's own bridge network, service-name DNS and published ports (the
userland proxy) work without iptables; builds run with `--network host` instead, since a
bridge without NAT reaches nothing outside.

`stop()` ends the daemon by the pid it was started with (never by name) and lazily unmounts
whatever it left mounted under its directories (overlay layers, netns files, shm).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


class Skip(Exception):
    """The check cannot run on this machine; the message says why."""


def _reachable(env: dict[str, str]) -> bool:
    try:
        return subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _mounts_under(*roots: Path) -> list[str]:
    points = []
    for line in Path("/proc/mounts").read_text().splitlines():
        point = line.split()[1].replace("\\040", " ")
        if any(point == str(r) or point.startswith(str(r) + "/") for r in roots):
            points.append(point)
    return points


@dataclass
class Engine:
    env: dict[str, str]                       # the environment docker and docker-compose run with
    private: bool = False
    proc: subprocess.Popen | None = None
    dirs: list[Path] = field(default_factory=list)
    log: Path | None = None

    def docker(self, *args: str, check: bool = True, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        result = subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True,
                                timeout=timeout, **kw)
        if check and result.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)}: exit {result.returncode}\n{result.stderr[-3000:]}")
        return result

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # dockerd stops its containers and containerd
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
        for point in sorted(_mounts_under(*self.dirs), key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)
        left = _mounts_under(*self.dirs)
        if left:
            print(f"warning: still mounted after the daemon stopped: {left}")
        for d in self.dirs[1:]:  # the first is the data root, kept for its image cache
            shutil.rmtree(d, ignore_errors=True)


def start(cache: Path) -> Engine:
    """The engine `docker` reaches already, or a private dockerd; raises Skip saying why not."""
    for tool in ("docker", "docker-compose"):
        if shutil.which(tool) is None and not (tool == "docker-compose" and _compose_v2()):
            raise Skip(f"`{tool}` is not installed (as root: apt-get install docker.io docker-compose)")
    # The classic builder: `--network host` and build args as environment variables of RUN
    # steps, with no buildx plugin needed (Debian's docker.io has none).
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}
    if _reachable(env):
        return Engine(env=env)
    if shutil.which("dockerd") is None:
        raise Skip("no Docker engine is reachable and dockerd is not installed (apt-get install docker.io)")
    if os.geteuid() != 0:
        raise Skip("no Docker engine is reachable and a private dockerd needs root")
    data_root = cache / "docker"
    data_root.mkdir(parents=True, exist_ok=True)
    # Short paths: containerd's shim sockets live under the exec root, and unix socket paths
    # are limited to 108 bytes.
    run_dir = Path(tempfile.mkdtemp(prefix="tcc-", dir="/tmp"))
    sock, log = run_dir / "docker.sock", cache / "dockerd.log"
    proc = subprocess.Popen(
        ["dockerd", "--data-root", str(data_root), "--exec-root", str(run_dir / "x"),
         "--host", f"unix://{sock}", "--pidfile", str(run_dir / "dockerd.pid"),
         "--iptables=false", "--ip-masq=false", "--bridge=none"],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    engine = Engine(env={**env, "DOCKER_HOST": f"unix://{sock}"}, private=True, proc=proc,
                    dirs=[data_root, run_dir], log=log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            engine.stop()
            raise Skip(f"dockerd exited with status {proc.returncode}; its log: {log}\n"
                       + log.read_text()[-2000:])
        if sock.exists() and _reachable(engine.env):
            return engine
        time.sleep(0.5)
    engine.stop()
    raise Skip(f"dockerd did not answer within 60 s; its log: {log}")


def _compose_v2() -> bool:
    try:
        return subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def compose_command() -> list[str]:
    """`docker compose` (v2) when installed, else Debian's `docker-compose` (1.29)."""
    return ["docker", "compose"] if _compose_v2() else ["docker-compose"]
