"""Hand-off latency: from a batch being sealed to the trainer holding it decoded.

A real sampler process (`tandem sampler`) reads a private redis-server. Its inference URL
points at a closed port, so its producer never seals anything; this benchmark seals
synthetic batches of realistic samples itself, through the sampler's own `Store.seal`
(the same Lua script, key and pub/sub announcement the producer uses), while a client
long-polls `GET /batch?step=N` on the sampler. The notifier wakes the parked poll.

The clock starts where the producer's does: `stats.sealed_at` is stamped when the batch
payload is built, before `codec.pack` and the Redis write, exactly as in
`rollout.batch_payload` + `Producer._build`. It stops when the client holds the decoded
body (`codec.decode`, what `SamplerClient.get_batch_raw` returns). The pydantic
validation `SamplerClient.get_batch` adds on top is reported separately.

Per size and encoding: p50/p99 latency, MB/s (msgpack bytes / p50 latency; 1 MB = 10^6 B),
and the median of each leg. Targets: p50 <= 5 ms at 1 MiB; >= 300 MB/s at 64 MiB with msgpack.

Writes bench/results/handoff.json and handoff.md; `python -m bench handoff`.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from bench._common import host, median, pct, redis_server, sampler_process, write_results
from tests.support.servers import free_port

COMMAND = "make bench ARGS=handoff  (or .venv/bin/python -m bench handoff)"
KIB, MIB = 1024, 1024 * 1024
SIZES = (64 * KIB, 1 * MIB, 8 * MIB, 64 * MIB)
PROMPT_TOKENS, COMPLETION_TOKENS = 128, 512


def make_sample(rng: random.Random, i: int) -> dict[str, Any]:
    """A sample with the contract's fields and realistic types (ids < 50k, float64 logprobs)."""
    completion = [rng.randrange(50_000) for _ in range(COMPLETION_TOKENS)]
    return {
        "prompt_id": f"math/train/{i}", "group_id": f"s0-g{i // 8}",
        "prompt_token_ids": [rng.randrange(50_000) for _ in range(PROMPT_TOKENS)],
        "completion_token_ids": completion,
        "completion_logprobs": [-rng.expovariate(1.0) for _ in range(COMPLETION_TOKENS)],
        "loss_mask": [1] * COMPLETION_TOKENS,
        "reward": 1.0, "rewards": {"correct": 1.0}, "advantage": 0.5, "policy_version": 0,
        "finish_reason": "length", "use_count": 1, "env": "bench", "sample_index": i % 8,
        "versions": [0], "prompt_text": "x" * 300, "completion_text": "y" * 1500,
    }


def make_samples(target_bytes: int, pool: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from shared import codec

    per_sample = len(codec.pack(pool[0]))
    count = max(1, round(target_bytes / per_sample))
    return [pool[i % len(pool)] for i in range(count)]


async def _one(http: httpx.AsyncClient, store: Any, step: int, samples: list[dict[str, Any]],
               msgpack: bool, park_s: float) -> dict[str, float]:
    from shared import codec
    from shared.wire import Batch

    headers = {"Accept": codec.MSGPACK if msgpack else codec.JSON}
    marks: dict[str, float] = {}

    async def poll() -> Any:
        response = await http.get("/batch", params={"step": step, "timeout": 30}, headers=headers)
        marks["received"] = time.time()
        assert response.status_code == 200, (response.status_code, response.text[:200])
        body = codec.decode(response.headers.get("content-type"), response.content)
        marks["decoded"] = time.time()
        marks["body_bytes"] = len(response.content)
        return body

    task = asyncio.create_task(poll())
    await asyncio.sleep(park_s)  # the request is parked on the sampler's notifier by now
    sealed_at = time.time()
    payload = {"step": step, "samples": samples, "stats": {"step": step, "sealed_at": sealed_at,
                                                            "num_samples": len(samples)}}
    packed = codec.pack(payload)
    packed_at = time.time()
    outcome = await store.seal(step, packed)
    stored_at = time.time()
    assert outcome == 1, outcome
    body = await task
    t0 = time.perf_counter()
    Batch.model_validate(body)
    validate = time.perf_counter() - t0
    await store.r.delete(store.keys.batch(step))  # keep Redis small between repetitions
    return {"latency": marks["decoded"] - body["stats"]["sealed_at"], "pack": packed_at - sealed_at,
            "seal": stored_at - packed_at, "to_response": marks["received"] - stored_at,
            "decode": marks["decoded"] - marks["received"], "validate": validate,
            "msgpack_bytes": len(packed), "body_bytes": marks["body_bytes"]}


async def _measure(url: str, redis_url: str, namespace: str, sizes: tuple[int, ...], reps: dict[int, int],
                   park_s: float, encodings: tuple[str, ...]) -> list[dict[str, Any]]:
    from services.sampler.keys import Keys
    from services.sampler.store import Store

    rng = random.Random(0)
    pool = [make_sample(rng, i) for i in range(64)]
    r = aioredis.from_url(redis_url)
    store = Store(r, Keys(namespace))
    rows = []
    step = 0
    try:
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(30, read=120)) as http:
            for size in sizes:
                samples = make_samples(size, pool)
                for msgpack in [e == "msgpack" for e in encodings]:
                    runs = []
                    # One unmeasured warm-up per cell (first-touch allocations, connection set-up).
                    for i in range(reps[size] + 1):
                        res = await _one(http, store, step, samples, msgpack, park_s)
                        step += 1
                        if i:
                            runs.append(res)
                    lat = [x["latency"] for x in runs]
                    p50 = median(lat)
                    mp_bytes = runs[0]["msgpack_bytes"]
                    rows.append({
                        "target_bytes": size, "encoding": "msgpack" if msgpack else "json",
                        "samples": len(samples), "msgpack_bytes": mp_bytes, "body_bytes": runs[0]["body_bytes"],
                        "reps": len(runs), "p50_ms": round(p50 * 1e3, 2), "p99_ms": round(pct(lat, 0.99) * 1e3, 2),
                        "MB_per_s_at_p50": round(mp_bytes / p50 / 1e6, 1),
                        "legs_median_ms": {leg: round(median([x[leg] for x in runs]) * 1e3, 2)
                                           for leg in ("pack", "seal", "to_response", "decode")},
                        "pydantic_validate_ms": round(median([x["validate"] for x in runs]) * 1e3, 2),
                    })
    finally:
        await r.aclose()
    return rows


def run(results_dir: Path, *, sizes: tuple[int, ...] = SIZES, reps: dict[int, int] | None = None,
        park_s: float = 0.05, encodings: tuple[str, ...] = ("msgpack", "json")) -> dict:
    reps = reps or {64 * KIB: 40, 1 * MIB: 40, 8 * MIB: 10, 64 * MIB: 4}
    reps = {s: reps.get(s, 5) for s in sizes}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-handoff-") as tmp_name:
        tmp = Path(tmp_name)
        with redis_server(tmp) as redis_url:
            namespace = "h" + uuid.uuid4().hex[:10]
            dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: the producer never seals
            with sampler_process(tmp / "run", redis_url=redis_url, namespace=namespace, inference_urls=[dead],
                                 max_staleness=10**9, max_poll_timeout=60) as sampler:
                rows = asyncio.run(_measure(sampler.url, redis_url, namespace, sizes, reps, park_s, encodings))

    def cell(size: int, enc: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["target_bytes"] == size and r["encoding"] == enc), None)

    at1, at64 = cell(MIB, "msgpack"), cell(64 * MIB, "msgpack")
    result = {
        "benchmark": "handoff",
        "setup": {"sample": f"{PROMPT_TOKENS} prompt + {COMPLETION_TOKENS} completion tokens, float64 logprobs, texts",
                  "clock": "stats.sealed_at (before codec.pack, as the producer stamps it) -> body decoded by the client",
                  "processes": "redis-server, sampler (GET /batch), bench (sealer + long-polling client)"},
        "rows": rows,
        "target_p50_ms_at_1MiB": 5.0,
        "p50_ms_at_1MiB_msgpack": at1["p50_ms"] if at1 else None,
        "target_MB_per_s_at_64MiB_msgpack": 300.0,
        "MB_per_s_at_64MiB_msgpack": at64["MB_per_s_at_p50"] if at64 else None,
        "host": host(),
        "command": COMMAND,
    }
    if at1:
        result["meets_1MiB_target"] = at1["p50_ms"] <= 5.0
    if at64:
        result["meets_64MiB_target"] = at64["MB_per_s_at_p50"] >= 300.0
    lines = [
        "# Hand-off latency: batch sealed -> trainer holds it decoded",
        "",
        f"Synthetic batches sealed through the sampler's `Store.seal` while a client long-polls `GET /batch`; "
        f"samples of {result['setup']['sample']}. Latency from `stats.sealed_at` (stamped before `codec.pack`, "
        f"as the producer does) to the decoded body. Legs are medians. {host()['cpus']} CPUs, shared.",
        "",
        "| batch (msgpack) | samples | encoding | body | reps | p50 ms | p99 ms | MB/s at p50 | pack | seal | to response | decode | + pydantic |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        legs = r["legs_median_ms"]
        lines.append(
            f"| {r['msgpack_bytes'] / MIB:.2f} MiB | {r['samples']} | {r['encoding']} | {r['body_bytes'] / MIB:.2f} MiB | "
            f"{r['reps']} | {r['p50_ms']} | {r['p99_ms']} | {r['MB_per_s_at_p50']} | {legs['pack']} | {legs['seal']} | "
            f"{legs['to_response']} | {legs['decode']} | {r['pydantic_validate_ms']} |"
        )
    lines += ["", "Legs (ms): pack = `codec.pack` in the producer; seal = `Store.seal` (Lua SET NX + PUBLISH); "
              "to response = notifier wake-up, Redis GET, encoding on the sampler, HTTP transfer; decode = "
              "`codec.decode` on the client; + pydantic = `Batch.model_validate` (what `SamplerClient.get_batch` adds).", ""]
    if at1:
        lines.append(f"Target p50 <= 5 ms at 1 MiB (msgpack): {'met' if result['meets_1MiB_target'] else 'NOT met'} "
                     f"({at1['p50_ms']} ms).")
    if at64:
        lines.append(f"Target >= 300 MB/s at 64 MiB (msgpack): {'met' if result['meets_64MiB_target'] else 'NOT met'} "
                     f"({at64['MB_per_s_at_p50']} MB/s).")
    lines += ["", f"`{COMMAND}`"]
    write_results(results_dir, "handoff", result, "\n".join(lines))
    return result
