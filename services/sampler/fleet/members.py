"""Which inference servers the run uses, and whether each can be trusted with work.

Membership lives in Redis (`Keys.members`): `inference_urls` seeds it the first time a run
starts, `POST /inference_servers` adds a server and `DELETE /inference_servers` removes one,
so a restarted sampler, or a second replica, uses the same set. Every replica follows
changes announced on the events channel.

Each server has a state (inference_pool.py): only "ok" servers get work. A monitor asks
every server `GET /weight_info` every `server_check_interval` seconds (one that is down every
0.25 s, so a server starting beside the sampler gets work as soon as it answers), and at once when a
request to it was refused or dropped or its answers showed older weights than it was
synced to. What the label says decides:

* the expected version: nothing to do (a server that was "down" goes back into rotation);
* a newer version, up to the published one: another replica synced it; adopt the label;
* an older version, or no version at all (vLLM's "default" after a restart): the server
  restarted and lost its weights. It stays out of rotation while the latest published
  checkpoint is loaded into it with the usual sync (pause, reload, label, reset cache,
  resume), then goes back. When the latest version has no `checkpoint_path` (the trainer
  pushed the weights itself), the sampler cannot do that: the server is "stale", and
  /status, the dashboard and, after `generation_deadline`, `GET /batch`'s 503 say why.
* no answer: "down" until it answers again.

Liveness is judged apart from the work a server does (liveness.py): a server that is
generating, syncing or being re-synced is still asked `GET /is_paused` at every check, and one
that does not answer within `server_check_timeout` leaves rotation whatever it was doing, its
requests retried elsewhere and its sync abandoned; it is re-synced when it answers again.

One replica re-syncs a given server at a time (a Redis lease); the others adopt its label.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from services.sampler.fleet.inference_pool import (
    DOWN, JOINING, LEAVING, MISMATCH, OK, RESYNCING, STALE, InferencePool, Server,
)
from services.sampler.fleet.liveness import Liveness
from services.sampler.storage.notify import Notifier
from services.sampler.storage.redis_link import is_outage
from shared.aio import wait_any
from services.sampler.storage.store import Store
from services.sampler.fleet.weight_sync import SyncStepError, WeightSync, parse_version_label
from shared.http_client import TransportError

log = logging.getLogger("tandem.sampler.fleet")

HEAL_LEASE_MS = 120_000
MAX_HEAL_BACKOFF = 60.0


class JoinRefused(Exception):
    """POST /inference_servers could not bring the server to the published version."""

    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(message)


DOWN_RECHECK_S = 0.25


class Label:
    """What GET /weight_info said: reachable or not, and the version label if it has one."""

    def __init__(self, reachable: bool, version: int | None = None, raw: Any = None,
                 supported: bool = True, error: str | None = None):
        self.reachable, self.version, self.raw, self.supported, self.error = reachable, version, raw, supported, error

    def describe(self) -> str:
        return f"version {self.version}" if self.version is not None else f"label {self.raw!r}"


class Fleet:
    def __init__(self, pool: InferencePool, store: Store, sync: WeightSync, notifier: Notifier, *,
                 initial_urls: list[str], owner: str, check_interval: float = 2.0,
                 check_timeout: float = 10.0, paused_grace: float = 60.0):
        self.pool = pool
        self.store = store
        self.sync = sync
        self.notifier = notifier
        self.initial_urls = [u.rstrip("/") for u in initial_urls]
        self.owner = owner
        self.check_interval = check_interval
        self.check_timeout = check_timeout
        self._next_check: dict[str, float] = {}
        self._check_done = asyncio.Event()  # wakes the loop to schedule that server's next check
        self._heal_backoff: dict[str, float] = {}
        self._suspects: set[str] = set()
        self._joining: set[str] = set()  # urls a POST /inference_servers of ours is bringing up
        self._work: dict[str, asyncio.Task] = {}  # url -> its re-sync or leave in progress
        self._members_seen: tuple[int, int] | None = None  # the notifier's "servers" generation last read
        self._members_due = 0.0  # when membership is re-read anyway
        self.liveness = Liveness(pool, sync, store, timeout=check_timeout, paused_grace=paused_grace)
        pool.on_suspect = self.suspect
        sync.on_start = lambda server: self.suspect(server, "a weight sync started")  # is it alive?

    # --- membership ------------------------------------------------------------------------

    async def start(self) -> None:
        """Seed membership from `inference_urls` (first start of a run only) and load it."""
        await self.store.seed_members(self.initial_urls)
        members = await self.store.members()
        removed = [u for u in self.initial_urls if (members.get(u) or {}).get("removed_at")]
        for url in removed:
            log.warning("%s is in inference_urls but was removed from this run (DELETE /inference_servers); "
                        "POST /inference_servers to add it back", url)
        await self._refresh(members)

    async def _refresh(self, members: dict[str, dict[str, Any]] | None = None) -> None:
        """Follow the membership in Redis: servers another replica added or removed."""
        if members is None:
            members = await self.store.members()
        if not members and self.pool.servers:
            # A run's membership is never empty once seeded (removed servers keep their entry):
            # a restarted Redis lost it. Keep serving with the servers we have, and write them back.
            await self.restore_members()
            return
        active = {url for url, m in members.items() if not m.get("removed_at")}
        for url in sorted(active):
            if self.pool.find(url) is None:
                server = self.pool.add(url)
                server.note("member of the run")
                self._next_check[url] = 0.0
        for server in self.pool.servers:
            if server.url not in active and server.url not in self._joining and server.state != LEAVING:
                self._start_work(server, self._drop(server, "removed from the run", self.check_timeout))

    async def restore_members(self) -> str | None:
        """After a Redis restart that lost the membership: write back the servers this replica
        uses (a server removed before the restart is not among them, so it stays out)."""
        urls = [s.url for s in self.pool.servers if s.state != LEAVING]
        if not urls or await self.store.members():
            return None
        await self.store.seed_members(urls)
        log.warning("the run's inference server membership was missing from Redis (restarted?); wrote back %s", urls)
        return f"wrote back the membership ({len(urls)} server(s))"

    async def join(self, url: str) -> Server:
        """Bring a new server to the published version, then put it into the run and rotation."""
        url = url.rstrip("/")
        existing = self.pool.find(url)
        if existing is not None and existing.state != LEAVING and url not in self._joining:
            return existing  # already a member: adding it again changes nothing
        if url in self._joining:
            raise JoinRefused(409, f"{url} is already being added; wait for that request to finish")
        if existing is not None:
            raise JoinRefused(409, f"{url} is still leaving the run; add it again once it has left")
        self._joining.add(url)
        server = self.pool.add(url)
        server.note("joining (POST /inference_servers)")
        try:
            label = await self._read_label(server)
            if not label.reachable:
                raise JoinRefused(422, f"{url} does not answer GET /weight_info: {label.error}")
            async with self.sync.lock:
                meta = await self.store.meta()
                await self._bring_to(server, label, meta["version"], meta["checkpoint_path"], meta["adapter"])
            await self.store.add_member(url)
            self.pool.set_state(server, OK)
            await self.sync.record(server)
            log.info("inference server %s joined the run at version %s", url, server.version)
            return server
        except BaseException:
            if self.pool.find(url) is server:
                self.pool.remove(url)
            raise
        finally:
            self._joining.discard(url)

    async def _bring_to(self, server: Server, label: Label, published: int, checkpoint: str | None,
                        adapter: bool = False) -> None:
        """Make a joining server serve `published`, or refuse it with the reason. In a LoRA run
        (the published version is an adapter) the adapter is loaded whatever the label says:
        a label alone cannot tell that the server holds the adapter under the run's name."""
        if (label.version == published and not adapter) or (not label.supported and checkpoint is None):
            server.version = published
            return
        if label.version is None and published == 0 and checkpoint is None:
            await self._relabel(server, 0)  # a fresh server's base weights are version 0
            server.version = 0
            return
        if checkpoint is None:
            raise JoinRefused(409, (
                f"{server.url} serves {label.describe()}, but version {published} was published without a "
                "checkpoint_path (the trainer pushed the weights itself), so the sampler cannot load it: "
                f"load version {published}'s weights into the server, label it (POST {server.url}"
                f"/update_weight_version {{\"new_version\": \"{published}\"}}) and add it again"))
        result = await self.sync.sync_server(server, published, checkpoint, await self.store.probe(), adapter=adapter)
        if not result.ok:
            raise JoinRefused(422, f"{server.url} could not load version {published} from {checkpoint!r}: {result.error}")

    async def leave(self, url: str, timeout: float) -> dict[str, Any]:
        """Remove a server from the run. Nothing new goes to it; requests in flight finish
        (or, if it dies, are retried on other servers). Waits up to `timeout` seconds for them."""
        url = url.rstrip("/")
        removed = await self.store.remove_member(url)
        server = self.pool.find(url)
        if server is None:
            return {"url": url, "removed": removed, "outstanding": 0, "drained": True}
        running = self._work.get(url)
        if running is not None and not running.done():
            running.cancel()  # a re-sync of a server that is leaving is pointless
            await asyncio.gather(running, return_exceptions=True)
        work = self._start_work(server, self._drop(server, "removed by DELETE /inference_servers", timeout))
        outstanding = await asyncio.shield(work)
        return {"url": url, "removed": True, "outstanding": outstanding, "drained": outstanding == 0}

    async def _drop(self, server: Server, why: str, timeout: float) -> int:
        self.pool.set_state(server, LEAVING, why)
        drained = await self.pool.wait_idle(server, timeout)
        left = server.outstanding
        if not drained:
            log.warning("%s left with %d request(s) still in flight (they finish or are retried elsewhere)",
                        server.url, left)
        if self.pool.find(server.url) is server:
            self.pool.remove(server.url)
        await self.store.forget_server(server.url)
        log.info("inference server %s left the run (%s)", server.url, why)
        return left

    # --- monitoring --------------------------------------------------------------------------

    def suspect(self, server: Server, reason: str) -> None:
        """Check `server` at once (a request to it was refused or dropped, or it lost its weights)."""
        if server.url not in self._suspects:
            self._suspects.add(server.url)
            self.notifier.notify()

    async def run(self) -> None:
        """Check every server every `check_interval` seconds, suspects at once. Each check runs
        as a task of its own: a server that does not answer holds up its own next check for
        up to `check_timeout`, never another server's."""
        checking: dict[str, asyncio.Task] = {}
        failed: list[BaseException] = []  # a Redis outage seen by a check: the loop raises it
        try:
            while True:
                changed = self.notifier.changed()
                self._check_done.clear()  # taken first, as `changed`: a check ending from here on wakes the wait
                if failed:
                    raise failed[0]  # the supervisor waits for Redis, then starts this loop again
                now = time.monotonic()
                # Membership changes are announced ("servers"): re-read only then, and once per
                # check_interval besides (this loop wakes at every seal and publication).
                seen = self.notifier.generation("servers")
                if seen != self._members_seen or now >= self._members_due:
                    await self._refresh()
                    self._members_seen, self._members_due = seen, now + self.check_interval
                for server in self.pool.servers:
                    url = server.url
                    if url in checking or not (url in self._suspects or now >= self._next_check.get(url, 0.0)):
                        continue  # a suspect whose check is still running is checked again after it
                    self._suspects.discard(url)
                    self._next_check[url] = now + self.check_interval  # sooner if it is found down (_checked)
                    task = checking[url] = asyncio.create_task(self._check(server), name=f"check {url}")
                    task.add_done_callback(lambda t, url=url: self._checked(url, t, checking, failed))
                waits = [self._next_check.get(s.url, 0.0) for s in self.pool.servers if s.url not in checking]
                wake = min(waits, default=now + self.check_interval)
                await wait_any([changed, self._check_done], max(wake - time.monotonic(), 0.01))
        finally:
            for task in checking.values():
                task.cancel()

    def _checked(self, url: str, task: asyncio.Task, checking: dict[str, asyncio.Task],
                 failed: list[BaseException]) -> None:
        if checking.get(url) is task:
            del checking[url]
        server = self.pool.find(url)
        if server is not None and server.state == DOWN:
            # Asked again in DOWN_RECHECK_S, not check_interval: a server starting beside the
            # sampler (the demo, compose) goes into rotation within a quarter of a second of
            # answering. Cheap: a refused connection costs a millisecond, and a server that
            # accepts and does not answer holds its own next check back for check_timeout.
            self._next_check[url] = min(self._next_check.get(url, 0.0), time.monotonic() + DOWN_RECHECK_S)
        self._check_done.set()
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        if is_outage(exc):
            failed.append(exc)
            self.notifier.notify()
        else:
            log.warning("checking %s failed: %r", url, exc)

    async def _read_label(self, server: Server) -> Label:
        try:
            reply = await self.pool.http.get(server.url + "/weight_info", timeout=self.check_timeout)
            if reply.status_code == 404:
                # No dev-mode endpoints: the server cannot say what it serves, only that it is up.
                health = await self.pool.http.get(server.url + "/health", timeout=self.check_timeout)
                if health.status_code >= 400:
                    return Label(False, error=f"GET /health answered {health.status_code}")
                return Label(True, supported=False)
            if reply.status_code >= 400:
                return Label(False, error=f"GET /weight_info answered {reply.status_code}: {reply.text[:200]}")
            body = reply.json()
        except (TransportError, ValueError) as exc:
            return Label(False, error=str(exc))
        raw = body.get("weight_version", body) if isinstance(body, dict) else body
        return Label(True, parse_version_label(body), raw)

    def _busy(self, server: Server) -> bool:
        """Whether a join, leave, re-sync or sync is working on `server` (its label is theirs to read)."""
        return server.url in self._joining or server.url in self._work or server.state == LEAVING or server.syncing

    async def _check(self, server: Server) -> None:
        if not await self.liveness.check(server, busy=self._busy(server)) or self._busy(server):
            return
        known = server.version
        label = await self._read_label(server)
        if not label.reachable:
            server.last_error = label.error
            if server.state in (OK, JOINING):
                self.pool.set_state(server, DOWN, f"not answering: {label.error}")
                await self.sync.record(server)
            return
        meta = await self.store.meta()
        if self._busy(server) or server.version != known:
            # A sync, or a trainer's push (record_pushed), moved it while its label was read:
            # that label is older than what we know now. The next check reads a fresh one.
            return
        await self._reconcile(server, label, meta["version"], meta["checkpoint_path"], meta["adapter"])

    async def _reconcile(self, server: Server, label: Label, published: int, checkpoint: str | None,
                         adapter: bool = False) -> None:
        """Decide what a server that answered needs, from its label (see the module doc)."""
        if server.needs_resync is not None:
            # A sync to it was abandoned when it stopped answering: whatever its label says, it
            # may hold half-loaded weights and be paused. The re-sync loads and resumes it.
            if checkpoint is not None:
                self._heal(server, f"answering again after {server.needs_resync}")
                return
            server.needs_resync = None  # nothing to reload (the trainer pushed the weights): resume it
            try:
                await self.sync.resume_once(server)
            except SyncStepError as exc:
                log.warning("resuming %s after an abandoned sync failed: %s", server.url, exc)
                return
        known = server.version
        if not label.supported:
            # It cannot tell us its version: trust the published one, as on first contact.
            if known is None:
                server.version = published
            if server.state in (JOINING, DOWN):
                self.pool.set_state(server, OK)
                await self.sync.record(server)
            return
        if label.version is not None and label.version > published:
            if known is not None:
                # A publication is in flight (a sync labels servers before the version is
                # published, possibly by another replica): look again next time.
                return
            log.warning("%s is labelled version %d, above this run's published %d (a label from another "
                        "run?); relabelling it %d", server.url, label.version, published, published)
            await self._relabel(server, published)
            label.version = published
        if server.state == MISMATCH:
            return  # its weights are wrong whatever its label says; only a verified sync clears it
        restarted = label.version is None or (known is not None and label.version < known)
        if restarted and label.version is None and published == 0 and checkpoint is None:
            # Base weights are version 0 and nothing was ever published: only the label is missing.
            await self._relabel(server, 0)
            label.version, restarted = 0, False
        if not restarted and label.version is not None:
            if label.version >= published:
                # Synced by this process, another replica or before a restart: in a LoRA run a
                # server at the published version serves it through the run's adapter.
                server.adapter = self.sync.served_through(label.version, adapter)
                if known != label.version:
                    server.version = label.version
                    self.pool.changed()
                if server.state != OK:
                    self.pool.set_state(server, OK)
                    await self.sync.record(server)
                return
            if checkpoint is None:
                # Behind, and nothing to load: it serves older weights than the run has.
                self._stale(server, f"serves version {label.version}, but version {published} was published "
                            "without a checkpoint_path, so the sampler cannot load it")
                await self.sync.record(server)
                return
            # Behind, with a checkpoint to load: catch it up below.
        why = (f"restarted: serves {label.describe()} instead of version {known}" if restarted and known is not None
               else f"serves {label.describe()}, published is version {published}")
        if restarted:
            # What it serves is not what we recorded: no work for it until it is re-synced.
            server.version = None
            server.reload_method = None  # it may have been started differently
            server.adapter = None  # and a restarted server holds no adapter
            self.pool.set_state(server, RESYNCING, why)
            await self.sync.record(server)
        self._heal(server, why)

    def _stale(self, server: Server, why: str) -> None:
        server.version = None
        self.pool.set_state(server, STALE, why + (
            ": publish a checkpoint_path, load the weights into the server and label it, "
            "or remove it (DELETE /inference_servers)"))

    async def _relabel(self, server: Server, version: int) -> None:
        try:
            await self.sync.relabel(server, version)
        except SyncStepError as exc:
            log.warning("relabelling %s as version %d failed: %s", server.url, version, exc)

    # --- self-healing --------------------------------------------------------------------------

    def _start_work(self, server: Server, coro: Any) -> asyncio.Task:
        running = self._work.get(server.url)
        if running is not None and not running.done():
            coro.close()
            return running
        task = asyncio.create_task(coro, name=f"fleet {server.url}")
        self._work[server.url] = task
        task.add_done_callback(lambda t, url=server.url: self._work.pop(url, None) if self._work.get(url) is t else None)
        task.add_done_callback(self._work_done)
        return task

    @staticmethod
    def _work_done(task: asyncio.Task) -> None:
        """A re-sync or leave that failed is tried again at the server's next check; say why once
        (an unreachable Redis is the link's to report)."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        if not is_outage(exc):
            log.error("%s failed: %s: %s", task.get_name(), type(exc).__name__, exc)

    def _heal(self, server: Server, why: str) -> None:
        if time.monotonic() < self._heal_backoff.get(server.url, 0.0):
            return
        self._start_work(server, self._resync(server, why))

    async def _resync(self, server: Server, why: str) -> None:
        if not await self.store.take_heal_lease(server.url, self.owner, HEAL_LEASE_MS):
            log.info("another sampler replica is re-syncing %s", server.url)
            return
        try:
            async with self.sync.lock:
                meta = await self.store.meta()
                published, checkpoint, adapter = meta["version"], meta["checkpoint_path"], meta["adapter"]
                label = await self._read_label(server)
                if not label.reachable:
                    self.pool.set_state(server, DOWN, f"not answering: {label.error}")
                    await self.sync.record(server)
                    return
                if label.version == published and server.state != MISMATCH and server.needs_resync is None:
                    # A publication (ours or another replica's) synced it while we waited.
                    server.version = published
                    server.adapter = self.sync.served_through(published, adapter)
                    self.pool.set_state(server, OK)
                    await self.sync.record(server)
                    return
                if checkpoint is None:
                    self._stale(server, f"{why}; version {published} was published without a checkpoint_path "
                                "(the trainer pushed the weights itself), so the sampler cannot reload it")
                    await self.sync.record(server)
                    return
                server.version = None  # what it serves is not what we recorded: no work until re-synced
                self.pool.set_state(server, RESYNCING, why)
                server.resyncs += 1
                await self.sync.record(server)
                result = await self.sync.sync_server(server, published, checkpoint, await self.store.probe(),
                                                     adapter=adapter)
            if result.ok:
                self._heal_backoff.pop(server.url, None)
                server.note(f"re-synced to version {published} in {result.seconds:.2f}s "
                            f"({server.resyncs} re-sync{'s' if server.resyncs > 1 else ''} so far)")
                self.pool.set_state(server, OK)
            elif result.unreachable and server.state == DOWN:
                pass  # it stopped answering (liveness.py said why); re-synced when it answers again
            elif not result.mismatch:  # a mismatch is its own state: only a verified sync clears it
                backoff = min(MAX_HEAL_BACKOFF, 2.0 * 2 ** min(server.resyncs, 5))
                self._heal_backoff[server.url] = time.monotonic() + backoff
                self.pool.set_state(server, STALE, f"{why}; re-sync to version {published} failed "
                                    f"({result.error}); trying again in {backoff:.0f}s")
            await self.sync.record(server)
        finally:
            try:
                await self.store.release_heal_lease(server.url, self.owner)
            except Exception:  # noqa: BLE001 - the lease expires by itself
                pass

    async def shutdown(self) -> None:
        tasks = list(self._work.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
