"""Fixtures for the reliability drills (faults, restarts, bad input, replicas, shutdown)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.reliability.support import Cleanup


@pytest.fixture
def cleanup() -> Iterator[Cleanup]:
    """Register how to stop what a drill starts; runs even when the drill fails."""
    registry = Cleanup()
    yield registry
    registry.run()


