"""RedisLink: an outage is one state change, not a loop; a new Redis process is repaired first."""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis

from services.sampler.storage.redis_link import RedisLink
from tests.support.servers import refused_port


async def test_while_redis_is_down_the_monitor_looks_a_few_times_a_second_and_warns_once(caplog):
    caplog.set_level(logging.WARNING)
    with refused_port() as port:  # nothing can answer there meanwhile
        await _watch_a_dead_redis(port, caplog)


async def _watch_a_dead_redis(port: int, caplog) -> None:
    client = aioredis.from_url(f"redis://127.0.0.1:{port}/0", socket_connect_timeout=1)
    link = RedisLink(client, "redis://nowhere")
    looks = 0
    real = link._run_id

    async def counted() -> str:
        nonlocal looks
        looks += 1
        return await real()

    link._run_id = counted  # type: ignore[method-assign]
    monitor = asyncio.create_task(link.run())
    try:
        await asyncio.sleep(1.0)
        for _ in range(20):  # callers keep running into the outage: no extra warnings, no spinning
            link.report(ConnectionError("refused"))
            await asyncio.sleep(0)
        await asyncio.sleep(0.5)
    finally:
        monitor.cancel()
        await asyncio.gather(monitor, return_exceptions=True)
        await client.aclose()
    assert not link.reachable and link.outages == 1
    assert 3 <= looks <= 12, f"{looks} looks in 1.5 s"
    warnings = [r for r in caplog.records if "is unreachable" in r.getMessage()]
    assert len(warnings) == 1


async def test_a_new_redis_process_is_repaired_before_it_counts_as_up(redis_url):
    client = aioredis.from_url(redis_url)
    link = RedisLink(client, redis_url, interval=0.05)
    await link.start()
    calls: list[str] = []

    async def broken() -> str:
        raise ValueError("cannot repair")

    async def repair() -> str:
        calls.append("repair")
        return "wrote back batch 3"

    link.on_restart += [broken, repair]
    link.run_id = "an-older-process"  # as if Redis had restarted since the last look
    link.report(ConnectionError("dropped"))
    monitor = asyncio.create_task(link.run())
    try:
        await asyncio.wait_for(link.up.wait(), 5)
    finally:
        monitor.cancel()
        await asyncio.gather(monitor, return_exceptions=True)
        await client.aclose()
    assert calls == ["repair"] and link.restarts == 1
    assert link.last_restart["repaired"][-1] == "wrote back batch 3"
    assert "cannot repair" in link.last_restart["repaired"][0]  # a failing repair is reported, not fatal
