"""Sampler throughput with instantaneous inference: completions/s and sampler CPU per completion.

Real processes on loopback: a private redis-server, the vLLM-protocol stand-in with
token_latency 0 (every token is free), the sampler (`tandem sampler`, the built-in toy
environment) and a trainer stand-in that takes each batch (msgpack) and publishes the next
version immediately (T = 0). max_staleness 2 lets the producer run up to two batches ahead.

Measured over the steps after warm-up: completions/s at the trainer (wall), and the
sampler process's CPU seconds (utime + stime from /proc/PID/stat, all threads) per
completion; 1 / that is what one core of sampler could sustain if inference, Redis and the
trainer were elsewhere. On a 2-core machine all four processes share the cores, so the wall
rate is bounded by the stand-in as much as by the sampler: both CPU figures are reported.
36 steps are measured per run (about 5 s here): with the former 14 (~2 s), back-to-back
runs differed by up to 20%, as a window that short holds only a few of the sampler's full
garbage collections (one every few batches) and catches any burst of other work whole.

The trainer stand-in asks for batches as `SamplerClient` does (`Accept: FRAMES`, the stored
chunks sent as they are); `accept=codec.ARRAYS` measures the transcoded msgpack form instead.

Targets: >= 5,000 completions/s, and sampler CPU per completion <= 50 us + 0.5 us per
completion token (the measured mean completion length of each run).

Writes bench/results/throughput.json and throughput.md; `python -m bench throughput`.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench._common import (
    cpu_seconds, host, median, redis_server, sampler_process, standin_process, trainer_loop, write_results,
)
from shared.chunks import FRAMES

COMMAND = "make bench ARGS=throughput  (or .venv/bin/python -m bench throughput)"
# Sampler CPU per completion: at most this many microseconds, plus CPU_US_PER_TOKEN per completion token.
CPU_US_BASE, CPU_US_PER_TOKEN = 50.0, 0.5


def cpu_target_us(tokens_per_completion: float) -> float:
    return CPU_US_BASE + CPU_US_PER_TOKEN * tokens_per_completion


def _one_run(tmp: Path, redis_url: str, *, steps: int, warmup: int, shape: dict[str, int],
             max_concurrency: int, accept: str) -> dict[str, Any]:
    with standin_process(tmp, 0.0) as standin:
        with sampler_process(tmp / f"run-{uuid.uuid4().hex[:8]}", redis_url=redis_url,
                             namespace="t" + uuid.uuid4().hex[:10], inference_urls=[standin.url],
                             max_staleness=2, max_concurrency=max_concurrency, keep_batches=4, **shape) as sampler:
            marks: dict[str, float] = {}

            async def on_step(step: int) -> None:
                if step == warmup:
                    marks.update(t=time.perf_counter(), sampler=cpu_seconds(sampler.pid),
                                 standin=cpu_seconds(standin.pid))

            records = asyncio.run(trainer_loop(sampler.url, steps, 0.0, accept=accept, on_step=on_step,
                                               deadline_s=300))
            end = {"t": time.perf_counter(), "sampler": cpu_seconds(sampler.pid), "standin": cpu_seconds(standin.pid)}
    measured = records[warmup + 1:]
    completions = sum(r["samples"] for r in measured)
    tokens = sum(r["stats"]["completion_tokens_mean"] * r["samples"] for r in measured)
    wall = end["t"] - marks["t"]
    sampler_cpu = end["sampler"] - marks["sampler"]
    standin_cpu = end["standin"] - marks["standin"]
    return {
        "completions": completions,
        "wall_s": round(wall, 3),
        "completions_per_s": round(completions / wall, 1),
        "completion_tokens_per_s": round(tokens / wall, 1),
        "sampler_cpu_s": round(sampler_cpu, 3),
        "sampler_cpu_us_per_completion": round(sampler_cpu / completions * 1e6, 1),
        "completion_tokens_per_completion": round(tokens / completions, 2),
        "cpu_target_us_per_completion": round(cpu_target_us(tokens / completions), 1),
        "sampler_core_utilisation": round(sampler_cpu / wall, 3),
        "sampler_one_core_capacity_completions_per_s": round(completions / sampler_cpu, 1) if sampler_cpu else None,
        "standin_cpu_us_per_completion": round(standin_cpu / completions * 1e6, 1),
        "batch_bytes": measured[-1]["bytes"] if measured else None,
    }


def run(results_dir: Path, *, steps: int = 40, warmup: int = 3, repeats: int = 3, prompts_per_step: int = 64,
        num_generations: int = 16, max_tokens: int = 16, max_concurrency: int = 64, accept: str = FRAMES) -> dict:
    shape = {"prompts_per_step": prompts_per_step, "num_generations": num_generations, "max_tokens": max_tokens}
    load_at_start = round(os.getloadavg()[0], 2)  # other work on the machine skews both CPU figures
    with tempfile.TemporaryDirectory(prefix="tandem-bench-throughput-") as tmp_name:
        tmp = Path(tmp_name)
        with redis_server(tmp) as redis_url:
            runs = [_one_run(tmp, redis_url, steps=steps, warmup=warmup, shape=shape, max_concurrency=max_concurrency,
                             accept=accept)
                    for _ in range(repeats)]
    keys = ("completions_per_s", "completion_tokens_per_s", "sampler_cpu_us_per_completion",
            "sampler_core_utilisation", "sampler_one_core_capacity_completions_per_s", "standin_cpu_us_per_completion",
            "completion_tokens_per_completion", "cpu_target_us_per_completion")
    med = {k: median([r[k] for r in runs if r[k] is not None]) for k in keys}
    result = {
        "benchmark": "throughput",
        "setup": {"batch": f"{prompts_per_step} prompts x {num_generations} generations (n per request), "
                           f"max_tokens {max_tokens}, temperature 1, toy env",
                  "inference": "stand-in, token_latency 0", "max_staleness": 2, "max_concurrency": max_concurrency,
                  "steps": steps, "warmup_discarded": warmup, "repeats": repeats,
                  "trainer": f"GET /batch (Accept: {accept}) -> POST /weights_version at once (T = 0)"},
        "runs": runs,
        "median": med,
        "target_completions_per_s": 5000,
        "meets_target_wall": med["completions_per_s"] >= 5000,
        "meets_target_one_core_capacity": (med["sampler_one_core_capacity_completions_per_s"] or 0) >= 5000,
        "cpu_target": f"sampler CPU per completion <= {CPU_US_BASE:g} us + {CPU_US_PER_TOKEN:g} us x completion tokens",
        "meets_target_cpu_per_completion": med["sampler_cpu_us_per_completion"] <= med["cpu_target_us_per_completion"],
        "host": {**host(), "loadavg_1m_at_start": load_at_start},
        "command": COMMAND,
    }
    lines = [
        "# Sampler throughput (instantaneous inference)",
        "",
        f"Stand-in inference with zero latency, batch {result['setup']['batch']}, trainer stand-in with T = 0, "
        f"max_staleness 2, trainer asking `Accept: {accept}`; {steps - warmup - 1} measured steps after {warmup} "
        f"warm-up, {repeats} runs. "
        f"Sampler, stand-in, Redis and trainer share {host()['cpus']} CPUs (shared with other work; "
        f"1-minute load average {load_at_start} before the runs, {result['host']['loadavg_1m_at_end']} after).",
        "",
        "| run | completions/s (wall) | tokens/s | sampler CPU us/completion | target us/completion | sampler cores busy "
        "| one-core capacity completions/s | stand-in CPU us/completion |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(runs + [med]):
        lines.append(
            f"| {'median' if i == len(runs) else i + 1} | {r['completions_per_s']} | {r['completion_tokens_per_s']} | "
            f"{r['sampler_cpu_us_per_completion']} | {r['cpu_target_us_per_completion']} | {r['sampler_core_utilisation']} | "
            f"{r['sampler_one_core_capacity_completions_per_s']} | {r['standin_cpu_us_per_completion']} |"
        )
    lines += [
        "",
        "One-core capacity = completions / sampler CPU seconds: the rate one dedicated core of sampler sustains.",
        f"Target >= 5,000 completions/s: wall {'met' if result['meets_target_wall'] else 'NOT met'} "
        f"({med['completions_per_s']}/s); one-core capacity "
        f"{'met' if result['meets_target_one_core_capacity'] else 'NOT met'} "
        f"({med['sampler_one_core_capacity_completions_per_s']}/s).",
        f"Target sampler CPU <= {CPU_US_BASE:g} us + {CPU_US_PER_TOKEN:g} us x completion tokens per completion "
        f"({med['completion_tokens_per_completion']} tokens: {med['cpu_target_us_per_completion']} us): "
        f"{'met' if result['meets_target_cpu_per_completion'] else 'NOT met'} "
        f"({med['sampler_cpu_us_per_completion']} us).",
        "",
        f"`{COMMAND}`",
    ]
    write_results(results_dir, "throughput", result, "\n".join(lines))
    return result
