"""Fixtures shared by every test directory: a private Redis, a unique run namespace,
a vLLM-protocol stand-in and an in-process sampler on free ports."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.sampler.app import create_app
from services.sampler.config import SamplerSettings
from tests.support.servers import (
    SAMPLER_RUN_DIRS, UvicornThread, free_port, kill_embedded_redis, start_redis, start_standin,
)


@pytest.fixture(scope="session", autouse=True)
def _no_redis_left_behind() -> Iterator[None]:
    """Kill the embedded redis-servers that sampler processes started during the session."""
    yield
    for run_dir in SAMPLER_RUN_DIRS:
        kill_embedded_redis(run_dir)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server of our own on a free port, for the whole session."""
    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    proc.terminate()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model from init-model (preset tiny, seed 0), built once per test process."""
    from services.inference.init_model import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny", seed=0)


@pytest.fixture
def namespace() -> str:
    """A fresh run namespace, so tests sharing the session's Redis never see each other's keys."""
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    return path


@pytest.fixture
def standin() -> Iterator[UvicornThread]:
    server = start_standin(token_latency=0.0)
    yield server
    server.stop()


@pytest.fixture
def two_standins() -> Iterator[list[UvicornThread]]:
    """Two stand-ins that take 5 ms a token: requests overlap, so balance and hand-over show."""
    servers = [start_standin(token_latency=0.005), start_standin(token_latency=0.005)]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
def make_sampler(redis_url: str, namespace: str, run_dir: Path, standin: UvicornThread
                 ) -> Iterator[Callable[..., UvicornThread]]:
    """make_sampler(**settings) -> a running sampler (UvicornThread) using the stand-in."""
    started: list[UvicornThread] = []

    def make(**overrides: Any) -> UvicornThread:
        values: dict[str, Any] = {
            "redis_url": redis_url, "namespace": namespace, "run_dir": run_dir,
            "inference_urls": [standin.url], "env": "tests.support.envs:CountEnv",
            "prompts_per_step": 4, "num_generations": 4, "max_tokens": 8,
        }
        values.update(overrides)
        # The sampler knows its own port: a verifiers environment calls back into it.
        values.setdefault("port", free_port())
        settings = SamplerSettings(**values)
        server = UvicornThread(create_app(settings), port=settings.port).start()
        server.settings = settings  # type: ignore[attr-defined]
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()



def _on_vllm(nodeid: str) -> bool:
    return nodeid.startswith("tests/vllm/")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The real-vLLM tier first (a stable sort: otherwise the collection order). Under `make
    test`'s two workers its ~4 minutes then overlap the other worker's work instead of being a
    tail one worker runs alone at the end."""
    items.sort(key=lambda item: not _on_vllm(item.nodeid))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`make test` runs `pytest -n 2`: tests are handed to whichever worker is free, except the
    real-vLLM tier, which goes to one worker as a whole, so the session's one vLLM server
    (tests/vllm/conftest.py) is started once, not once per worker. (xdist's own `loadgroup`
    would say this with marks, but in xdist 3.8 it renames items through an attribute pytest
    9.2 no longer reads, and silently does nothing.)"""
    from xdist.scheduler import LoadScopeScheduling

    class VllmOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "tests/vllm" if _on_vllm(nodeid) else nodeid

    return VllmOnOneWorker(config, log)
