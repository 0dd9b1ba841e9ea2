"""The replay pool's store interface: what the replay strategy writes is what another client
(a replica, a restarted sampler) reads back from the same Redis."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio as aioredis

from services.sampler.config import SamplerSettings
from services.sampler.storage.keys import Keys
from services.sampler.storage.replay_store import ReplayPool
from services.sampler.building.strategies import BuildContext, load_strategy


@pytest.fixture
async def clients(redis_url):
    """Two independent clients of the same Redis: two sampler processes."""
    first, second = aioredis.from_url(redis_url), aioredis.from_url(redis_url)
    yield first, second
    await first.aclose()
    await second.aclose()


def group(step: int, index: int) -> list[dict[str, Any]]:
    return [{"group_id": f"s{step}-g{index}", "prompt_id": f"p{step}-{index}", "policy_version": step,
             "advantage": 0.5 * (i + 1), "sample_index": i, "use_count": 1} for i in range(2)]


@dataclass
class FakeContext(BuildContext):
    """A build context whose fresh groups are made up on the spot (no inference)."""

    async def fresh(self, count: int, *, offset: int = 0) -> list[list[dict[str, Any]]]:
        return [group(self.step, offset + i) for i in range(count)]


async def lengths(client: aioredis.Redis, keys: Keys) -> tuple[int, int]:
    return await client.hlen(keys.replay_meta), await client.hlen(keys.replay_data)


async def test_draws_and_adds_are_seen_by_a_second_client_and_a_restarted_strategy(clients, namespace):
    settings = SamplerSettings(namespace=namespace, strategy="replay", prompts_per_step=2, num_generations=2,
                               replay_ratio=0.5, max_reuse=2, max_age=4, seed=3)
    keys = Keys(namespace)
    mine, theirs = ReplayPool(clients[0], keys), ReplayPool(clients[1], keys)
    strategy = load_strategy(settings)

    # Step 0: the pool is empty, so both groups are fresh; both enter the pool.
    batch0 = await strategy.assemble(FakeContext(step=0, min_version=0, source=None, replay_pool=mine,
                                                 env_name="toy", ticket=0))
    pool = await theirs.entries()
    assert sorted(pool) == ["s0-g0", "s0-g1"]
    assert all(m["use_count"] == 1 and m["created_step"] == 0 and m["policy_version"] == 0 for m in pool.values())
    assert pool["s0-g0"]["priority"] == pytest.approx(0.75)
    assert await theirs.samples(["s0-g1", "s0-g0"]) == [batch0[2:], batch0[:2]]

    # Step 1: one group drawn (its second and last use: it leaves the pool), one fresh added.
    batch1 = await strategy.assemble(FakeContext(step=1, min_version=1, source=None, replay_pool=mine,
                                                 env_name="toy", ticket=1))
    drawn = {s["group_id"] for s in batch1 if s["use_count"] == 2}
    assert len(drawn) == 1 and drawn <= {"s0-g0", "s0-g1"}
    pool = await theirs.entries()
    assert set(pool) == {"s0-g0", "s0-g1", "s1-g0"} - drawn
    assert await lengths(clients[1], keys) == (2, 2), "metadata and samples leave the pool together"
    assert await theirs.size() == 2

    # A restarted strategy (a new process: new instance, other client) goes on from that pool.
    restarted = load_strategy(settings)
    batch2 = await restarted.assemble(FakeContext(step=2, min_version=2, source=None, replay_pool=theirs,
                                                  env_name="toy", ticket=0))
    served_again = {s["group_id"] for s in batch2 if s["use_count"] == 2}
    assert len(served_again) == 1 and served_again <= set(pool)
    assert not served_again & drawn, "a used-up group is never served again"
    assert set(await mine.entries()) == set(pool) - served_again | {"s2-g0"}
    assert restarted.snapshot()["pool_size"] == 2


async def test_record_add_and_record_draw_write_metadata_and_samples_together(clients, namespace):
    keys = Keys(namespace)
    pool, other = ReplayPool(clients[0], keys), ReplayPool(clients[1], keys)
    meta = {"prompt_id": "p", "policy_version": 0, "use_count": 1, "created_step": 0, "priority": 0.5}
    await pool.record_add({"a": (meta, group(0, 0)), "b": ({**meta, "prompt_id": "q"}, group(0, 1))}, [])
    assert await other.entries() == {"a": meta, "b": {**meta, "prompt_id": "q"}}
    assert await other.samples(["b"]) == [group(0, 1)]

    # A replacement in one block: "a" leaves, "c" enters.
    await pool.record_add({"c": ({**meta, "created_step": 1}, group(1, 0))}, ["a"])
    assert set(await other.entries()) == {"b", "c"}
    assert await lengths(clients[1], keys) == (2, 2)

    # A draw: "b" stays with its new use count, "c" is used up.
    await pool.record_draw({"b": {**meta, "prompt_id": "q", "use_count": 2}}, ["c"])
    assert await other.entries() == {"b": {**meta, "prompt_id": "q", "use_count": 2}}
    assert await other.samples(["b"]) == [group(0, 1)], "a draw changes metadata, not samples"
    assert await lengths(clients[1], keys) == (1, 1)
    assert await other.samples([]) == []
