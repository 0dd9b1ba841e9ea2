"""The producer's plan comes from Redis: lost steps are rebuilt or written back, and reported;
a version published ahead of its batch never puts negative staleness in a batch."""

from __future__ import annotations

import asyncio

import httpx
import redis as redis_py

from services.sampler.storage.keys import Keys
from services.sampler.storage.packing import pack
from services.sampler.storage.store import Store
from tests.reliability.support import wait_for
from tests.support.driver import drive


def _stored(redis_url: str, namespace: str, step: int) -> dict[bytes, bytes]:
    """Everything Redis holds of batch `step`: manifest fields and chunk bytes, by key."""
    client = redis_py.Redis.from_url(redis_url)
    try:
        manifest = Keys(namespace).batch(step)
        found = {manifest.encode() + b"/" + k: v for k, v in client.hgetall(manifest).items()}
        for key in client.scan_iter(f"{manifest}:*"):
            found[key] = client.get(key)
        return found
    finally:
        client.close()


def _status(url: str) -> dict:
    return httpx.get(f"{url}/status", timeout=30).json()


def _lose(redis_url: str, namespace: str, step: int) -> None:
    """Drop a sealed batch the way a Redis that lost its last writes would: key and index entry."""
    keys = Keys(namespace)
    client = redis_py.Redis.from_url(redis_url)
    try:
        chunks = list(client.scan_iter(f"{keys.batch(step)}:*"))  # its chunks, lost with it
        assert client.delete(keys.batch(step), *chunks) == 1 + len(chunks) and client.zrem(keys.sealed, step) == 1
    finally:
        client.close()


async def test_a_step_nobody_holds_is_rebuilt_and_reported(make_sampler, redis_url, namespace):
    first = make_sampler(max_staleness=1)
    await drive(first.url, 2)  # version 2: batches 2 and 3 get built
    wait_for(lambda: {2, 3} <= set(_status(first.url)["steps"]["sealed_steps"]), 30, "batches 2 and 3")
    first.stop()
    _lose(redis_url, namespace, 2)  # batch 3 is still there: 2 is a gap no process holds

    second = make_sampler(max_staleness=1)
    status = wait_for(lambda: (s := _status(second.url))["steps"]["healed"]["counts"]["rebuilt"] and s, 30,
                   "the lost step to be rebuilt")
    assert [h["step"] for h in status["steps"]["healed"]["recent"] if h["how"] == "rebuilt"] == [2]
    batch = httpx.get(f"{second.url}/batch", params={"step": 2, "timeout": 20}, timeout=30)
    assert batch.status_code == 200 and batch.json()["step"] == 2
    assert {s["policy_version"] for s in batch.json()["samples"]} <= {1, 2}
    assert _status(second.url)["steps"]["missing"] == []
    metrics = httpx.get(f"{second.url}/metrics").text
    assert 'tandem_sampler_steps_healed_total{how="rebuilt"} 1.0' in metrics


async def test_a_lost_seal_this_process_holds_is_written_back_byte_for_byte(make_sampler, redis_url, namespace):
    sampler = make_sampler(max_staleness=1)
    await drive(sampler.url, 1)
    served = httpx.get(f"{sampler.url}/batch", params={"step": 1, "timeout": 20}, timeout=30)
    assert served.status_code == 200
    stored = _stored(redis_url, namespace, 1)
    _lose(redis_url, namespace, 1)
    # The next pass (at once: GET /batch wakes the planner for a step nobody builds) writes it back.
    httpx.get(f"{sampler.url}/batch", params={"step": 1, "timeout": 0}, timeout=30)
    wait_for(lambda: _stored(redis_url, namespace, 1) == stored, 10, "batch 1 to be written back")
    status = _status(sampler.url)
    assert status["steps"]["healed"]["counts"]["restored"] == 1
    assert status["steps"]["healed"]["counts"]["rebuilt"] == 0
    assert 1 in status["steps"]["sealed_steps"]
    assert httpx.get(f"{sampler.url}/batch", params={"step": 1}, timeout=30).content == served.content


async def test_reverify_writes_back_what_a_restarted_redis_lost(redis_url, namespace):
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_url)
    keys = Keys(namespace)
    store = Store(client, keys)
    try:
        batch = pack(4, [{"group_id": "g", "reward": 1.0}], {"step": 4})
        assert await store.seal(4, batch) == 1
        assert (await store.publish_version(5, "/ckpt/5"))[0] == 2
        assert await store.trim_below(3) == 0
        assert await store.reverify() == ([], None)  # nothing lost: nothing written
        await client.delete(*[k async for k in client.scan_iter(f"{keys.prefix}*")])  # a Redis that came back empty
        restored, republished = await store.reverify()
        assert restored == [4] and republished == 5
        assert (await Store(client, keys).get_batch(4)).build == batch.build
        meta = await store.meta()
        assert (meta["version"], meta["checkpoint_path"], meta["trimmed_below"]) == (5, "/ckpt/5", 3)
        assert meta["adapter"] is False
        # A LoRA version keeps its adapter flag through the same loss: re-syncs load it as one.
        assert (await store.publish_version(6, "/published/version-6", adapter=True))[0] == 2
        await client.delete(*[k async for k in client.scan_iter(f"{keys.prefix}*")])
        assert (await store.reverify())[1] == 6
        meta = await store.meta()
        assert (meta["version"], meta["checkpoint_path"], meta["adapter"]) == (6, "/published/version-6", True)
    finally:
        await client.aclose()


async def test_a_version_published_before_its_batch_was_read_never_gives_negative_staleness(make_sampler, standin):
    """With the server paused, batches 0 and 1 are mid-generation when version 2 is published (a
    trainer that publishes before reading). Their tokens then come from version 2: such a batch
    is dropped, never sealed with negative staleness, and a GET for it says why (410)."""
    httpx.post(f"{standin.url}/pause")
    sampler = make_sampler(max_staleness=1)
    url = sampler.url
    wait_for(lambda: {0, 1} <= {p["step"] for p in _status(url)["steps"]["in_progress"]}, 20, "batches 0 and 1 to start")
    assert httpx.post(f"{url}/weights_version", json={"version": 2}).status_code == 200
    httpx.post(f"{standin.url}/resume")
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for step in (2, 3):
            response = await http.get("/batch", params={"step": step, "timeout": 20})
            assert response.status_code == 200
            assert {s["policy_version"] for s in response.json()["samples"]} <= {step - 1, step}
        await asyncio.sleep(0.5)
        gone = 0
        for step in (0, 1):
            response = await http.get("/batch", params={"step": step, "timeout": 5})
            if response.status_code == 200:
                versions = {s["policy_version"] for s in response.json()["samples"]}
                assert max(versions) <= step, f"batch {step} holds samples from versions {versions}"
            else:
                assert response.status_code == 410, response.text
                detail = response.json()["detail"]
                assert detail["reason"] == "superseded" and "version 2 is published" in detail["message"]
                gone += 1
    assert gone >= 1, "both early batches sealed: the drill never put a newer version into a batch"
    assert _status(url)["steps"]["dropped_builds"] == gone
