"""Liveness: whether an inference server answers at all, judged apart from the work it does.

The fleet (fleet/members.py) asks every server `GET /is_paused` (vLLM's dev-mode route; Tandem's CPU
server has the same) every `server_check_interval` seconds, and at once when a sync to it
starts, whatever it is doing: generating, syncing, being probed or re-synced. A server without
the route (vLLM outside dev mode) is asked `GET /health` instead. What the answer decides:

* no answer within `server_check_timeout` (a frozen process: its sockets accept connections,
  nothing answers), or no connection at all: the server leaves rotation ("down", the reason
  naming what it was doing), the requests in flight to it are cut and retried on other servers
  (InferencePool.abandon), and a sync to it is abandoned (WeightSync.abandon), so a publication
  answers with the servers that did answer. When it answers again the fleet re-syncs it.
* an answer saying it is paused while no sync holds it, for `paused_grace` seconds in a row
  (someone else paused it: it answers but does no work): out of rotation, resumed, logged and
  counted (`foreign_pauses`). A sync of another sampler replica holds it too: its record in
  Redis says until when (WeightSync.record). The grace leaves alone a trainer that pauses the
  servers to push its weights itself, and an operator's short pause.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from services.sampler.fleet.inference_pool import DOWN, JOINING, OK, RESYNCING, InferencePool, Server
from services.sampler.storage.store import Store
from services.sampler.fleet.weight_sync import SyncStepError, WeightSync
from shared.http_client import TransportError

log = logging.getLogger("tandem.sampler.liveness")


@dataclass
class Pulse:
    """What one liveness check found."""

    answered: bool
    paused: bool | None = None  # None: it cannot say (no /is_paused, or an error answer)
    error: str | None = None  # without an answer: what happened, in words


class Liveness:
    def __init__(self, pool: InferencePool, sync: WeightSync, store: Store, *, timeout: float,
                 paused_grace: float = 60.0):
        self.pool = pool
        self.sync = sync
        self.store = store
        self.timeout = timeout
        self.paused_grace = paused_grace
        self._paused_since: dict[str, float] = {}  # url -> when it was first found paused by someone else
        self._without_is_paused: set[str] = set()  # servers that answered /is_paused 404: /health for them

    async def pulse(self, server: Server) -> Pulse:
        path = "/health" if server.url in self._without_is_paused else "/is_paused"
        try:
            reply = await self.pool.http.get(server.url + path, timeout=self.timeout)
        except TransportError as exc:
            text = str(exc)
            if text.startswith("TimeoutError"):
                return Pulse(False, error=f"no answer to GET {path} for {self.timeout:g} s")
            return Pulse(False, error=f"GET {path} failed: {text}")
        if reply.status_code == 404 and path == "/is_paused":
            self._without_is_paused.add(server.url)
            return await self.pulse(server)
        if path == "/is_paused" and reply.status_code == 200:
            try:
                body = reply.json()
            except ValueError:
                return Pulse(True)
            return Pulse(True, paused=bool(body.get("is_paused")) if isinstance(body, dict) else None)
        return Pulse(True)  # any HTTP answer shows a live process; the label check judges the rest

    async def check(self, server: Server, *, busy: bool) -> bool:
        """Judge `server`; False when it did not answer (it then left rotation, its work
        abandoned) or was found paused and could not be resumed. `busy`: the fleet is
        working on it (joining, leaving, re-syncing), so its state is the fleet's to set."""
        pulse = await self.pulse(server)
        if not pulse.answered:
            await self.lose(server, pulse.error or "no answer", keep_state=busy and server.state == JOINING)
            return False
        if not (pulse.paused and not busy and not self.sync.holds_pause(server)
                and not await self._held_elsewhere(server)):
            self._paused_since.pop(server.url, None)
            return True
        since = self._paused_since.setdefault(server.url, time.monotonic())
        if time.monotonic() - since < self.paused_grace:
            return True  # perhaps a trainer pushing its weights: left alone, and in rotation, for now
        del self._paused_since[server.url]
        return await self._resume_foreign(server)

    def doing(self, server: Server) -> str:
        """What `server` was doing, in words (for the reason it left rotation)."""
        version = self.sync.syncing_version(server)
        if version is not None:
            return f"syncing version {version}" + (
                f" with {server.outstanding} request(s) in flight" if server.outstanding else "")
        if server.outstanding:
            return f"generating ({server.outstanding} request(s) in flight)"
        return "idle"

    async def lose(self, server: Server, error: str, *, keep_state: bool = False) -> None:
        """`server` did not answer: out of rotation, its requests and its sync abandoned."""
        why = f"{error} while {self.doing(server)}"
        abandoned = self.sync.abandon(server, why)
        cut = self.pool.abandon(server, why)
        server.last_error = why
        if not keep_state and server.state in (OK, JOINING, RESYNCING):
            self.pool.set_state(server, DOWN, why)
        elif not (abandoned or cut):
            return  # already out of rotation, nothing of ours waiting on it: nothing new to say
        log.warning("inference server %s: %s; %s%d request(s) in flight moved to other servers", server.url, why,
                    "its weight sync abandoned, " if abandoned else "", cut)
        if self.pool.find(server.url) is server:  # a server that left the run has no record to keep
            await self.sync.record(server)

    async def _held_elsewhere(self, server: Server) -> bool:
        """Whether another sampler replica's sync holds `server` paused (its record says so)."""
        record = (await self.store.servers()).get(server.url) or {}
        until = record.get("syncing_until")
        return isinstance(until, (int, float)) and until > time.time()

    async def _resume_foreign(self, server: Server) -> bool:
        """Someone else paused `server`: no work gets done there. Take it out of rotation and
        resume it; True when it is resumed (the label check then puts it back)."""
        server.foreign_pauses += 1
        why = f"paused (GET /is_paused) for {self.paused_grace:g} s or more with no weight sync of this run holding it"
        log.warning("inference server %s is %s: resuming it (%d time(s) so far)", server.url, why,
                    server.foreign_pauses)
        if server.state == OK:
            self.pool.set_state(server, DOWN, why)
        try:
            await self.sync.resume_once(server)
        except SyncStepError as exc:
            server.last_error = f"{why}; POST /resume failed: {exc}"
            await self.sync.record(server)
            return False
        server.note(f"resumed: it was {why}")
        return True
