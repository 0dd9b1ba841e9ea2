"""Named background tasks that are restarted when they crash and stopped with a deadline."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("tandem.supervisor")


class Supervisor:
    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Task] = {}
        self.crashes: dict[str, int] = {}
        self._stopping = False

    def spawn(self, name: str, factory: Callable[[], Awaitable[None]], *, restart: bool = True) -> None:
        """Run `factory()` as task `name`; if it raises, log it and (if `restart`) run it again."""

        async def guarded() -> None:
            delay = 0.5
            while True:
                try:
                    await factory()
                    return
                except asyncio.CancelledError:
                    raise
                except Exception:
                    self.crashes[name] = self.crashes.get(name, 0) + 1
                    log.exception("background task %s crashed (%d times)", name, self.crashes[name])
                    if not restart or self._stopping:
                        return
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 10.0)

        self.tasks[name] = asyncio.create_task(guarded(), name=name)

    async def stop(self, name: str) -> None:
        """Cancel one task and wait for it (others keep running)."""
        task = self.tasks.get(name)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def snapshot(self) -> dict[str, str]:
        return {name: ("running" if not t.done() else "stopped") for name, t in self.tasks.items()}

    async def shutdown(self, deadline: float = 10.0) -> None:
        self._stopping = True
        for task in self.tasks.values():
            task.cancel()
        if not self.tasks:
            return
        done, pending = await asyncio.wait(self.tasks.values(), timeout=deadline)
        for task in pending:
            log.error("background task %s did not stop within %.0fs", task.get_name(), deadline)
