"""Small asyncio helpers with no knowledge of Redis, HTTP or the sampler."""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait until `event` is set, at most `timeout` seconds; False when the time ran out.

    Built on `asyncio.timeout`, not `asyncio.wait_for`: on Python 3.11, wait_for swallows a
    cancellation that arrives in the loop iteration in which the awaited event is set, and
    returns as if nothing happened. A task cancelled in such a wait then runs on, and whoever
    awaits its end waits forever: that is how the producer hung after a Redis restart (its
    crash handler cancelled the claim watcher and waited for it). See tests/sampler/test_notify.py.
    """
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(max(timeout, 0.0)):
            await event.wait()
        return True
    except TimeoutError:
        return False


async def wait_any(events: list[asyncio.Event], timeout: float) -> bool:
    """Wait until one of `events` is set, at most `timeout` seconds; False when the time ran out.
    (asyncio.wait, unlike wait_for, never swallows a cancellation of the waiting task.)"""
    if any(event.is_set() for event in events):
        return True
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        done, _ = await asyncio.wait(waiters, timeout=max(timeout, 0.0), return_when=asyncio.FIRST_COMPLETED)
        return bool(done)
    finally:
        for waiter in waiters:
            waiter.cancel()
