"""Fan-out to inference servers that speak vLLM's OpenAI-compatible API.

* At most `max_concurrency` requests are in flight over all servers (one semaphore).
* Each request goes to the usable server with the fewest outstanding requests, where
  usable means: it serves a weights version new enough for the batch, and it is not
  cooling down after failures.
* 5xx answers and transport errors are retried with backoff on the next best server;
  a server that keeps failing cools down and is skipped while others work. When every
  attempt fails, `InferenceUnavailable` names the servers and their last errors.
* A 4xx answer is our bug or the user's (bad model name, prompt too long) and is not
  retried: `InferenceRequestError` carries the server's message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.sampler.notify import wait_event
from shared.http_client import HttpClient, Reply, TransportError

log = logging.getLogger("tandem.sampler.inference")


class InferenceError(RuntimeError):
    pass


class InferenceRequestError(InferenceError):
    """A 4xx from an inference server: retrying would not help."""


class InferenceUnavailable(InferenceError):
    """Every attempt failed (5xx, transport errors, or no server with the needed version)."""


@dataclass
class Server:
    url: str
    version: int | None = None
    outstanding: int = 0
    consecutive_failures: int = 0
    cooldown_until: float = 0.0
    last_error: str | None = None
    requests: int = 0
    failures: int = 0
    last_sync_seconds: float | None = None
    syncing: bool = False

    def usable(self, min_version: int, now: float) -> bool:
        return (
            not self.syncing
            and self.version is not None
            and self.version >= min_version
            and now >= self.cooldown_until
        )

    def snapshot(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "version": self.version,
            "healthy": self.consecutive_failures == 0,
            "outstanding": self.outstanding,
            "requests": self.requests,
            "failures": self.failures,
            "error": self.last_error,
            "last_sync_seconds": self.last_sync_seconds,
        }


@dataclass
class PoolStats:
    retries: int = 0
    errors: int = 0


class InferencePool:
    def __init__(
        self,
        urls: list[str],
        *,
        max_concurrency: int,
        request_timeout: float,
        retries: int,
        http: HttpClient,
        on_version_change: Callable[[], None] | None = None,
    ):
        self.servers = [Server(url.rstrip("/")) for url in urls]
        self.semaphore = asyncio.Semaphore(max_concurrency)
        self.request_timeout = request_timeout
        self.retries = retries
        self.http = http
        self.stats = PoolStats()
        self.in_flight = 0
        # Set at shutdown: a request finds no usable server -> fail at once, do not wait.
        self.closing = False
        self._version_changed = asyncio.Event()
        # Called whenever a server's version changes, so waiters elsewhere re-check.
        self.on_version_change = on_version_change

    def min_version(self) -> int | None:
        versions = [s.version for s in self.servers if s.version is not None]
        return min(versions) if len(versions) == len(self.servers) else None

    def max_version(self) -> int | None:
        versions = [s.version for s in self.servers if s.version is not None]
        return max(versions) if versions else None

    def set_version(self, url: str, version: int | None) -> None:
        for server in self.servers:
            if server.url == url.rstrip("/"):
                server.version = version
        self._version_changed.set()
        self._version_changed = asyncio.Event()
        if self.on_version_change is not None:
            self.on_version_change()

    def _pick(self, min_version: int) -> Server | None:
        now = time.monotonic()
        usable = [s for s in self.servers if s.usable(min_version, now)]
        if not usable:
            return None
        return min(usable, key=lambda s: (s.outstanding, s.consecutive_failures))

    async def _wait_for_server(self, min_version: int, deadline: float) -> Server:
        """A usable server, waiting through cooldowns and version syncs until `deadline`."""
        while True:
            server = self._pick(min_version)
            if server is not None:
                return server
            now = time.monotonic()
            if now >= deadline or self.closing:
                detail = ", ".join(
                    f"{s.url} (version {s.version}, {'syncing' if s.syncing else s.last_error or 'ok'})"
                    for s in self.servers
                )
                raise InferenceUnavailable(
                    f"no inference server serves version >= {min_version} and is healthy: {detail}"
                )
            cooling = [s.cooldown_until - now for s in self.servers if s.cooldown_until > now]
            wait = min(cooling + [deadline - now, 1.0])
            changed = self._version_changed
            await wait_event(changed, max(wait, 0.01))

    async def post(self, path: str, body: dict[str, Any], *, min_version: int = 0) -> tuple[dict[str, Any], Server]:
        """POST to the best server; returns the JSON answer and the server that gave it."""
        async with self.semaphore:
            self.in_flight += 1
            try:
                return await self._post_with_retries(path, body, min_version)
            finally:
                self.in_flight -= 1

    async def _post_with_retries(self, path: str, body: dict[str, Any], min_version: int) -> tuple[dict[str, Any], Server]:
        attempts = self.retries + 1
        deadline = time.monotonic() + self.request_timeout
        failures: list[str] = []
        for attempt in range(attempts):
            server = await self._wait_for_server(min_version, deadline)
            server.outstanding += 1
            server.requests += 1
            try:
                response = await self.http.post(server.url + path, json=body, timeout=self.request_timeout)
            except TransportError as exc:
                error = str(exc)
            else:
                if response.status_code < 400:
                    server.consecutive_failures = 0
                    server.cooldown_until = 0.0
                    server.last_error = None
                    return response.json(), server
                if response.status_code < 500:
                    raise InferenceRequestError(
                        f"{server.url}{path} answered {response.status_code}: {response.text[:500]}"
                    )
                error = f"HTTP {response.status_code}: {response.text[:200]}"
            finally:
                server.outstanding -= 1
            server.failures += 1
            server.consecutive_failures += 1
            server.last_error = error
            # Back off this server exponentially; others keep working meanwhile.
            backoff = min(0.05 * 2 ** server.consecutive_failures, 5.0)
            server.cooldown_until = time.monotonic() + backoff
            self.stats.errors += 1
            failures.append(f"{server.url}: {error}")
            if attempt + 1 < attempts:
                self.stats.retries += 1
                log.warning("inference request to %s failed (%s); retry %d/%d", server.url, error, attempt + 1, self.retries)
        raise InferenceUnavailable(f"inference request failed after {attempts} attempts: " + "; ".join(failures[-3:]))

    async def get(self, url: str, path: str, timeout: float = 10.0) -> Reply:
        return await self.http.get(url + path, timeout=timeout)
