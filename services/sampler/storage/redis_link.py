"""Whether the sampler's Redis answers, and whether it is still the Redis it wrote to.

A Redis outage is a state of the sampler, not an error to log on every retry. Whoever hits
one (the producer, the fleet, the event listener, a batch build sealing its bytes) calls
`ride_out(exc)`: the first report of an outage logs one warning, every caller waits for
`up`, and the monitor (`run`) logs one line when Redis answers again. `/status`,
`GET /health` and `/metrics` read `snapshot()`.

The monitor also asks Redis for its `run_id` every `interval` seconds. A different id
means a restarted redis-server, which may have come back without the last writes it
acknowledged (AOF with `appendfsync everysec`, or no persistence at all). Before it
declares Redis up again, the monitor runs the `on_restart` callbacks, which write back
what this process acknowledged and still holds (store.py: `Store.reverify`).

`check_durability()` reads `appendonly` and `appendfsync` once at start-up: only
`appendfsync always` makes an acknowledged write survive a kill -9 of Redis; anything
else is named in a warning (and in /status) with the setting to change.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger("tandem.sampler.redis")

# What "Redis is unreachable" looks like to redis-py: refused or dropped connections, socket
# timeouts, and a Redis still loading its AOF after a restart (BusyLoadingError is a
# ConnectionError). Any other RedisError is a bug or a refusal, and is reported as such.
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError, OSError)


# How often the monitor asks while Redis is down (while up: every `interval`, or when poked).
_DOWN_INTERVAL = 0.2


def is_outage(exc: BaseException) -> bool:
    return isinstance(exc, OUTAGE_ERRORS)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class RedisLink:
    def __init__(self, client: aioredis.Redis, url: str, *, interval: float = 1.0):
        self.r = client
        self.url = url.split("@")[-1]  # never show a password
        self.interval = interval
        self.up = asyncio.Event()
        self.up.set()  # the lifespan has just pinged it
        self.down_since: float | None = None  # wall time
        self.last_error: str | None = None
        self.outages = 0
        self.restarts = 0
        self.run_id: str | None = None
        self.last_restart: dict[str, Any] | None = None
        self.durability: dict[str, Any] = {"appendonly": None, "appendfsync": None, "durable": None, "warning": None}
        # Called (in order) when Redis comes back as a different server process; each returns
        # a short summary of what it repaired, for the recovery log line.
        self.on_restart: list[Callable[[], Awaitable[str | None]]] = []
        self._poke = asyncio.Event()

    # --- start-up --------------------------------------------------------------------------

    async def start(self) -> None:
        """Learn the server's run id and check that it keeps what it acknowledges."""
        self.run_id = await self._run_id()
        await self.check_durability()

    async def check_durability(self) -> None:
        try:
            config = await self.r.config_get("append*")
        except ResponseError as exc:  # managed Redis often disables CONFIG
            self.durability = {"appendonly": None, "appendfsync": None, "durable": None, "warning": (
                f"could not read the Redis persistence settings (CONFIG GET: {exc}); make sure it runs with "
                "`appendonly yes` and `appendfsync always`, or a crash of Redis can lose batches and versions "
                "the sampler already acknowledged")}
            log.warning("%s", self.durability["warning"])
            return
        appendonly, appendfsync = config.get("appendonly"), config.get("appendfsync")
        durable = appendonly == "yes" and appendfsync == "always"
        warning = None
        if not durable:
            loses = ("every write since it started (no AOF)" if appendonly != "yes"
                     else f"up to about a second of writes (appendfsync {appendfsync})")
            warning = (f"Redis at {self.url} runs with appendonly {appendonly}, appendfsync {appendfsync}: if it is "
                       f"killed it loses {loses}, including sealed batches and versions the sampler already "
                       "acknowledged. Run it with `--appendonly yes --appendfsync always` (or CONFIG SET appendfsync "
                       "always). Until then the sampler notices a restarted Redis and writes back the batches and "
                       "the version it still holds in memory.")
            log.warning("%s", warning)
        self.durability = {"appendonly": appendonly, "appendfsync": appendfsync, "durable": durable,
                           "warning": warning}

    async def _run_id(self) -> str:
        info = await self.r.info("server")
        return str(info.get("run_id", ""))

    # --- outages ---------------------------------------------------------------------------

    def report(self, exc: BaseException) -> None:
        """A caller found Redis unreachable: mark the outage (one warning) and look again now."""
        self.last_error = _describe(exc)
        if self.up.is_set():
            self.up.clear()
            self.down_since = time.time()
            self.outages += 1
            log.warning("Redis at %s is unreachable (%s): the producer, the fleet and the event listener wait for "
                        "it; GET /batch and POST /weights_version answer 503 until it is back", self.url,
                        self.last_error)
        self._poke.set()

    async def ride_out(self, exc: BaseException) -> None:
        """Report the outage `exc` and wait until Redis answers again (and is reconciled)."""
        self.report(exc)
        await self.up.wait()

    async def run(self) -> None:
        """Ask Redis who it is every `interval` seconds (at once when poked); mark it up or down."""
        while True:
            self._poke.clear()
            try:
                run_id = await self._run_id()
                restart = None
                if self.run_id is not None and run_id != self.run_id:
                    restart = await self._restarted(run_id)
                self.run_id = run_id
                if not self.up.is_set():
                    log.warning("Redis at %s answers again after %.1fs%s", self.url,
                                time.time() - (self.down_since or 0), f": {restart}" if restart else "")
                    self.down_since = None
                    self.last_error = None
                    self.up.set()
                elif restart:
                    log.warning("Redis at %s: %s", self.url, restart)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - an outage (or a failing repair) is a state here
                if not is_outage(exc):
                    log.error("checking Redis at %s failed: %s", self.url, _describe(exc))
                self.report(exc)
            if not self.up.is_set():
                # Down: look again soon, but never faster than this (callers' reports poke too).
                await asyncio.sleep(_DOWN_INTERVAL)
                continue
            try:
                async with asyncio.timeout(self.interval):
                    await self._poke.wait()
            except TimeoutError:
                pass

    async def _restarted(self, run_id: str) -> str:
        """A new redis-server process: repair what it may have lost before anyone is told it is
        up. Returns what happened, for the log."""
        repaired = []
        for callback in self.on_restart:
            try:
                summary = await callback()
            except Exception as exc:
                if is_outage(exc):
                    raise  # Redis went away again: the whole repair is retried at the next look
                # A repair that cannot work must not hold the sampler down: say so, go on.
                log.error("repairing after the Redis restart: %s failed: %s", getattr(callback, "__qualname__", callback),
                          _describe(exc))
                summary = f"{getattr(callback, '__qualname__', callback)} failed ({_describe(exc)})"
            if summary:
                repaired.append(summary)
        self.restarts += 1
        self.last_restart = {"at": time.time(), "previous_run_id": self.run_id, "run_id": run_id,
                             "repaired": repaired}
        return (f"it is a new process (run id {(self.run_id or '?')[:8]} -> {run_id[:8]}); "
                + ("; ".join(repaired) if repaired else "it had lost nothing this sampler acknowledged"))

    # --- reporting -------------------------------------------------------------------------

    @property
    def reachable(self) -> bool:
        return self.up.is_set()

    def problem(self) -> str | None:
        """One line for GET /health and 503s while Redis is down."""
        if self.reachable:
            return None
        return (f"Redis at {self.url} unreachable for {time.time() - (self.down_since or time.time()):.0f}s "
                f"({self.last_error})")

    def snapshot(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "state": "up" if self.reachable else "unreachable",
            "down_since": self.down_since,
            "down_seconds": None if self.down_since is None else time.time() - self.down_since,
            "last_error": self.last_error,
            "outages": self.outages,
            "restarts": self.restarts,
            "last_restart": self.last_restart,
            "run_id": self.run_id,
            **self.durability,
        }
