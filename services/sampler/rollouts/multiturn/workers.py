"""Worker threads for environment code that is synchronous or CPU-heavy (answer checking,
code execution): it runs there, so it never stalls the sampler's HTTP API or the other
rollouts on the event loop. `async def` code runs on the loop as it is: it is expected to
await, not to compute for long.

Threads, not processes: environment code is often a closure or a method over unpicklable
state, which a process pool cannot take. Code that holds the GIL for long stretches still
lets the event loop run at every switch interval (5 ms); code that must use many cores
should start processes of its own (or call a sandbox) from its function.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def is_async(fn: Callable[..., Any]) -> bool:
    """True for an `async def` function or an object whose `__call__` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


class Workers:
    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"env_workers must be >= 1, got {size}")
        self.size = size
        self._pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="tandem-env")
        self.busy = 0  # calls running or queued in the threads now (for /status)

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)`: awaited on the loop if it is async, else in a worker thread."""
        if is_async(fn):
            return await fn(*args, **kwargs)
        self.busy += 1
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                self._pool, functools.partial(fn, *args, **kwargs))
        finally:
            self.busy -= 1
        if inspect.isawaitable(result):  # a plain function that returned a coroutine
            result = await result
        return result

    def shutdown(self) -> None:
        # Do not wait: a hung environment function must not hold the sampler's shutdown up.
        self._pool.shutdown(wait=False, cancel_futures=True)
