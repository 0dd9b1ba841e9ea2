"""Small asyncio helpers with no knowledge of Redis, HTTP or the sampler."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Any


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


async def gather_first_error(*calls: Any) -> list[Any]:
    """Run `calls` together, each to its end (none is left running, none cut short by
    another's failure), then raise the first one's error, if any."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


class Abandoned(Exception):
    """A task cut short on purpose by `Cuttable.abandon`; `why` says what happened."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


class Cuttable:
    """Tasks, grouped by a key (a server's URL), that can be cut short on purpose without
    cancelling whoever awaits them. `run(key, task)` awaits `task`; when `abandon(key, why)`
    cancelled it, the awaiter gets `Abandoned(why)` instead of a cancellation, while a
    cancellation of the awaiting task itself (a shutdown) still propagates as ever."""

    def __init__(self) -> None:
        self._tasks: dict[Hashable, dict[asyncio.Future, str | None]] = {}  # key -> task -> why, once cut

    async def run(self, key: Hashable, task: asyncio.Future) -> Any:
        tasks = self._tasks.setdefault(key, {})
        tasks[task] = None
        try:
            return await task
        except asyncio.CancelledError:
            why = tasks.get(task)
            current = asyncio.current_task()
            if why is None or (current is not None and current.cancelling()):
                raise  # the awaiter was cancelled, not the task cut
            raise Abandoned(why) from None
        finally:
            tasks.pop(task, None)
            if not tasks and self._tasks.get(key) is tasks:
                del self._tasks[key]

    def abandon(self, key: Hashable, why: str) -> int:
        """Cancel every task of `key` still running; the number cut."""
        tasks = self._tasks.get(key, {})
        cut = [task for task, reason in tasks.items() if reason is None and not task.done()]
        for task in cut:
            tasks[task] = why
            task.cancel()
        return len(cut)

    def cut(self, task: asyncio.Future) -> bool:
        """Whether `task` was cut by `abandon` (asked from inside it, to skip what no longer helps)."""
        return any(tasks.get(task) is not None for tasks in self._tasks.values())
