"""Durable sampler state in Redis: sealed batches, the published version, servers, stats.

Invariants:
* A sealed batch is a manifest in Redis (a hash: build id, chunk table, stats, and `dir`
  when its chunks are files) and its chunks (group-aligned samples, shared/chunks.py).
  With `files` (a ChunkFiles, the default) the chunks are files written and fsynced once
  (chunk_files.py), never Redis values: Redis's `appendfsync always` write path carries only
  the manifest, so it stays responsive while gigabytes are stored. Without, they are Redis
  strings written first with an expiry (chunks of a build that never sealed expire by
  themselves). Either way the chunks are durable before one Lua script writes the manifest
  only if none exists (first seal wins), records the step and announces it: a seal is
  acknowledged only when chunks and manifest are durable, a reader sees all of a batch or
  none of it, and re-sealing a step is a no-op (the loser's chunks are deleted).
* Storing a batch's chunks has a bound (`StoreFailed` past it, chunk_files.py): a write
  that cannot finish fails its attempt once, with its size and the bound, instead of
  holding Redis or the build without end.
* Readers never pop: a batch reads the same until the step is trimmed; trimming deletes a
  manifest and its Redis chunks in the same script, and its chunk files right after (a
  reader who loses that race finds a file gone and answers as for a trimmed batch).
* The published version only moves forward (compare-and-set in Lua).
* Memory is bounded: batches more than `keep_batches` behind the published version are
  deleted, except those from the trainer's resume step on (the step after its newest full
  checkpoint, sent with each version): a trainer killed at any moment finds every batch it
  must train again, and the per-batch stats stream and the publication history keep the last 256
  entries (what the dashboard plots), so Redis memory is flat after a few hundred steps.
* What this process acknowledged it can write again: the batches it sealed most recently
  (`held`; the newest always, older ones while they fit `cache_bytes`), the last version it published and the trim mark stay in memory,
  and `reverify()` writes back whatever a restarted Redis lost of them (a Redis that fsyncs
  every write loses nothing; one with `appendfsync everysec` can lose its last second).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from services.sampler.storage import store_scripts as scripts
from services.sampler.storage.chunk_files import ChunkFiles, StoreFailed, describe_bytes
from services.sampler.storage.keys import Keys
from services.sampler.storage.packing import SealedBatch, pack
from shared import codec
from shared.aio import wait_event
from shared.probe import Probe

log = logging.getLogger("tandem.sampler.store")

# Chunks of a build not yet sealed expire after this (a build that died before its seal
# leaves nothing behind); the seal script makes them permanent. A seal delayed past it (a
# long Redis outage) finds them gone (-2) and writes them again.
STAGED_TTL_MS = 3_600_000
# Bytes of chunks per round trip to Redis: fewer fsyncs under `appendfsync always` when
# writing, a bounded reply when reading.
WRITE_BYTES = 32 << 20


def _rounds(sizes: list[int]) -> list[tuple[int, int]]:
    """[start, stop) runs of consecutive items of at most WRITE_BYTES together (an item larger
    than that alone): the chunks one round trip to Redis carries."""
    runs = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > WRITE_BYTES:
            runs.append((start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        runs.append((start, len(sizes)))
    return runs


class Store:
    def __init__(self, client: aioredis.Redis, keys: Keys, stats_cap: int = 256, recent_cap: int = 4,
                 cache_bytes: int = 1 << 30, files: ChunkFiles | None = None, write_timeout: float = 120.0):
        self.r = client
        # Where chunks go: files (the bulk store), or None for Redis strings (batch_store = redis).
        self.files = files
        # The bound on storing one batch's chunks (the files' own, or this for Redis strings).
        self.write_timeout = files.timeout if files is not None else write_timeout
        # Batches this process sealed, newest last: served from memory, written back after a
        # Redis restart. The newest always stays; older ones while all fit in `cache_bytes`.
        self._recent: OrderedDict[int, SealedBatch] = OrderedDict()
        self.cache_bytes = cache_bytes
        # Seals this process has in flight: step -> future of "these bytes became the batch".
        self._sealing: dict[int, asyncio.Future[bool]] = {}
        # Steps whose batch this process has answered a GET /batch with (the recent ones).
        self._served: OrderedDict[int, asyncio.Event] = OrderedDict()
        self.recent_cap = recent_cap
        # The last version this process published (version, checkpoint_path, probe JSON, adapter) and
        # the highest trim mark it set: what `reverify` writes back after a Redis restart.
        self._acked: tuple[int, str, str, str] | None = None
        self._trim_mark = 0
        self.keys = keys
        self.stats_cap = stats_cap
        self._seal = client.register_script(scripts.SEAL)
        self._publish = client.register_script(scripts.PUBLISH)
        self._trim = client.register_script(scripts.TRIM)
        self._lease = client.register_script(scripts.LEASE)
        self._release = client.register_script(scripts.RELEASE)
        self._remove_member = client.register_script(scripts.REMOVE_MEMBER)
        self._plan_view = client.register_script(scripts.PLAN_VIEW)

    # --- batches -------------------------------------------------------------------

    async def seal(self, step: int, batch: SealedBatch, staged: Callable[[], Awaitable[None]] | None = None,
                   writing: Callable[[], Awaitable[None]] | None = None) -> int:
        """Write `batch`'s chunks, then seal it: 1 sealed now, 0 already sealed (by another
        build), -1 trimmed before it was sealed. `writing` is awaited once the first chunk is
        stored, `staged` between the last and the seal (the restart drills pause there).
        StoreFailed: the chunks could not be stored within the bound (or at all)."""
        sealed = asyncio.get_running_loop().create_future()
        self._sealing[step] = sealed
        outcome = 0
        try:
            outcome = await self._write_and_seal(step, batch, staged, writing)
            if outcome == 1:
                # Only bytes that really became the sealed batch may be served from memory.
                self._remember(step, batch)
        finally:
            if self._sealing.get(step) is sealed:
                del self._sealing[step]
            sealed.set_result(outcome == 1)
        return outcome

    def _remember(self, step: int, batch: SealedBatch) -> None:
        self._recent[step] = batch
        total = sum(b.nbytes for b in self._recent.values())
        while len(self._recent) > 1 and (len(self._recent) > self.recent_cap or total > self.cache_bytes):
            total -= self._recent.popitem(last=False)[1].nbytes

    async def _write_and_seal(self, step: int, batch: SealedBatch, staged: Callable[[], Awaitable[None]] | None = None,
                              writing: Callable[[], Awaitable[None]] | None = None) -> int:
        k = self.keys
        prefix = k.chunk_prefix(step, batch.build)
        table, stats = batch.manifest()
        for _ in range(3):
            where = ""
            if self.files is not None:
                early, batch.early = batch.early, None  # a retry writes afresh
                stored = await self.files.write(step, batch.build, batch.chunks or [], pause=writing,
                                                reuse=batch.files, early=early)
                # Durable now: an attempt after a failed seal (Redis down) reuses these files.
                batch.files = where = str(stored)
                if not self.files.touch(stored, len(batch.table)):
                    raise StoreFailed(f"batch {step}: its chunk files in {stored} went missing before the seal "
                                      "(removed by hand, or by a sweep of another sampler?)")
            else:
                await self._write_chunks(prefix, batch.chunks or [], writing, step=step)
            writing = None
            if staged is not None:
                await staged()
                staged = None
            outcome = int(await self._seal(keys=[k.batch(step), k.sealed, k.meta],
                                           args=[step, k.events, batch.build, len(batch.table), prefix, table, stats,
                                                 where]))
            if where and outcome in (0, -1):
                self.files.remove(where)  # another build's seal won, or the step is gone: these files are orphans
                batch.files = None
            if outcome != -2:
                return 0 if outcome == 2 else outcome
            log.warning("batch %d: a chunk was missing from Redis at the seal (a restarted Redis?); "
                        "writing the chunks again", step)
        raise RuntimeError(f"batch {step}: its chunks kept disappearing from Redis between their write and the "
                           "seal (is Redis evicting keys? set maxmemory-policy noeviction)")

    async def _write_chunks(self, prefix: str, buffers: list[Any],
                            writing: Callable[[], Awaitable[None]] | None = None, *, step: int = -1) -> None:
        """The chunks as Redis strings (batch_store = redis), within the same bound as files."""
        async def everything() -> None:
            nonlocal writing
            for start, stop in _rounds([len(b) for b in buffers]):
                async with self.r.pipeline(transaction=False) as pipe:
                    for i in range(start, stop):
                        pipe.set(prefix + str(i), memoryview(buffers[i]), px=STAGED_TTL_MS)
                    await pipe.execute()
                if writing is not None:
                    await writing()
                    writing = None

        try:
            async with asyncio.timeout(self.write_timeout):  # not wait_for: see chunk_files.ChunkFiles.write
                await everything()
        except TimeoutError:
            total = sum(len(b) for b in buffers)
            raise StoreFailed(f"batch {step}: {describe_bytes(total)} could not be stored in {self.write_timeout:g} s: "
                              "Redis took its chunks too slowly (batch_store = redis writes every byte through "
                              "Redis's fsync-always log; batch_store = files is built for bulk)") from None

    def held(self, step: int) -> bool:
        """Whether this process holds the sealed bytes of `step` (it sealed them recently)."""
        return step in self._recent

    async def restore(self, step: int) -> int:
        """Seal `step` again with the chunks this process sealed before (a restarted Redis lost
        them). 1 = written back, 0 = Redis has the batch, -1 = trimmed meanwhile."""
        return await self._write_and_seal(step, self._recent[step])

    async def manifest(self, step: int) -> SealedBatch | None:
        """Batch `step` as sealed: with its chunks when this process holds them (they are
        immutable, which spares a large Redis read), else the manifest alone (`read_chunks`
        reads the chunks a reader needs). A small read of the trim mark keeps a trimmed batch
        from being served from memory.

        The seal's announcement can wake a reader before this process has the reply to its
        own seal; such a reader waits for that reply (it follows within a round trip)
        rather than reading the batch back from Redis."""
        sealing = self._sealing.get(step)
        if sealing is not None:
            await asyncio.shield(sealing)
        cached = self._recent.get(step)
        if cached is not None:
            trimmed = await self.r.hget(self.keys.meta, "trimmed_below")
            if step >= int(trimmed or 0):
                return cached
            self._recent.pop(step, None)
        try:
            fields = await self.r.hgetall(self.keys.batch(step))
        except aioredis.ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            return await self._legacy(step)
        return SealedBatch.from_manifest(step, fields) if fields else None

    async def _legacy(self, step: int) -> SealedBatch | None:
        """A batch sealed by a sampler before chunks (one string in the arrays form), converted
        in memory: a run upgraded mid-way still serves the batches it sealed before."""
        raw = await self.r.get(self.keys.batch(step))
        if raw is None:
            return None
        body = codec.unpack(raw)
        return pack(step, body["samples"], body.get("stats") or {})

    async def read_chunks(self, batch: SealedBatch, indices: list[int]) -> list[Any] | None:
        """Chunks `indices` of `batch` (from memory, or read from Redis); None when one is
        gone (the batch was trimmed meanwhile)."""
        if batch.chunks is not None:
            return [batch.chunks[i] for i in indices]
        if batch.files is not None:
            return await asyncio.to_thread(ChunkFiles.read, batch.files, indices, [batch.table[i][1] for i in indices])
        prefix = self.keys.chunk_prefix(batch.step, batch.build)
        found: list[Any] = []
        # Bounded reads: a reply is buffered whole by the client.
        for start, stop in _rounds([batch.table[i][1] for i in indices]):
            found += await self.r.mget([prefix + str(i) for i in indices[start:stop]])
        return None if any(c is None for c in found) else found

    async def get_batch(self, step: int) -> SealedBatch | None:
        """Batch `step` with every chunk (None when not sealed, or trimmed meanwhile)."""
        batch = await self.manifest(step)
        if batch is None or batch.chunks is not None:
            return batch
        found = await self.read_chunks(batch, list(range(len(batch.table))))
        if found is None:
            return None
        batch.chunks = found
        return batch

    def _served_event(self, step: int) -> asyncio.Event:
        event = self._served.get(step)
        if event is None:
            event = self._served[step] = asyncio.Event()
            while len(self._served) > 4 * self.recent_cap:
                self._served.popitem(last=False)
        return event

    def mark_served(self, step: int) -> None:
        """A GET /batch answer with batch `step` has been sent (flow control permitting)."""
        self._served_event(step).set()

    async def wait_served(self, step: int, timeout: float) -> bool:
        """Wait until batch `step` has been sent to a reader, at most `timeout` seconds."""
        return await wait_event(self._served_event(step), timeout)

    async def sealed_steps(self) -> list[int]:
        return [int(s) for s in await self.r.zrange(self.keys.sealed, 0, -1)]

    async def trim_below(self, step: int, resume_step: int | None = None) -> int:
        """Delete the batches below `step`, but none from `resume_step` on (the trainer's restart
        point); returns how many were deleted."""
        mark = step if resume_step is None else min(step, resume_step)
        self._trim_mark = max(self._trim_mark, mark)
        for held in [s for s in self._recent if s < mark]:
            del self._recent[held]  # its memory goes back now, not when a later seal evicts it
        hold = "" if resume_step is None else resume_step
        gone, upto, *dirs = await self._trim(keys=[self.keys.meta, self.keys.sealed], args=[step, self.keys.prefix, hold])
        if self.files is not None and (int(gone) or dirs):
            # Every build of a trimmed step goes, sealed or orphaned, here or where its manifest says.
            await asyncio.to_thread(self.files.remove_below, int(upto), [d.decode() for d in dirs])
        return int(gone)

    async def sweep_orphans(self, stale_after: float = STAGED_TTL_MS / 1000) -> int:
        """At start: remove chunk files no manifest names and none ever will: builds of trimmed
        steps, builds that lost their step's seal to another build, and unsealed builds untouched
        for `stale_after` seconds (what a Redis chunk's expiry does). A younger unsealed build
        may be another replica's write in flight, so it stays (a trim removes it later)."""
        if self.files is None:
            return 0
        builds = await asyncio.to_thread(self.files.builds)
        if not builds:
            return 0
        trimmed = int(await self.r.hget(self.keys.meta, "trimmed_below") or 0)
        steps = sorted({step for step, _, _ in builds})
        async with self.r.pipeline(transaction=False) as pipe:
            for step in steps:
                pipe.hget(self.keys.batch(step), "dir")
            # A step sealed before chunks (a string, WRONGTYPE here) is sealed by no build of these.
            sealed_dirs = dict(zip(steps, await pipe.execute(raise_on_error=False)))
        now = time.time()
        gone = 0
        for step, _, where in builds:
            named = sealed_dirs.get(step)
            if step >= trimmed and isinstance(named, bytes) and named.decode() == str(where):
                continue  # a sealed batch's files
            try:
                idle = now - where.stat().st_mtime
            except FileNotFoundError:
                continue
            if step < trimmed or named is not None or idle > stale_after:
                await asyncio.to_thread(self.files.remove, where)
                gone += 1
        if gone:
            log.info("removed %d orphaned batch build(s) from %s", gone, self.files.root)
        return gone

    # --- claims: which replica generates which step --------------------------------

    async def claim(self, step: int, owner: str, ttl_ms: int) -> int:
        """1 claimed (now, or already ours), 0 held by another replica, -1 already sealed."""
        return min(1, await self._take_lease(step, owner, ttl_ms))

    async def renew_claim(self, step: int, owner: str, ttl_ms: int) -> int:
        """1 extended, 2 taken again (the lease was gone), 0 another replica holds it, -1 sealed."""
        return await self._take_lease(step, owner, ttl_ms)

    async def _take_lease(self, step: int, owner: str, ttl_ms: int) -> int:
        return int(await self._lease(keys=[self.keys.claim(step), self.keys.sealed], args=[step, owner, ttl_ms]))

    async def release_claim(self, step: int, owner: str) -> None:
        await self._release(keys=[self.keys.claim(step)], args=[owner])

    async def claim_owner(self, step: int) -> str | None:
        """The replica holding the claim on `step`, if any."""
        owner = await self.r.get(self.keys.claim(step))
        return owner.decode() if owner is not None else None

    # --- versions ------------------------------------------------------------------

    async def meta(self) -> dict[str, Any]:
        return _meta(await self.r.hgetall(self.keys.meta))

    async def plan_view(self) -> tuple[dict[str, Any], dict[str, dict[str, Any]], list[int]]:
        """`meta()`, `servers()` and the sealed steps from the floor (max of the published
        version, trimmed_below and `acked_version`), read in one round trip (the producer's)."""
        meta, servers, sealed = await self._plan_view(
            keys=[self.keys.meta, self.keys.servers, self.keys.sealed], args=[self.acked_version])
        return (_meta(dict(zip(meta[::2], meta[1::2]))),
                {k.decode(): json.loads(v) for k, v in zip(servers[::2], servers[1::2])}, [int(s) for s in sealed])

    async def version(self) -> int:
        value = await self.r.hget(self.keys.meta, "version")
        return int(value) if value is not None else 0

    async def publish_version(self, version: int, checkpoint_path: str | None,
                              probe: Probe | None = None, *, adapter: bool = False) -> tuple[int, int]:
        """(outcome, previous): outcome 2 advanced, 1 repeated, 0 refused as lower. `adapter`:
        the checkpoint is a LoRA adapter (shared/adapters.py)."""
        now = time.time()
        probe_json = probe.model_dump_json() if probe else ""
        flag = "1" if adapter else "0"
        outcome, previous = await self._publish(
            keys=[self.keys.meta, self.keys.probe],
            args=[version, checkpoint_path or "", self.keys.events, now, probe_json, flag],
        )
        if int(outcome) == 2 or (int(outcome) == 1 and self._acked is None):
            self._acked = (version, checkpoint_path or "", probe_json, flag)
        if int(outcome) == 2:
            # Publication history for the dashboard's timeline; capped like the stats stream.
            await self.r.zadd(self.keys.published, {str(version): now})
            await self.r.zremrangebyrank(self.keys.published, 0, -self.stats_cap - 1)
        return int(outcome), int(previous)

    @property
    def acked_version(self) -> int:
        """The last version this process published (0 when none): the run stands at least there,
        whatever a restarted Redis says."""
        return self._acked[0] if self._acked is not None else 0

    async def reverify(self) -> tuple[list[int], int | None]:
        """After a Redis restart: write back what this process acknowledged and Redis lost.

        Returns (steps whose sealed bytes were written back, the version re-published or None).
        Sealing is SET NX and publishing only moves forward, so this is safe to run at any time
        and on every replica."""
        restored = []
        for step in list(self._recent):
            if step in self._recent and await self.restore(step) == 1:
                restored.append(step)
        republished = None
        if self._acked is not None:
            version, checkpoint_path, probe_json, flag = self._acked
            if await self.version() < version:
                await self._publish(keys=[self.keys.meta, self.keys.probe],
                                    args=[version, checkpoint_path, self.keys.events, time.time(), probe_json, flag])
                republished = version
        if self._trim_mark:
            await self.trim_below(self._trim_mark)
        return restored, republished

    async def probe(self) -> Probe | None:
        """The published version's probe, if the trainer sent one."""
        raw = await self.r.get(self.keys.probe)
        return Probe.model_validate_json(raw) if raw else None

    async def add_trainer_metrics(self, version: int, metrics: dict[str, float | None]) -> None:
        record = {"version": version, "at": time.time(), **metrics}
        await self.r.xadd(self.keys.trainer_metrics, {"json": json.dumps(record)}, maxlen=self.stats_cap,
                          approximate=True)

    async def recent_trainer_metrics(self, count: int = 200) -> list[dict[str, Any]]:
        entries = await self.r.xrevrange(self.keys.trainer_metrics, count=count)
        return [json.loads(fields[b"json"]) for _, fields in reversed(entries)]

    async def version_publish_times(self, count: int = 500) -> dict[int, float]:
        """The last `count` published versions -> unix time each was published."""
        entries = await self.r.zrange(self.keys.published, -count, -1, withscores=True)
        return {int(v): float(t) for v, t in entries}

    # --- inference servers ------------------------------------------------------------

    async def set_server(self, url: str, info: dict[str, Any]) -> None:
        await self.r.hset(self.keys.servers, url, json.dumps(info))

    async def forget_server(self, url: str) -> None:
        await self.r.hdel(self.keys.servers, url)

    async def servers(self) -> dict[str, dict[str, Any]]:
        raw = await self.r.hgetall(self.keys.servers)
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    # --- membership: which inference servers the run uses -------------------------------

    async def seed_members(self, urls: list[str]) -> None:
        """Add `urls` unless the run already knows them (a removed one stays removed)."""
        record = json.dumps({"added_at": time.time(), "source": "inference_urls", "removed_at": None})
        async with self.r.pipeline(transaction=True) as pipe:
            for url in urls:
                pipe.hsetnx(self.keys.members, url, record)
            await pipe.execute()

    async def members(self) -> dict[str, dict[str, Any]]:
        """Every server the run has known: url -> {added_at, source, removed_at}."""
        raw = await self.r.hgetall(self.keys.members)
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    async def add_member(self, url: str) -> None:
        record = json.dumps({"added_at": time.time(), "source": "api", "removed_at": None})
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.members, url, record)
            pipe.publish(self.keys.events, "servers")
            await pipe.execute()

    async def remove_member(self, url: str) -> bool:
        """Mark `url` removed; False when it was not a member."""
        record = json.dumps({"removed_at": time.time(), "source": "api"})
        return bool(await self._remove_member(keys=[self.keys.members], args=[url, record, self.keys.events]))

    # --- re-sync leases: one replica re-syncs a given server at a time -----------------

    async def take_heal_lease(self, url: str, owner: str, ttl_ms: int) -> bool:
        return bool(await self.r.set(self.keys.heal(url), owner, nx=True, px=ttl_ms))

    async def release_heal_lease(self, url: str, owner: str) -> None:
        await self._release(keys=[self.keys.heal(url)], args=[owner])

    # --- stats and events --------------------------------------------------------------

    async def add_batch_stats(self, stats: dict[str, Any]) -> None:
        await self.r.xadd(
            self.keys.batch_stats, {"json": json.dumps(stats)}, maxlen=self.stats_cap, approximate=True
        )

    async def recent_batch_stats(self, count: int = 200) -> list[dict[str, Any]]:
        entries = await self.r.xrevrange(self.keys.batch_stats, count=count)
        return [json.loads(fields[b"json"]) for _, fields in reversed(entries)]


def _meta(raw: dict[bytes, bytes]) -> dict[str, Any]:
    """The run's meta hash, typed (absent fields: a run that has published nothing yet)."""
    m = {k.decode(): v.decode() for k, v in raw.items()}
    return {"version": int(m.get("version", 0)), "checkpoint_path": m.get("checkpoint_path") or None,
            "adapter": m.get("adapter") == "1", "trimmed_below": int(m.get("trimmed_below", 0)),
            "resume_step": int(m["resume_step"]) if "resume_step" in m else None,
            "published_at": float(m["published_at"]) if "published_at" in m else None}
