"""Hand-off latency: from a batch being sealed to the trainer holding it decoded.

Real processes on loopback: a private redis-server, the vLLM-protocol stand-in (it only has
to be there, at the published version, for the producer to start a batch), the sampler
(`tandem sampler`) with the `bench.handoff_strategy:SyntheticBatches` strategy (max_staleness 1), and
this process as the trainer. Per measurement it parks `GET /batch?step=N`, then opens the
strategy's gate for step N, and the sampler builds batch N (synthetic samples instead of
inference), packs it, seals it in Redis and answers the parked request, as it would any
batch.

Clocks, all wall time on this one host:
* sealed: this process's own Redis subscriber receives `sealed:N`, which the seal's Lua
  script publishes as it commits the batch. Sealed -> decoded is the issue's measure.
* built: `stats.sealed_at`, which the producer stamps when the payload is built, before it
  is packed and written to Redis. Built -> decoded is reported beside it, so packing and
  the Redis write are not hidden.
* decoded: the trainer's `SamplerClient` holds the decoded body (`get_batch_body` then
  `codec.decode`, which is `get_batch_raw`). Pydantic validation, which `get_batch` adds, is
  reported separately.

Encodings: `arrays` (`application/vnd.tandem+msgpack`, typed arrays; what `SamplerClient`
asks for), `msgpack` (plain) and `json`. MB/s is the stored batch (arrays form) over the p50.
Targets: p50 <= 5 ms at 1 MiB; >= 300 MB/s at 64 MiB with msgpack (the arrays form).

Writes bench/results/handoff.json and handoff.md; `python -m bench handoff`.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from bench._common import host, median, pct, redis_server, sampler_process, standin_process, write_results
from shared.client import SamplerClient

COMMAND = "make bench ARGS=handoff  (or .venv/bin/python -m bench handoff)"
KIB, MIB = 1024, 1024 * 1024
SIZES = (64 * KIB, 1 * MIB, 8 * MIB, 64 * MIB)
ENCODINGS = ("arrays", "msgpack", "json")
GROUP = 8


def prompts_for(target_bytes: int) -> int:
    """prompts_per_step (groups of GROUP samples) for a batch of about `target_bytes` (arrays form)."""
    import random

    from bench.handoff_strategy import make_sample
    from shared import codec

    rng = random.Random(0)
    per_sample = len(codec.pack_arrays({"samples": [make_sample(rng, i) for i in range(GROUP)]})) / GROUP
    return max(1, round(target_bytes / per_sample / GROUP))


class Announcements:
    """When this process heard each `sealed:N` on the run's events channel."""

    def __init__(self, redis_url: str, channel: str):
        self.redis = aioredis.from_url(redis_url)
        self.channel = channel
        self.heard: dict[int, float] = {}
        self._new = asyncio.Event()

    async def __aenter__(self) -> Announcements:
        self.pubsub = self.redis.pubsub()
        await self.pubsub.subscribe(self.channel)
        self.task = asyncio.create_task(self._listen())
        return self

    async def _listen(self) -> None:
        async for message in self.pubsub.listen():
            if message["type"] == "message" and message["data"].startswith(b"sealed:"):
                self.heard[int(message["data"][7:])] = time.time()
                self._new.set()

    async def wait(self, step: int, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while step not in self.heard:
            self._new.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no seal announcement for step {step} within {timeout}s")
            try:
                await asyncio.wait_for(self._new.wait(), remaining)
            except TimeoutError:
                pass
        return self.heard[step]

    async def __aexit__(self, *exc: object) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.pubsub.aclose()
        await self.redis.aclose()


async def _done(client: SamplerClient, step: int, timeout: float = 300) -> None:
    """Wait until the sampler has finished building `step` (its on-sealed hooks included), so
    the next measurement does not share the CPU with them."""
    deadline = time.monotonic() + timeout
    while any(p["step"] == step for p in (await client.status())["steps"]["in_progress"]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the sampler's build of batch {step} did not finish")
        await asyncio.sleep(0.02)


async def _one(client: SamplerClient, redis: aioredis.Redis, prefix: str, heard: Announcements, step: int,
               park_s: float) -> dict[str, float]:
    from bench.handoff_strategy import gate
    from shared import codec
    from shared.wire import Batch

    if step >= 2:  # max_staleness 1: batch N may be asked for (and built) once version N - 1 is out
        await client.publish_weights(step - 1)
    # What SamplerClient.get_batch_raw does, with the body's arrival timed on its own.
    poll = asyncio.create_task(client.get_batch_body(step, timeout=60))
    await asyncio.sleep(park_s)  # the request is parked on the sampler's notifier by now
    await redis.lpush(gate(prefix, step), 1)  # the build of batch `step` goes on
    content_type, content = await poll
    received = time.time()
    body = codec.decode(content_type, content)
    decoded = time.time()
    assert len(body["samples"]) == body["stats"]["num_samples"]
    sealed = await heard.wait(step, 10)
    t0 = time.perf_counter()
    Batch.model_validate(body)
    validate = time.perf_counter() - t0
    built = body["stats"]["sealed_at"]
    return {"latency": decoded - sealed, "built_to_decoded": decoded - built, "pack_and_seal": sealed - built,
            "to_response": received - sealed, "decode": decoded - received, "validate": validate,
            "body_bytes": len(content)}


async def _measure(url: str, redis_url: str, namespace: str, encodings: tuple[str, ...], reps: int,
                   park_s: float) -> tuple[list[dict[str, Any]], int]:
    from bench.handoff_strategy import gate
    from services.sampler.keys import Keys

    keys = Keys(namespace)
    results: list[dict[str, Any]] = []
    step = 0
    redis = aioredis.from_url(redis_url)
    try:
        async with Announcements(redis_url, keys.events) as heard:
            await redis.lpush(gate(keys.prefix, 0), 1)
            for encoding in encodings:
                async with SamplerClient(url, encoding=encoding, poll_timeout=60) as client:
                    if step == 0:
                        await client.get_batch_body(0, timeout=60)
                        await _done(client, 0)
                        stored_bytes = await redis.strlen(keys.batch(0))
                    runs = []
                    for i in range(reps + 1):  # one unmeasured warm-up per encoding
                        step += 1
                        res = await _one(client, redis, keys.prefix, heard, step, park_s)
                        await _done(client, step)
                        if i:
                            runs.append(res)
                results.append({"encoding": encoding, "runs": runs})
    finally:
        await redis.aclose()
    return results, stored_bytes


def _row(size: int, samples: int, stored_bytes: int, encoding: str, runs: list[dict[str, float]]) -> dict[str, Any]:
    lat = [x["latency"] for x in runs]
    p50 = median(lat)
    return {
        "target_bytes": size, "encoding": encoding, "samples": samples, "batch_bytes": stored_bytes,
        "body_bytes": runs[0]["body_bytes"], "reps": len(runs),
        "p50_ms": round(p50 * 1e3, 2), "p99_ms": round(pct(lat, 0.99) * 1e3, 2),
        "MB_per_s_at_p50": round(stored_bytes / p50 / 1e6, 1),
        "built_to_decoded_p50_ms": round(median([x["built_to_decoded"] for x in runs]) * 1e3, 2),
        "legs_median_ms": {leg: round(median([x[leg] for x in runs]) * 1e3, 2)
                           for leg in ("pack_and_seal", "to_response", "decode")},
        "pydantic_validate_ms": round(median([x["validate"] for x in runs]) * 1e3, 2),
    }


def run(results_dir: Path, *, sizes: tuple[int, ...] = SIZES, reps: dict[int, int] | None = None,
        park_s: float = 0.05, encodings: tuple[str, ...] = ENCODINGS,
        everysec_sizes: tuple[int, ...] = (64 * KIB, 1 * MIB, 8 * MIB), **sampler_settings: Any) -> dict:
    """Every size and encoding on a Redis that fsyncs every write (`appendfsync always`: the
    embedded Redis's and compose's setting); the arrays form at `everysec_sizes` also on one
    that fsyncs once a second, to show what durability costs."""
    reps = reps or {64 * KIB: 40, 1 * MIB: 40, 8 * MIB: 10, 64 * MIB: 5}
    rows = []
    plan = [("always", size, encodings) for size in sizes] + [("everysec", size, ("arrays",)) for size in everysec_sizes]
    with tempfile.TemporaryDirectory(prefix="tandem-bench-handoff-") as tmp_name:
        tmp = Path(tmp_name)
        with standin_process(tmp, 0.0) as standin:
            for fsync in ("always", "everysec"):
                todo = [(size, encs) for mode, size, encs in plan if mode == fsync]
                if not todo:
                    continue
                with redis_server(tmp, appendfsync=fsync) as redis_url:
                    for size, encs in todo:
                        prompts = prompts_for(size)
                        namespace = "h" + uuid.uuid4().hex[:10]
                        with sampler_process(tmp / f"run-{fsync}-{size}", redis_url=redis_url, namespace=namespace,
                                             inference_urls=[standin.url],
                                             strategy="bench.handoff_strategy:SyntheticBatches",
                                             prompts_per_step=prompts, num_generations=GROUP, max_staleness=1,
                                             keep_batches=1, max_poll_timeout=60, **sampler_settings) as sampler:
                            measured, stored = asyncio.run(_measure(sampler.url, redis_url, namespace, encs,
                                                                    reps.get(size, 5), park_s))
                        rows += [{**_row(size, prompts * GROUP, stored, m["encoding"], m["runs"]), "appendfsync": fsync}
                                 for m in measured]
    return _report(results_dir, rows)


def _report(results_dir: Path, rows: list[dict[str, Any]]) -> dict:
    from bench.handoff_strategy import COMPLETION_TOKENS, PROMPT_TOKENS

    def cell(size: int, enc: str, fsync: str = "always") -> dict[str, Any] | None:
        return next((r for r in rows if r["target_bytes"] == size and r["encoding"] == enc
                     and r["appendfsync"] == fsync), None)

    at1, at64 = cell(MIB, "arrays"), cell(64 * MIB, "arrays")
    result: dict[str, Any] = {
        "benchmark": "handoff",
        "setup": {"sample": f"{PROMPT_TOKENS} prompt + {COMPLETION_TOKENS} completion tokens, float64 logprobs, texts",
                  "clock": "seal announcement heard by an independent subscriber -> body decoded by the client",
                  "processes": "redis-server, stand-in, sampler (synthetic-batch strategy; builds, seals and "
                               "serves), bench (trainer: parks GET /batch, publishes the version, decodes)"},
        "rows": rows,
        "target_p50_ms_at_1MiB": 5.0,
        "p50_ms_at_1MiB_arrays": at1["p50_ms"] if at1 else None,
        "target_MB_per_s_at_64MiB": 300.0,
        "MB_per_s_at_64MiB_arrays": at64["MB_per_s_at_p50"] if at64 else None,
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
        f"The sampler builds batches of synthetic samples ({result['setup']['sample']}) through its own producer, "
        "seals them in Redis and answers a parked `GET /batch`. Latency from the seal's announcement (heard by an "
        "independent Redis subscriber) to the decoded body; built -> decoded adds packing and the Redis write. "
        f"Legs are medians. {host()['cpus']} CPUs.",
        "",
        "Redis fsyncs every write (`appendfsync always`, the embedded Redis's and compose's setting), so an "
        "acknowledged seal survives a kill -9 of Redis; the table after it compares a Redis that fsyncs once a second.",
        "",
        "| batch | samples | encoding | body | reps | p50 ms | p99 ms | MB/s at p50 | built -> decoded p50 ms "
        "| pack + seal | to response | decode | + pydantic |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["appendfsync"] != "always":
            continue
        legs = r["legs_median_ms"]
        lines.append(
            f"| {r['batch_bytes'] / MIB:.2f} MiB | {r['samples']} | {r['encoding']} | {r['body_bytes'] / MIB:.2f} MiB | "
            f"{r['reps']} | {r['p50_ms']} | {r['p99_ms']} | {r['MB_per_s_at_p50']} | {r['built_to_decoded_p50_ms']} | "
            f"{legs['pack_and_seal']} | {legs['to_response']} | {legs['decode']} | {r['pydantic_validate_ms']} |"
        )
    lines += ["", "batch = the stored batch (arrays form); MB/s = batch / p50. Legs (ms): pack + seal = "
              "`codec.pack_arrays` and `Store.seal` in the producer, up to the announcement; to response = "
              "wake-up, encoding for the request, HTTP transfer; decode = `codec.decode` on the client; "
              "+ pydantic = `Batch.model_validate` (what `SamplerClient.get_batch` adds).", ""]
    compared = [(r, cell(r["target_bytes"], "arrays")) for r in rows if r["appendfsync"] == "everysec"]
    compared = [(e, a) for e, a in compared if a is not None]
    if compared:
        result["durability_cost"] = [
            {"batch_bytes": a["batch_bytes"], "p50_ms": {"always": a["p50_ms"], "everysec": e["p50_ms"]},
             "built_to_decoded_p50_ms": {"always": a["built_to_decoded_p50_ms"], "everysec": e["built_to_decoded_p50_ms"]},
             "pack_and_seal_ms": {"always": a["legs_median_ms"]["pack_and_seal"],
                                  "everysec": e["legs_median_ms"]["pack_and_seal"]}}
            for e, a in compared]
        lines += ["**What fsyncing every write costs** (arrays form; each cell always / everysec):", "",
                  "| batch | p50 ms (sealed -> decoded) | built -> decoded p50 ms | pack + seal ms |", "|---|---|---|---|"]
        for e, a in compared:
            lines.append(f"| {a['batch_bytes'] / MIB:.2f} MiB | {a['p50_ms']} / {e['p50_ms']} | "
                         f"{a['built_to_decoded_p50_ms']} / {e['built_to_decoded_p50_ms']} | "
                         f"{a['legs_median_ms']['pack_and_seal']} / {e['legs_median_ms']['pack_and_seal']} |")
        lines += ["", "The seal's announcement reaches subscribers after the fsync, so the sealed -> decoded clock "
                  "starts after it; built -> decoded and pack + seal include it.", ""]
    if at1:
        lines.append(f"Target p50 <= 5 ms at 1 MiB (arrays): {'met' if result['meets_1MiB_target'] else 'NOT met'} "
                     f"({at1['p50_ms']} ms).")
    if at64:
        lines.append(f"Target >= 300 MB/s at 64 MiB (arrays): {'met' if result['meets_64MiB_target'] else 'NOT met'} "
                     f"({at64['MB_per_s_at_p50']} MB/s).")
    lines += ["", f"`{COMMAND}`"]
    write_results(results_dir, "handoff", result, "\n".join(lines))
    return result
