"""Redis memory over 1,000 steps: bounded by retention (keep_batches) and capped streams.

Real processes on loopback: a private redis-server used by nothing else, the vLLM-protocol
stand-in (token_latency 0), the sampler, and a trainer stand-in that takes each batch and
publishes the next version at once (T = 0), so 1,000 steps run in about a minute.

Every `every` steps: INFO memory used_memory, and where it goes: the sealed batches still
kept (count and MEMORY USAGE), the capped stats stream and the capped publication history
(entries and MEMORY USAGE). Batches are trimmed `keep_batches` behind the published version,
so their memory is flat from the first steps on; the two capped structures grow until their
cap (the Store's `stats_cap`, 256 entries) and stay there, so their bound is also reported.

Writes bench/results/memory.json and memory.md; `python -m bench memory`.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from bench._common import host, redis_server, sampler_process, standin_process, trainer_loop, write_results

COMMAND = "make bench ARGS=memory  (or .venv/bin/python -m bench memory)"


async def _sizes(r: aioredis.Redis, prefix: str) -> dict[str, Any]:
    info = await r.info("memory")
    batch_keys = [k async for k in r.scan_iter(match=f"{prefix}batch:*", count=1000)]
    batch_bytes = 0
    for k in batch_keys:
        batch_bytes += await r.memory_usage(k, samples=0) or 0
    # A batch is a manifest (batch:<step>) and its chunks (batch:<step>:<build>:<i>); count batches.
    batches = {k.split(b":")[3] for k in batch_keys}
    out: dict[str, Any] = {"used_memory": int(info["used_memory"]), "batch_keys": len(batches),
                           "batch_bytes": batch_bytes, "keys_total": await r.dbsize()}
    for name in ("batch_stats", "published"):
        key = prefix + name
        kind = (await r.type(key)).decode()
        n = await r.xlen(key) if kind == "stream" else await r.zcard(key) if kind == "zset" else 0
        out[f"{name}_entries"] = n
        out[f"{name}_bytes"] = (await r.memory_usage(key, samples=0) or 0) if n else 0
    return out


def run(results_dir: Path, *, steps: int = 1000, every: int = 100, keep_batches: int = 8, prompts_per_step: int = 4,
        num_generations: int = 8, max_tokens: int = 16, stream_cap: int | None = None) -> dict:
    import inspect

    from services.sampler.storage.keys import Keys
    from services.sampler.storage.store import Store

    if stream_cap is None:  # the cap the sampler really uses
        stream_cap = inspect.signature(Store).parameters["stats_cap"].default
    namespace = "m" + uuid.uuid4().hex[:10]
    prefix = Keys(namespace).prefix
    shape = {"prompts_per_step": prompts_per_step, "num_generations": num_generations, "max_tokens": max_tokens}
    samples: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-memory-") as tmp_name:
        tmp = Path(tmp_name)
        with redis_server(tmp) as redis_url, standin_process(tmp, 0.0) as standin:
            with sampler_process(tmp / "run", redis_url=redis_url, namespace=namespace, inference_urls=[standin.url],
                                 max_staleness=1, keep_batches=keep_batches, **shape) as sampler:
                async def main() -> list[dict[str, Any]]:
                    r = aioredis.from_url(redis_url)
                    started = time.perf_counter()
                    samples.append({"step": 0, "elapsed_s": 0.0, **await _sizes(r, prefix)})

                    async def on_step(step: int) -> None:
                        if (step + 1) % every == 0:
                            samples.append({"step": step + 1, "elapsed_s": round(time.perf_counter() - started, 1),
                                            **await _sizes(r, prefix)})

                    try:
                        return await trainer_loop(sampler.url, steps, 0.0, on_step=on_step, deadline_s=900)
                    finally:
                        await r.aclose()

                records = asyncio.run(main())
    first = next((s for s in samples if s["step"] >= every), samples[0])
    last = samples[-1]
    per_stats_entry = last["batch_stats_bytes"] / max(1, last["batch_stats_entries"])
    per_published_entry = last["published_bytes"] / max(1, last["published_entries"])
    bound = (last["used_memory"] - last["batch_stats_bytes"] - last["published_bytes"]
             + stream_cap * (per_stats_entry + per_published_entry))
    batch_bytes = [s["batch_bytes"] for s in samples if s["step"] >= every]
    result = {
        "benchmark": "memory",
        "setup": {"steps": steps, "keep_batches": keep_batches,
                  "batch": f"{prompts_per_step} prompts x {num_generations} generations, max_tokens {max_tokens}",
                  "inference": "stand-in, token_latency 0", "trainer": "T = 0, max_staleness 1",
                  "batch_msgpack_bytes": records[-1]["bytes"] if records else None},
        "samples": samples,
        "used_memory_at_first_sample": first["used_memory"],
        "used_memory_at_end": last["used_memory"],
        "growth_bytes_after_first_sample": last["used_memory"] - first["used_memory"],
        "growth_from_capped_structures_bytes": (last["batch_stats_bytes"] + last["published_bytes"]
                                                - first["batch_stats_bytes"] - first["published_bytes"]),
        "batch_keys_max": max(s["batch_keys"] for s in samples),
        "batch_bytes_min_max": [min(batch_bytes), max(batch_bytes)] if batch_bytes else None,
        "capped_structures_cap_entries": stream_cap,
        "projected_bound_used_memory": int(bound),
        "host": host(),
        "command": COMMAND,
    }
    result["batches_bounded"] = result["batch_keys_max"] <= keep_batches + 3
    lines = [
        "# Redis memory over many steps",
        "",
        f"{steps} steps against a private redis-server: stand-in inference (no latency), batch "
        f"{result['setup']['batch']} ({result['setup']['batch_msgpack_bytes']} B msgpack), trainer T = 0, "
        f"keep_batches {keep_batches}.",
        "",
        "| step | elapsed s | used_memory KiB | batches (manifest + chunks) | batches KiB | stats stream entries | stats stream KiB | "
        "publication history entries | history KiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in samples:
        lines.append(
            f"| {s['step']} | {s['elapsed_s']} | {s['used_memory'] / 1024:.0f} | {s['batch_keys']} | "
            f"{s['batch_bytes'] / 1024:.1f} | {s['batch_stats_entries']} | {s['batch_stats_bytes'] / 1024:.0f} | "
            f"{s['published_entries']} | {s['published_bytes'] / 1024:.0f} |"
        )
    lines += [
        "",
        f"Sealed batches stay bounded: at most {result['batch_keys_max']} batches (keep_batches {keep_batches} "
        f"behind the published version, plus the ones generated ahead). used_memory grew "
        f"{result['growth_bytes_after_first_sample'] / 1024:.0f} KiB from step {first['step']} to {last['step']}, of "
        f"which {result['growth_from_capped_structures_bytes'] / 1024:.0f} KiB is the stats stream and publication "
        f"history, both capped at {stream_cap} entries: projected ceiling {bound / 1024 / 1024:.1f} MiB used_memory "
        f"for this batch shape.",
        "",
        f"`{COMMAND}`",
    ]
    write_results(results_dir, "memory", result, "\n".join(lines))
    return result
