"""The replay pool in Redis: the state of the `replay` strategy, behind a small interface.

Layout (key names from keys.py, under the run namespace): `replay:meta` is a hash
group_id -> JSON metadata (prompt_id, policy_version, use_count, created_step, priority);
`replay:data` is a hash group_id -> msgpack list of the group's samples.

Invariants:
* A group is in the pool when it has metadata; its data is written with its metadata and
  deleted with it, so a pooled group always has its samples.
* Each draw and each addition is one MULTI block (`record_draw`, `record_add`): other
  replicas and a restarted sampler see the pool before or after it, never halfway.
* The pool holds no policy: which groups are eligible, drawn, kept or evicted is the
  strategy's decision (services/sampler/building/strategies/replay.py); this class reads and writes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis

from services.sampler.storage.keys import Keys
from shared import codec


class ReplayPool:
    def __init__(self, client: aioredis.Redis, keys: Keys):
        self.r = client
        self.meta_key = keys.replay_meta
        self.data_key = keys.replay_data

    async def entries(self) -> dict[str, dict[str, Any]]:
        """Every pooled group: group_id -> its metadata."""
        raw = await self.r.hgetall(self.meta_key)
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    async def size(self) -> int:
        """How many groups the pool holds."""
        return await self.r.hlen(self.meta_key)

    async def samples(self, group_ids: Sequence[str]) -> list[list[dict[str, Any]]]:
        """The samples of each group in `group_ids`, in that order (as they were added)."""
        if not group_ids:
            return []
        return [codec.unpack(blob) for blob in await self.r.hmget(self.data_key, list(group_ids))]

    async def record_draw(self, updated: Mapping[str, dict[str, Any]], removed: Iterable[str]) -> None:
        """After a draw, in one MULTI block: the served groups that stay get their new
        metadata (`updated`), and the groups in `removed` (used up, too old) leave the pool."""
        async with self.r.pipeline(transaction=True) as tx:
            for gid, meta in updated.items():
                tx.hset(self.meta_key, gid, json.dumps(meta))
            for gid in removed:
                tx.hdel(self.meta_key, gid)
                tx.hdel(self.data_key, gid)
            await tx.execute()

    async def record_add(self, added: Mapping[str, tuple[dict[str, Any], list[dict[str, Any]]]],
                         removed: Iterable[str]) -> None:
        """In one MULTI block: the groups in `removed` (replaced, evicted) leave the pool and
        the groups in `added` (group_id -> (metadata, samples)) enter it. A group id is in
        one of the two at most."""
        async with self.r.pipeline(transaction=True) as tx:
            for gid in removed:
                tx.hdel(self.meta_key, gid)
                tx.hdel(self.data_key, gid)
            for gid, (meta, samples) in added.items():
                tx.hset(self.meta_key, gid, json.dumps(meta))
                tx.hset(self.data_key, gid, codec.pack(samples))
            await tx.execute()
