"""Fixtures for the reliability drills (faults, restarts, bad input, replicas, shutdown)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.support import Cleanup


@pytest.fixture
def cleanup() -> Iterator[Cleanup]:
    """Register how to stop what a drill starts; runs even when the drill fails."""
    registry = Cleanup()
    yield registry
    registry.run()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.inference.init_model import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny", seed=0)
