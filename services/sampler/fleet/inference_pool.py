"""Fan-out to inference servers that speak vLLM's OpenAI-compatible API.

* At most `max_concurrency` requests are in flight over all servers (one semaphore).
* Each request goes to the usable server with the fewest outstanding requests, where
  usable means: in rotation (state "ok", see `Server`), not in the middle of a weight sync,
  serving a weights version new enough for the batch, and not cooling down after failures.
* 5xx answers and transport errors are retried with backoff on the next best server;
  a server that keeps failing cools down and is skipped while others work. When every
  attempt fails, `InferenceUnavailable` names the servers and their last errors.
* A 4xx answer is our bug or the user's (bad model name, prompt too long) and is not
  retried: `InferenceRequestError` carries the server's message.
* An answer whose `weight_versions` are older than the version the server was serving when
  the request was sent means the server lost its weights (it restarted): the answer is
  dropped, the server is taken out of rotation and reported to `on_suspect` (the fleet
  checks it at once), and the request is retried elsewhere.
* Membership changes at run time (`add`, `remove`); the fleet (fleet/members.py) decides who is in.
* Session affinity: a request that names a `session` (one multi-turn trajectory) goes to
  the server its session is bound to, where the conversation so far sits in the prefix
  cache, and carries vLLM's `X-Session-ID` header. A session is bound on its first request
  (to the server with the fewest outstanding requests, so trajectories balance) and waits
  for its server through a weight sync; it moves only when that server leaves the rotation,
  fails, or serves too old a version. `release` forgets it when the trajectory ends.
* `abandon(server, why)` cuts the requests in flight to a server that stopped answering (the
  fleet's liveness check, liveness.py): each fails as a dropped request does and is retried on
  another server, instead of waiting out `request_timeout` on a frozen process.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from shared.aio import Abandoned, Cuttable, wait_event
from shared.http_client import HttpClient, Reply, TransportError
from shared.probe import ProbeResult

log = logging.getLogger("tandem.sampler.inference")

T = TypeVar("T")

# A server's place in the rotation. Only "ok" servers get work.
JOINING = "joining"      # added, not yet known to serve the published weights
OK = "ok"                # in rotation
DOWN = "down"            # not answering (or answered with lost weights); checked again soon
RESYNCING = "resyncing"  # restarted: loading the latest published checkpoint into it
STALE = "stale"          # restarted, and the sampler cannot load the published weights into it
MISMATCH = "mismatch"    # after a sync it does not compute what the trainer computes (probe)
LEAVING = "leaving"      # removed from the run: no new work, requests in flight may finish
STATES = (JOINING, OK, DOWN, RESYNCING, STALE, MISMATCH, LEAVING)

EVENTS_KEPT = 20


class InferenceError(RuntimeError):
    pass


class InferenceRequestError(InferenceError):
    """A 4xx from an inference server: retrying would not help."""


class InferenceUnavailable(InferenceError):
    """Every attempt failed (5xx, transport errors, or no server with the needed version)."""


class WentBackwards(InferenceError):
    """An answer produced by weights older than those the server was known to serve."""


@dataclass
class Server:
    url: str
    version: int | None = None
    state: str = JOINING
    reason: str | None = None  # why the server is out of rotation, in words
    outstanding: int = 0
    consecutive_failures: int = 0
    cooldown_until: float = 0.0
    last_error: str | None = None
    requests: int = 0
    failures: int = 0
    last_sync_seconds: float | None = None
    resyncs: int = 0
    reload_method: str | None = None  # collective_rpc method that reloads its weights (weight_sync.py)
    plain_vllm: bool = False  # with reload_method: vLLM without Tandem's worker extension (no delta versions)
    # With reload_method: its reload takes the version label and swaps both between two steps
    # (Tandem's CPU server), so a sync is one request: no pause, relabel or resume around it.
    relabels_on_reload: bool = False
    # The LoRA adapter its version is served through (shared/adapters.py), None for full weights:
    # every request sent to it then names the adapter as its `model`.
    adapter: str | None = None
    last_probe: ProbeResult | None = None
    probe_failures: int = 0
    # Times it was found paused with no weight sync holding it (someone else paused it) and resumed.
    foreign_pauses: int = 0
    # Set when a sync to it was abandoned (it stopped answering mid-sync): its label may name
    # weights it never finished loading, so when it answers again it is re-synced whatever it says.
    needs_resync: str | None = None
    # Monotonic seconds our weight syncs have held it so far, and when the one now running began
    # (None: no sync of ours holds it): a request frozen by a sync's pause is not charged for
    # that time (InferencePool._bounded).
    held_seconds: float = 0.0
    held_since: float | None = None
    added_at: float = field(default_factory=time.time)
    # (unix time, what happened): joins, leaves, restarts, re-syncs, for /status and the dashboard.
    events: collections.deque[tuple[float, str]] = field(default_factory=lambda: collections.deque(maxlen=EVENTS_KEPT))

    def usable(self, min_version: int, now: float) -> bool:
        return (
            self.state == OK
            and not self.syncing
            and self.version is not None
            and self.version >= min_version
            and now >= self.cooldown_until
        )

    @property
    def syncing(self) -> bool:
        """Whether a weight sync of ours is working on this server now (it gets no new work)."""
        return self.held_since is not None

    def hold(self, syncing: bool) -> None:
        """A weight sync of ours starts (True) or ends (False) on this server."""
        now = time.monotonic()
        if syncing and self.held_since is None:
            self.held_since = now
        elif not syncing and self.held_since is not None:
            self.held_seconds += now - self.held_since
            self.held_since = None

    def held(self) -> float:
        """Seconds our weight syncs have held this server, the one running now included."""
        return self.held_seconds + (time.monotonic() - self.held_since if self.held_since is not None else 0.0)

    def set_state(self, state: str, reason: str | None = None) -> bool:
        """Move to `state`; True when that is a change (it is then logged and kept as an event)."""
        changed = state != self.state or reason != self.reason
        if state != self.state:
            detail = f": {reason}" if reason else (f" at version {self.version}" if state == OK else "")
            self.note(f"{self.state} -> {state}{detail}")
            (log.info if state == OK else log.warning)("inference server %s: %s -> %s%s", self.url, self.state,
                                                       state, f" ({reason})" if reason else "")
        self.state, self.reason = state, reason
        return changed

    def note(self, event: str) -> None:
        self.events.append((time.time(), event))

    def describe(self) -> str:
        text = f"{self.url} ({self.state}, version {self.version}"
        if self.syncing:
            text += ", syncing"
        if self.reason:
            text += f": {self.reason}"
        elif self.last_error:
            text += f", last error: {self.last_error}"
        return text + ")"

    def snapshot(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "version": self.version,
            "state": self.state,
            "reason": self.reason,
            "in_rotation": self.state == OK and not self.syncing,
            "healthy": self.state == OK and self.consecutive_failures == 0,
            "syncing": self.syncing,
            "outstanding": self.outstanding,
            "requests": self.requests,
            "failures": self.failures,
            "error": self.last_error,
            "last_sync_seconds": self.last_sync_seconds,
            "resyncs": self.resyncs,
            "reload_method": self.reload_method,
            "adapter": self.adapter,
            "probe": self.last_probe.model_dump() if self.last_probe else None,
            "probe_failures": self.probe_failures,
            "foreign_pauses": self.foreign_pauses,
            "added_at": self.added_at,
            "events": [{"at": at, "event": text} for at, text in self.events],
        }


@dataclass
class PoolStats:
    retries: int = 0
    errors: int = 0
    backwards: int = 0  # answers dropped because their server had lost its weights


def _as_is(answer: Any, _version: int | None) -> Any:
    return answer


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
        seconds_per_token: float | None = None,
        request_floor: float = 60.0,
    ):
        self._servers: dict[str, Server] = {}
        for url in urls:
            self.add(url)
        self.semaphore = asyncio.Semaphore(max_concurrency)
        self.request_timeout = request_timeout
        # A request's own bound: `request_floor` + `seconds_per_token` x its max_tokens, at
        # most `request_timeout` (None: request_timeout for every request). See budget().
        self.seconds_per_token = seconds_per_token
        self.request_floor = request_floor
        self.retries = retries
        self.http = http
        self.stats = PoolStats()
        self.in_flight = 0
        # Set at shutdown: a request finds no usable server -> fail at once, do not wait.
        self.closing = False
        self._changed = asyncio.Event()
        # Called whenever a server's version or state changes, so waiters elsewhere re-check.
        self.on_version_change = on_version_change
        # Called with (server, reason) when a server's answers say it lost its weights.
        self.on_suspect: Callable[[Server, str], None] | None = None
        # session id -> url of the server its earlier turns went to (session affinity).
        self.sessions: dict[str, str] = {}
        # Since when requests have found no usable server (None while they find one).
        self.blocked_since: float | None = None
        self.blocked_version: int | None = None
        # The HTTP requests in flight, by server URL, so that `abandon` can cut them short.
        self._sending = Cuttable()

    # --- membership ----------------------------------------------------------------------

    @property
    def servers(self) -> list[Server]:
        return list(self._servers.values())

    def find(self, url: str) -> Server | None:
        return self._servers.get(url.rstrip("/"))

    def add(self, url: str) -> Server:
        url = url.rstrip("/")
        server = self._servers.get(url)
        if server is None:
            server = self._servers[url] = Server(url)
        return server

    def remove(self, url: str) -> Server | None:
        server = self._servers.pop(url.rstrip("/"), None)
        self.changed()
        return server

    # --- versions and states ---------------------------------------------------------------

    def in_rotation(self) -> list[Server]:
        return [s for s in self._servers.values() if s.state == OK]

    def min_version(self) -> int | None:
        """The oldest version among servers in rotation (None if one has no known version)."""
        servers = self.in_rotation()
        versions = [s.version for s in servers if s.version is not None]
        return min(versions) if servers and len(versions) == len(servers) else None

    def max_version(self) -> int | None:
        """The newest version any server in rotation serves."""
        versions = [s.version for s in self.in_rotation() if s.version is not None]
        return max(versions) if versions else None

    def changed(self) -> None:
        """Wake requests waiting for a usable server, and whoever watches versions."""
        self._changed.set()
        self._changed = asyncio.Event()
        if self.on_version_change is not None:
            self.on_version_change()

    def set_version(self, url: str, version: int | None) -> None:
        server = self.find(url)
        if server is not None:
            server.version = version
        self.changed()

    def set_state(self, server: Server, state: str, reason: str | None = None) -> None:
        if server.set_state(state, reason):
            self.changed()

    def suspect(self, server: Server, reason: str) -> None:
        """Out of rotation at once; the fleet finds out what happened to it."""
        if server.state == OK:
            self.set_state(server, DOWN, reason)
        if self.on_suspect is not None:
            self.on_suspect(server, reason)

    def unavailable_reason(self, min_version: int) -> str | None:
        """Why no server can take a request that needs `min_version`, or None when one can."""
        now = time.monotonic()
        if any(s.usable(min_version, now) or (s.state == OK and s.syncing) for s in self._servers.values()):
            return None
        if not self._servers:
            return "the sampler has no inference servers: add one with POST /inference_servers"
        return (f"no inference server in rotation serves version >= {min_version}: "
                + "; ".join(s.describe() for s in self._servers.values()))

    # --- requests --------------------------------------------------------------------------

    def _pick(self, min_version: int, session: str | None = None) -> Server | None:
        now = time.monotonic()
        if session is not None:
            bound = self._servers.get(self.sessions.get(session, ""))
            if bound is not None:
                if bound.usable(min_version, now):
                    return bound
                if bound.state == OK and bound.syncing and (bound.version or 0) >= min_version:
                    return None  # a weight sync is short: wait for the server holding the conversation
        usable = [s for s in self._servers.values() if s.usable(min_version, now)]
        if not usable:
            return None
        best = min(usable, key=lambda s: (s.outstanding, s.consecutive_failures))
        if session is not None:
            self.sessions[session] = best.url
        return best

    async def usable(self, min_version: int = 0) -> Server:
        """A server that could take a request now, waiting for one as a request would (at
        most `request_timeout`; `InferenceUnavailable` then)."""
        return await self._wait_for_server(min_version, time.monotonic() + self.request_timeout)

    def release(self, session: str) -> None:
        """The trajectory `session` ended: forget its server."""
        self.sessions.pop(session, None)

    async def _wait_for_server(self, min_version: int, deadline: float, session: str | None = None) -> Server:
        """A usable server, waiting through cooldowns, syncs and re-syncs until `deadline`."""
        while True:
            server = self._pick(min_version, session)
            if server is not None:
                self.blocked_since = None
                return server
            now = time.monotonic()
            if self.blocked_since is None:
                self.blocked_since, self.blocked_version = now, min_version
            if now >= deadline or self.closing:
                raise InferenceUnavailable(self.unavailable_reason(min_version)
                                           or f"no inference server serves version >= {min_version}")
            cooling = [s.cooldown_until - now for s in self._servers.values() if s.cooldown_until > now]
            wait = min(cooling + [deadline - now, 1.0])
            await wait_event(self._changed, max(wait, 0.01))

    async def post(self, path: str, body: dict[str, Any], *, min_version: int = 0,
                   parse: Callable[[dict[str, Any], int | None], T] = _as_is,
                   session: str | None = None) -> tuple[T, Server]:
        """POST to the best server. `parse(answer, version)` turns the JSON answer into the
        caller's result (by default the JSON itself); `version` is what the server served when the request was sent (the
        oldest version that can have produced the answer). `parse` raises `WentBackwards`
        when the answer shows older weights than that: the server is then suspected and the
        request retried elsewhere. `session` names a multi-turn trajectory (session affinity)."""
        async with self.semaphore:
            self.in_flight += 1
            try:
                return await self._post_with_retries(path, body, min_version, parse, session)
            finally:
                self.in_flight -= 1

    async def _post_with_retries(self, path: str, body: dict[str, Any], min_version: int,
                                 parse: Callable[[dict[str, Any], int | None], T],
                                 session: str | None) -> tuple[T, Server]:
        attempts = self.retries + 1
        deadline = time.monotonic() + self.request_timeout
        failures: list[str] = []
        headers = {"X-Session-ID": session} if session is not None else None
        for attempt in range(attempts):
            server = await self._wait_for_server(min_version, deadline, session)
            dispatched = server.version
            # A LoRA run's policy is the adapter: whatever model the caller named, the server
            # computes with the adapter it serves the version through.
            payload = body if server.adapter is None else {**body, "model": server.adapter}
            server.outstanding += 1
            server.requests += 1
            dropped = False
            try:
                response = await self._send(server, path, payload, headers)
            except TransportError as exc:
                error = str(exc)
                dropped = not error.startswith("TimeoutError")
            else:
                if response.status_code < 400:
                    try:
                        result = parse(response.json(), dispatched)
                    except WentBackwards as exc:
                        self.stats.backwards += 1
                        failures.append(f"{server.url}: {exc}")
                        self.suspect(server, str(exc))
                        continue
                    server.consecutive_failures = 0
                    server.cooldown_until = 0.0
                    server.last_error = None
                    return result, server
                if response.status_code < 500:
                    raise InferenceRequestError(
                        f"{server.url}{path} answered {response.status_code}: {response.text[:500]}"
                    )
                error = f"HTTP {response.status_code}: {response.text[:200]}"
            finally:
                server.outstanding -= 1
                if server.outstanding == 0 and server.state == LEAVING:
                    self.changed()  # a DELETE waits for the last request to finish
            server.failures += 1
            server.consecutive_failures += 1
            server.last_error = error
            # Back off this server exponentially; others keep working meanwhile.
            backoff = min(0.05 * 2 ** server.consecutive_failures, 5.0)
            server.cooldown_until = time.monotonic() + backoff
            self.stats.errors += 1
            failures.append(f"{server.url}: {error}")
            if dropped and self.on_suspect is not None:
                # Refused or dropped: the server may be gone; the fleet checks it now.
                self.on_suspect(server, error)
            if attempt + 1 < attempts:
                self.stats.retries += 1
                log.warning("inference request to %s failed (%s); retry %d/%d", server.url, error, attempt + 1, self.retries)
        raise InferenceUnavailable(f"inference request failed after {attempts} attempts: " + "; ".join(failures[-3:]))

    def budget(self, payload: dict[str, Any]) -> float:
        """Seconds one request may take, from what it asks for: `request_floor` (queueing, the
        prompt's prefill) plus `seconds_per_token` for each token it may generate, never more
        than the flat `request_timeout`. A request that names no max_tokens gets the flat bound."""
        sampling = payload.get("sampling_params")
        asked = payload.get("max_tokens") or payload.get("max_completion_tokens") or (
            sampling.get("max_tokens") if isinstance(sampling, dict) else None)
        if self.seconds_per_token is None or not isinstance(asked, int) or asked <= 0:
            return self.request_timeout
        return min(self.request_timeout, self.request_floor + self.seconds_per_token * asked)

    async def _send(self, server: Server, path: str, payload: dict[str, Any],
                    headers: dict[str, str] | None) -> Reply:
        """One HTTP request to `server`, in a task of its own so that `abandon` can cancel it
        without cancelling the trajectory that waits for it."""
        request = asyncio.ensure_future(self._bounded(server, path, payload, headers))
        try:
            return await self._sending.run(server.url, request)
        except Abandoned as exc:
            raise TransportError(f"Abandoned: {exc.why}") from None

    async def _bounded(self, server: Server, path: str, payload: dict[str, Any],
                       headers: dict[str, str] | None) -> Reply:
        """The request, cut off once it has taken its `budget`: a server that answers health
        checks but never finishes a request (a wedged engine) costs that, not `request_timeout`.
        Time a weight sync of ours held the server paused is not charged: the request was
        frozen by our pause, not slow."""
        budget = self.budget(payload)
        call = asyncio.ensure_future(self.http.request("POST", server.url + path, json=payload, headers=headers,
                                                       timeout=self.request_timeout))
        started, held = time.monotonic(), server.held()
        try:
            while True:
                left = started + budget + (server.held() - held) - time.monotonic()
                if left <= 0:
                    raise TransportError(f"TimeoutError: no answer from {server.url}{path} within its budget of "
                                         f"{budget:g} s (request_floor + seconds_per_token x max_tokens)")
                done, _ = await asyncio.wait({call}, timeout=left)
                if done:
                    return call.result()
        finally:
            if not call.done():
                call.cancel()

    def abandon(self, server: Server, why: str) -> int:
        """Cut every request in flight to `server`: each fails as a dropped one does and is
        retried on another server (a multi-turn trajectory moves to the server it is retried
        on, as when its server dies). The number cut."""
        return self._sending.abandon(server.url, why)

    async def wait_idle(self, server: Server, timeout: float) -> bool:
        """Wait until `server` has no request outstanding, at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while server.outstanding > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await wait_event(self._changed, min(left, 0.5))
        return True

    async def get(self, url: str, path: str, timeout: float = 10.0) -> Reply:
        return await self.http.get(url + path, timeout=timeout)
