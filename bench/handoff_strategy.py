"""A sampling strategy for the hand-off benchmark: batches of synthetic, realistic samples.

Loaded into a real sampler process by import path (`strategy =
"bench.handoff_strategy:SyntheticBatches"`), so each batch goes through the producer's own
path from `batch_stats` on: `sealed_at` stamped, `packing.pack` into group-aligned chunks,
`Store.seal` (chunks written, then the Lua seal that PUBLISHes `sealed:<step>`), the
on-sealed hooks, and `GET /batch` served by the process that sealed it. Only inference is
skipped: a 1 GiB batch of real completions would take the stand-in hours to write, and none
of that is hand-off.

The samples are what the real path holds when their groups finish: the token fields
(`codec.ARRAY_FIELDS`: ids, logprobs, loss mask) are typed numpy arrays already (the pool
goes through `codec.with_arrays` once), so packing at the seal is the one copy of the
numbers, into the chunks.

A build waits at a gate until the benchmark pushes to `<prefix>bench:go:<step>` in Redis
(the sampler's `redis_url`, reached with a client of this strategy's own), so the benchmark
decides when the batch is built: after its `GET /batch` is parked.

Each batch holds `prompts_per_step * num_generations` samples of PROMPT_TOKENS prompt and
COMPLETION_TOKENS completion tokens, ids below 50,000, float64 logprobs and texts, cycled
from a pool of 64 distinct samples; each group of `num_generations` consecutive samples
gets its own group_id.
"""

from __future__ import annotations

import random
from typing import Any

import redis.asyncio as aioredis

from services.sampler.storage.keys import Keys
from services.sampler.building.strategies import BuildContext, Strategy
from shared import codec

PROMPT_TOKENS, COMPLETION_TOKENS = 128, 512
POOL = 64


def make_sample(rng: random.Random, i: int, group_size: int = 8) -> dict[str, Any]:
    """A sample with the contract's fields and realistic types and sizes (token fields as
    lists, as a JSON body would have them; `make_pool` types them)."""
    return {
        "prompt_id": f"math/train/{i // group_size}", "group_id": f"s0-g{i // group_size}",
        "prompt_token_ids": [rng.randrange(50_000) for _ in range(PROMPT_TOKENS)],
        "completion_token_ids": [rng.randrange(50_000) for _ in range(COMPLETION_TOKENS)],
        "completion_logprobs": [-rng.expovariate(1.0) for _ in range(COMPLETION_TOKENS)],
        "loss_mask": [1] * COMPLETION_TOKENS,
        "reward": 1.0, "rewards": {"correct": 1.0}, "advantage": 0.5, "policy_version": 0,
        "finish_reason": "length", "use_count": 1, "env": "bench", "sample_index": i % group_size,
        "versions": [0], "prompt_text": "x" * 300, "completion_text": "y" * 1500,
    }


def make_pool(group_size: int = 8) -> list[dict[str, Any]]:
    """POOL distinct samples, token fields as typed (read-only) numpy arrays."""
    rng = random.Random(0)
    return codec.with_arrays({"samples": [make_sample(rng, i, group_size) for i in range(POOL)]})["samples"]


def batch_samples(pool: list[dict[str, Any]], count: int, group_size: int, step: int,
                  version: int) -> list[dict[str, Any]]:
    """`count` samples cycled from `pool` (new dicts sharing the pool's arrays), each group of
    `group_size` with its own group_id."""
    n = len(pool)
    out = []
    for g in range(0, count, group_size):
        gid = f"s{step}-g{g // group_size}"
        out += [{**pool[i % n], "group_id": gid, "policy_version": version}
                for i in range(g, min(g + group_size, count))]
    return out


def gate(prefix: str, step: int) -> str:
    return f"{prefix}bench:go:{step}"


class SyntheticBatches(Strategy):
    name = "bench_synthetic"

    def __init__(self, settings: Any):
        super().__init__(settings)
        if POOL % settings.num_generations:
            raise ValueError(f"num_generations {settings.num_generations} must divide the pool of {POOL}")
        self.pool = make_pool(settings.num_generations)
        if not settings.redis_url:
            raise ValueError("the hand-off benchmark's strategy needs an external redis_url (its gate)")
        self.prefix = Keys(settings.namespace).prefix

    async def assemble(self, ctx: BuildContext) -> list[dict[str, Any]]:
        async with aioredis.from_url(self.settings.redis_url) as redis:
            while not await redis.blpop([gate(self.prefix, ctx.step)], timeout=60):
                pass
        return batch_samples(self.pool, self.settings.batch_size, self.settings.num_generations, ctx.step,
                             ctx.min_version)
