"""Fixtures for multi-turn rollouts: a real CPU inference server of the tiny model, the
stand-in (scripted replies, byte tokens), and `Rollouts` wired to them without a sampler app."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from services.inference.testing import ServerHandle, running_server
from services.sampler.rollouts.envs.base import Environment
from services.sampler.fleet.inference_pool import OK, InferencePool
from services.sampler.rollouts.multiturn.stats import EnvStats
from services.sampler.rollouts.multiturn.workers import Workers
from services.sampler.rollouts.rollout import Rollouts
from shared.http_client import HttpClient


@pytest.fixture(scope="session")
def cpu_server(tiny_model: Path) -> Iterator[ServerHandle]:
    with running_server(tiny_model, served_model_name="tiny") as handle:
        yield handle


def server_root(url: str) -> str:
    """A server's root URL (ServerHandle.base_url ends in /v1)."""
    return url.removesuffix("/v1")


@pytest_asyncio.fixture
async def make_rollouts() -> AsyncIterator[Callable[..., Rollouts]]:
    """make_rollouts(env, urls, **kw) -> Rollouts over an InferencePool whose servers are in
    rotation at version 0 (what the fleet would do after its first check)."""
    clients: list[HttpClient] = []
    workers: list[Workers] = []

    def make(env: Environment, urls: list[str], *, temperature: float = 1.0, env_timeout: float = 10.0,
             env_retries: int = 2, retries: int = 2, **sampling: Any) -> Rollouts:
        http = HttpClient(max_connections=32, timeout=30)
        clients.append(http)
        pool = InferencePool([server_root(u) for u in urls], max_concurrency=16, request_timeout=30,
                             retries=retries, http=http)
        for server in pool.servers:
            server.state, server.version = OK, 0
        pool_workers = Workers(2)
        workers.append(pool_workers)
        return Rollouts(env, pool, prompts_per_step=1, num_generations=4,
                        sampling={"temperature": temperature, **sampling}, seed=0, advantage="grpo",
                        model_name=None, workers=pool_workers, env_stats=EnvStats(), env_timeout=env_timeout,
                        env_retries=env_retries)

    yield make
    for http in clients:
        await http.aclose()
    for pool_workers in workers:
        pool_workers.shutdown()
