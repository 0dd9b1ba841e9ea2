"""Process and port helpers shared by the services (no heavy imports)."""

from __future__ import annotations

import os
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the caller binds it right away)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def local_url(host: str, port: int) -> str:
    """http://HOST:PORT as a process on this machine reaches a server that listens on `host`: a
    wildcard address (0.0.0.0, ::, "") as loopback, an IPv6 literal in brackets."""
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie; reaps it if it is our own exited child."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        pass  # not our child: ask the kernel for its state
    try:
        with open(f"/proc/{pid}/stat") as fh:
            # The state letter follows the parenthesised command name.
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
