"""tests/support/servers.ServiceProcess: a service is ready when its own server answers, not
when something else does on its port (another test's server that took the free port first)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from starlette.applications import Starlette

from tests.support.servers import ServiceProcess, UvicornThread


def test_a_foreign_server_on_the_port_is_not_taken_for_the_service(tmp_path: Path) -> None:
    foreign = UvicornThread(Starlette()).start()  # answers 404 to anything: "answered" (< 500)
    try:
        # The "service" wants the foreign server's port: it cannot bind it and exits, and
        # wait_ready says so, though the port answered from the first poll on.
        argv = [sys.executable, "-m", "http.server", str(foreign.port), "--bind", "127.0.0.1"]
        proc = ServiceProcess(argv, name="service", log_path=tmp_path / "service.log",
                              ready_url=f"http://127.0.0.1:{foreign.port}/")
        with pytest.raises(RuntimeError, match="service exited"):
            proc.wait_ready(timeout=20)
    finally:
        foreign.stop()


def test_the_service_is_ready_once_it_answers_itself(tmp_path: Path) -> None:
    from services.procs import free_port

    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    proc = ServiceProcess(argv, name="service", log_path=tmp_path / "service.log",
                          ready_url=f"http://127.0.0.1:{port}/")
    try:
        assert proc.wait_ready(timeout=20) is proc
    finally:
        proc.terminate()
