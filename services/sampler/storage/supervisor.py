"""Named background tasks that are restarted when they crash and stopped with a deadline."""

from __future__ import annotations

import asyncio
import io
import logging
import signal
import threading
import time
from collections.abc import Awaitable, Callable

from services.sampler.storage.redis_link import RedisLink, is_outage

log = logging.getLogger("tandem.supervisor")

MAX_RESTART_DELAY = 2.0
HEALTHY_RUN_SECONDS = 60.0


class Supervisor:
    def __init__(self, link: RedisLink | None = None) -> None:
        self.tasks: dict[str, asyncio.Task] = {}
        self.crashes: dict[str, int] = {}
        # A task that stops because Redis is unreachable is not a crash: it is started again
        # once the link sees Redis back, with no traceback (the link logs the outage once).
        self.link = link
        self._stopping = False

    def spawn(self, name: str, factory: Callable[[], Awaitable[None]], *, restart: bool = True) -> None:
        """Run `factory()` as task `name`; if it raises, log it and (if `restart`) run it again.

        Restarts back off from 0.5 s to 2 s while the task keeps crashing at once (Redis down),
        and start again from 0.5 s after a run of a minute or more, so that one outage does
        not slow the recovery from the next. Only the first crash of a series logs a traceback.
        A Redis outage is waited out instead (RedisLink.ride_out)."""

        async def guarded() -> None:
            delay = 0.5
            while True:
                started = time.monotonic()
                try:
                    await factory()
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    if self.link is not None and is_outage(exc) and restart and not self._stopping:
                        log.debug("background task %s stopped: Redis unreachable (%s)", name, exc)
                        await self.link.ride_out(exc)
                        delay = 0.5
                        continue
                    self.crashes[name] = self.crashes.get(name, 0) + 1
                    if time.monotonic() - started >= HEALTHY_RUN_SECONDS:
                        delay = 0.5
                    if delay == 0.5:
                        log.exception("background task %s crashed (%d times); restarting it in %.1fs",
                                      name, self.crashes[name], delay)
                    else:
                        log.error("background task %s crashed again (%d times): %s: %s; restarting it in %.1fs",
                                  name, self.crashes[name], type(exc).__name__, exc, delay)
                    if not restart or self._stopping:
                        return
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_RESTART_DELAY)

        self.tasks[name] = asyncio.create_task(guarded(), name=name)

    async def stop(self, name: str, deadline: float = 10.0) -> None:
        """Cancel one task and wait for it, at most `deadline` seconds (others keep running). A
        task still running then is logged with its stack and left behind: a shutdown must not
        wait on it past the budget its parent gives it (the demo kills a sampler after 20 s)."""
        task = self.tasks.get(name)
        if task is not None and not task.done():
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=deadline)
            if not done:
                stack = io.StringIO()
                task.print_stack(file=stack)
                log.error("background task %s did not stop within %.1fs of being cancelled; going on without it:\n%s",
                          name, deadline, stack.getvalue())

    async def shutdown(self, deadline: float = 10.0) -> None:
        self._stopping = True
        for task in self.tasks.values():
            task.cancel()
        if not self.tasks:
            return
        done, pending = await asyncio.wait(self.tasks.values(), timeout=deadline)
        for task in pending:
            log.error("background task %s did not stop within %.0fs", task.get_name(), deadline)


def install_task_dump() -> bool:
    """`kill -USR1 <sampler pid>` logs the stack of every asyncio task: what a stuck process is
    waiting for. Only where signals can be handled (the main thread of a process)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR1"):
        return False

    def dump() -> None:
        out = io.StringIO()
        for task in sorted(asyncio.all_tasks(), key=lambda t: t.get_name()):
            out.write(f"--- task {task.get_name()}{' (cancelling)' if task.cancelling() else ''}\n")
            task.print_stack(file=out)
        log.warning("asyncio tasks (SIGUSR1):\n%s", out.getvalue())

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump)
    return True
