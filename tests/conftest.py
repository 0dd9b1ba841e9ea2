"""Fixtures shared by every test directory: a private Redis and a unique run namespace."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.servers import start_redis


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server of our own on a free port, for the whole session."""
    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    proc.terminate()


@pytest.fixture
def namespace() -> str:
    """A fresh run namespace, so tests sharing the session's Redis never see each other's keys."""
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    return path
