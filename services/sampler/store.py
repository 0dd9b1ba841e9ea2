"""Durable sampler state in Redis: sealed batches, the published version, servers, stats.

Invariants:
* A sealed batch is written once (`SET NX` inside a Lua script that also records the
  step and announces it); re-sealing the same step is a no-op, so writes are idempotent.
* Readers never pop: `get_batch` returns the same bytes until the step is trimmed.
* The published version only moves forward (compare-and-set in Lua).
* Memory is bounded: batches more than `keep_batches` behind the published version are
  deleted, except those from the trainer's resume step on (the step after its newest full
  checkpoint, sent with each version): a trainer killed at any moment finds every batch it
  must train again, and the per-batch stats stream and the publication history keep the last 256
  entries (what the dashboard plots), so Redis memory is flat after a few hundred steps.
* What this process acknowledged it can write again: the bytes of the batches it sealed
  most recently (`held`), the last version it published and the trim mark stay in memory,
  and `reverify()` writes back whatever a restarted Redis lost of them (a Redis that fsyncs
  every write loses nothing; one with `appendfsync everysec` can lose its last second).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from typing import Any

import redis.asyncio as aioredis

from services.sampler.keys import Keys
from shared.aio import wait_event
from shared.probe import Probe

# KEYS: batch, sealed, meta. ARGV: step, payload, channel.
# Returns 1 when sealed now, 0 when it was already sealed, -1 when the step was trimmed.
_SEAL = """
local trimmed = tonumber(redis.call('HGET', KEYS[3], 'trimmed_below') or '0')
if tonumber(ARGV[1]) < trimmed then return -1 end
if redis.call('SET', KEYS[1], ARGV[2], 'NX') then
  redis.call('ZADD', KEYS[2], ARGV[1], ARGV[1])
  redis.call('PUBLISH', ARGV[3], 'sealed:' .. ARGV[1])
  return 1
end
return 0
"""

# KEYS: meta, probe. ARGV: version, checkpoint_path ('' for none), channel, time, probe JSON ('' for none).
# Returns {outcome, previous}: outcome 2 = advanced, 1 = same version again, 0 = refused (lower).
# The probe belongs to the version: written (or deleted) in the same step.
_PUBLISH = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
local v = tonumber(ARGV[1])
if v < cur then return {0, cur} end
if v == cur then return {1, cur} end
redis.call('HSET', KEYS[1], 'version', v, 'checkpoint_path', ARGV[2], 'published_at', ARGV[4])
if ARGV[5] == '' then redis.call('DEL', KEYS[2]) else redis.call('SET', KEYS[2], ARGV[5]) end
redis.call('PUBLISH', ARGV[3], 'version:' .. v)
return {2, cur}
"""

# KEYS: meta, sealed. ARGV: trim_below, prefix, resume_step ('' when the trainer sent none).
# Deletes batches below min(trim_below, resume_step); the trainer's resume step is recorded
# (what /status and the 410 report), and the mark never moves back.
_TRIM = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'trimmed_below') or '0')
local upto = tonumber(ARGV[1])
if ARGV[3] ~= '' then
  local hold = tonumber(ARGV[3])
  redis.call('HSET', KEYS[1], 'resume_step', hold)
  if hold < upto then upto = hold end
end
if upto <= cur then return 0 end
local steps = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. upto)
for _, s in ipairs(steps) do redis.call('DEL', ARGV[2] .. 'batch:' .. s) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. upto)
redis.call('HSET', KEYS[1], 'trimmed_below', upto)
return #steps
"""


# KEYS: claim, sealed. ARGV: step, owner, ttl_ms. Takes or extends the lease on generating a
# step: 2 = taken now (nobody held it: a new claim, or one a Redis restart lost), 1 = extended
# (we hold it), 0 = another replica holds it, -1 = already sealed (checked in the same atomic
# step, so a claim released right after its seal can never be taken for a second generation
# of that step).
_LEASE = """
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then return -1 end
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[2] then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
if holder then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 2
"""

# KEYS: members. ARGV: url, removed record (JSON), channel. 1 = removed now, 0 = not a member.
_REMOVE_MEMBER = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local removed = cjson.decode(raw)['removed_at']
if removed ~= nil and removed ~= cjson.null then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PUBLISH', ARGV[3], 'servers')
return 1
"""

# KEYS: claim. ARGV: owner. Deletes the lease only if we hold it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class Store:
    def __init__(self, client: aioredis.Redis, keys: Keys, stats_cap: int = 256, recent_cap: int = 4):
        self.r = client
        self._recent: OrderedDict[int, bytes] = OrderedDict()
        # Seals this process has in flight: step -> future of "these bytes became the batch".
        self._sealing: dict[int, asyncio.Future[bool]] = {}
        # Steps whose batch this process has answered a GET /batch with (the recent ones).
        self._served: OrderedDict[int, asyncio.Event] = OrderedDict()
        self.recent_cap = recent_cap
        # The last version this process published (version, checkpoint_path, probe JSON) and
        # the highest trim mark it set: what `reverify` writes back after a Redis restart.
        self._acked: tuple[int, str, str] | None = None
        self._trim_mark = 0
        self.keys = keys
        self.stats_cap = stats_cap
        self._seal = client.register_script(_SEAL)
        self._publish = client.register_script(_PUBLISH)
        self._trim = client.register_script(_TRIM)
        self._lease = client.register_script(_LEASE)
        self._release = client.register_script(_RELEASE)
        self._remove_member = client.register_script(_REMOVE_MEMBER)

    # --- batches -------------------------------------------------------------------

    async def seal(self, step: int, payload: bytes) -> int:
        k = self.keys
        sealed = asyncio.get_running_loop().create_future()
        self._sealing[step] = sealed
        outcome = 0
        try:
            outcome = int(await self._seal(keys=[k.batch(step), k.sealed, k.meta], args=[step, payload, k.events]))
            if outcome == 1:
                # Only bytes that really became the sealed batch may be served from memory.
                self._recent[step] = payload
                while len(self._recent) > self.recent_cap:
                    self._recent.popitem(last=False)
        finally:
            if self._sealing.get(step) is sealed:
                del self._sealing[step]
            sealed.set_result(outcome == 1)
        return outcome

    def held(self, step: int) -> bool:
        """Whether this process holds the sealed bytes of `step` (it sealed them recently)."""
        return step in self._recent

    async def restore(self, step: int) -> int:
        """Seal `step` again with the bytes this process sealed before (a restarted Redis lost
        them). 1 = written back, 0 = Redis has the batch, -1 = trimmed meanwhile."""
        k = self.keys
        payload = self._recent[step]
        return int(await self._seal(keys=[k.batch(step), k.sealed, k.meta], args=[step, payload, k.events]))

    async def get_batch(self, step: int) -> bytes | None:
        """The sealed bytes of `step`. Batches this process sealed recently come from memory
        (they are immutable), which spares the trainer's hand-off a large Redis read; a
        small read of the trim mark keeps a trimmed batch from being served.

        The seal's announcement can wake a reader before this process has the reply to its
        own seal; such a reader waits for that reply (it follows within a round trip)
        rather than reading the whole batch back from Redis."""
        sealing = self._sealing.get(step)
        if sealing is not None:
            await asyncio.shield(sealing)
        cached = self._recent.get(step)
        if cached is not None:
            trimmed = await self.r.hget(self.keys.meta, "trimmed_below")
            if step >= int(trimmed or 0):
                return cached
            self._recent.pop(step, None)
        return await self.r.get(self.keys.batch(step))

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

    async def sealed_from(self, first: int) -> list[int]:
        """Sealed steps >= `first`, in order."""
        return [int(s) for s in await self.r.zrangebyscore(self.keys.sealed, first, "+inf")]

    async def trim_below(self, step: int, resume_step: int | None = None) -> int:
        """Delete the batches below `step`, but none from `resume_step` on (the trainer's restart
        point); returns how many were deleted."""
        mark = step if resume_step is None else min(step, resume_step)
        self._trim_mark = max(self._trim_mark, mark)
        hold = "" if resume_step is None else resume_step
        return int(await self._trim(keys=[self.keys.meta, self.keys.sealed], args=[step, self.keys.prefix, hold]))

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
        raw = await self.r.hgetall(self.keys.meta)
        meta = {k.decode(): v.decode() for k, v in raw.items()}
        return {
            "version": int(meta.get("version", 0)),
            "checkpoint_path": meta.get("checkpoint_path") or None,
            "trimmed_below": int(meta.get("trimmed_below", 0)),
            "resume_step": int(meta["resume_step"]) if "resume_step" in meta else None,
            "published_at": float(meta["published_at"]) if "published_at" in meta else None,
        }

    async def version(self) -> int:
        value = await self.r.hget(self.keys.meta, "version")
        return int(value) if value is not None else 0

    async def publish_version(self, version: int, checkpoint_path: str | None,
                              probe: Probe | None = None) -> tuple[int, int]:
        """(outcome, previous): outcome 2 advanced, 1 repeated, 0 refused as lower."""
        now = time.time()
        probe_json = probe.model_dump_json() if probe else ""
        outcome, previous = await self._publish(
            keys=[self.keys.meta, self.keys.probe],
            args=[version, checkpoint_path or "", self.keys.events, now, probe_json],
        )
        if int(outcome) == 2 or (int(outcome) == 1 and self._acked is None):
            self._acked = (version, checkpoint_path or "", probe_json)
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
            version, checkpoint_path, probe_json = self._acked
            if await self.version() < version:
                await self._publish(keys=[self.keys.meta, self.keys.probe],
                                    args=[version, checkpoint_path, self.keys.events, time.time(), probe_json])
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
