"""Fixtures for the inference tests: a tiny model written by init-model, and real CPU
inference servers (uvicorn on a free port, in-process) started with the public helper."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.inference.testing import ServerHandle, start_server


@pytest.fixture(scope="session")
def server(tiny_model: Path) -> Iterator[ServerHandle]:
    """Shared by the read-only tests; tests that pause, reload or relabel use `fresh_server`."""
    handle = start_server(tiny_model, served_model_name="tiny")
    yield handle
    handle.stop()


@pytest.fixture
def fresh_server(tiny_model: Path) -> Iterator[ServerHandle]:
    handle = start_server(tiny_model, served_model_name="tiny")
    yield handle
    handle.stop()
