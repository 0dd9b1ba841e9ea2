"""The wake-up helpers: `shared.aio.wait_event` and the Notifier's change events."""

from __future__ import annotations

import asyncio

from shared.aio import wait_event


async def test_wait_event_times_out_and_wakes():
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    event.set()
    assert await wait_event(event, 0.0) is True  # a set event counts even with no time left


async def test_a_cancelled_wait_is_never_swallowed():
    """A task cancelled while its event is being set must still end. On Python 3.11 a wait
    built on asyncio.wait_for returned normally instead, in 160 of 200 such races, and a loop
    around it ran on after its cancellation: the producer waited forever for such a task after
    a Redis restart (issue 13)."""
    survivors = 0
    for trial in range(50):
        box = [asyncio.Event()]

        async def loop_forever() -> None:
            while True:
                await wait_event(box[0], 5.0)

        task = asyncio.create_task(loop_forever())
        for _ in range(trial % 5):  # let the race land at different points of the wait
            await asyncio.sleep(0)
        event, box[0] = box[0], asyncio.Event()
        event.set()
        for _ in range(trial % 3):
            await asyncio.sleep(0)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=1.0)
        if not done:
            survivors += 1
            box[0] = asyncio.Event()  # an event nobody sets: this cancellation cannot race
            task.cancel()
            await asyncio.wait([task], timeout=1.0)
    assert survivors == 0, f"{survivors} of 50 cancelled waits kept running"


def test_a_running_replica_follows_a_server_another_replica_adds_at_once(make_sampler, two_standins):
    """The fleet re-reads membership when a "servers" message says it changed (and every
    check_interval besides): with the interval at 60 s, a running replica still takes up a
    server another replica added within a few seconds, from the message alone."""
    import httpx

    from tests.reliability.support import wait_for

    first, second = two_standins
    a = make_sampler(inference_urls=[first.url], server_check_interval=60)
    b = make_sampler(inference_urls=[first.url], server_check_interval=60)
    for replica in (a, b):
        wait_for(lambda r=replica: httpx.get(r.url + "/status").json()["inference_servers"], 10, "a server in status")
    added = httpx.post(a.url + "/inference_servers", json={"url": second.url}, timeout=30)
    assert added.status_code == 200, added.text

    def urls_of_b() -> set[str]:
        return {s["url"] for s in httpx.get(b.url + "/status").json()["inference_servers"]}

    wait_for(lambda: second.url in urls_of_b(), 5, "replica b to use the server replica a added",
             detail=lambda: str(urls_of_b()))
