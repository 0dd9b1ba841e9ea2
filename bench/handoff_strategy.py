"""A sampling strategy for the hand-off benchmark: batches of synthetic, realistic samples.

Loaded into a real sampler process by import path (`strategy =
"bench.handoff_strategy:SyntheticBatches"`), so each batch goes through the producer's own
path from `batch_stats` on: `sealed_at` stamped, `codec.pack_arrays`, `Store.seal` (Lua SET
NX + PUBLISH), the on-sealed hooks, and `GET /batch` served by the process that sealed it.
Only inference is skipped: a 64 MiB batch of real completions would take the stand-in
minutes to write as JSON, and none of that is hand-off.

A build waits at a gate until the benchmark pushes to `<prefix>bench:go:<step>` in Redis
(the sampler's `redis_url`, reached with a client of this strategy's own), so the benchmark
decides when the batch is sealed: after its `GET /batch` is parked.

Each batch holds `prompts_per_step * num_generations` samples of PROMPT_TOKENS prompt and
COMPLETION_TOKENS completion tokens, ids below 50,000, float64 logprobs and texts, cycled
from a pool of 64 distinct samples.
"""

from __future__ import annotations

import random
from typing import Any

import redis.asyncio as aioredis

from services.sampler.keys import Keys
from services.sampler.strategies import BuildContext, Strategy

PROMPT_TOKENS, COMPLETION_TOKENS = 128, 512


def make_sample(rng: random.Random, i: int, group_size: int = 8) -> dict[str, Any]:
    """A sample with the contract's fields and realistic types and sizes."""
    return {
        "prompt_id": f"math/train/{i}", "group_id": f"s0-g{i // group_size}",
        "prompt_token_ids": [rng.randrange(50_000) for _ in range(PROMPT_TOKENS)],
        "completion_token_ids": [rng.randrange(50_000) for _ in range(COMPLETION_TOKENS)],
        "completion_logprobs": [-rng.expovariate(1.0) for _ in range(COMPLETION_TOKENS)],
        "loss_mask": [1] * COMPLETION_TOKENS,
        "reward": 1.0, "rewards": {"correct": 1.0}, "advantage": 0.5, "policy_version": 0,
        "finish_reason": "length", "use_count": 1, "env": "bench", "sample_index": i % group_size,
        "versions": [0], "prompt_text": "x" * 300, "completion_text": "y" * 1500,
    }


def gate(prefix: str, step: int) -> str:
    return f"{prefix}bench:go:{step}"


class SyntheticBatches(Strategy):
    name = "bench_synthetic"

    def __init__(self, settings: Any):
        super().__init__(settings)
        rng = random.Random(0)
        self.pool = [make_sample(rng, i, settings.num_generations) for i in range(64)]
        if not settings.redis_url:
            raise ValueError("the hand-off benchmark's strategy needs an external redis_url (its gate)")
        self.prefix = Keys(settings.namespace).prefix

    async def assemble(self, ctx: BuildContext) -> list[dict[str, Any]]:
        async with aioredis.from_url(self.settings.redis_url) as redis:
            while not await redis.blpop([gate(self.prefix, ctx.step)], timeout=60):
                pass
        count = self.settings.batch_size
        return [{**self.pool[i % len(self.pool)], "policy_version": ctx.min_version} for i in range(count)]
