"""Does `make demo` solve its task on every seed, and stay solved? (issue 16, stable convergence)

Runs `tandem demo --seed S` with the defaults for each seed, one after another (each is the
whole stack: Redis, the CPU inference server, the sampler, the trainer), and records the
greedy eval after training, the lowest eval after the first one >= 0.95 (a run that learns
then forgets shows it here), the steps the trainer left the weights alone because the batch
carried no advantage, and the wall time. The target: eval after >= 0.95 on seeds 0-4, each
within 300 s.

    .venv/bin/python -m bench convergence
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import REPO, host, write_results

TARGET_REWARD = 0.95
TARGET_SECONDS = 300.0


def sampled_reward_last(run_dir: Path, n: int = 10) -> float | None:
    """Mean sampled (training) reward of the last `n` steps: the policy the run samples from,
    which a greedy eval alone does not show (issue 44.4)."""
    lines = (run_dir / "trainer_metrics.jsonl").read_text().splitlines()
    rewards = [r["reward_mean"] for r in map(json.loads, lines)
               if r.get("event") == "step" and r.get("reward_mean") is not None]
    return round(sum(rewards[-n:]) / len(rewards[-n:]), 4) if rewards else None


def run_seed(seed: int, run_dir: Path, sampled_target: float | None = None, **flags: Any) -> dict[str, Any]:
    argv = [sys.executable, "-m", "services.cli", "demo", "--seed", str(seed), "--run-dir", str(run_dir),
            "--no-progress", *[f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]]
    started = time.monotonic()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=TARGET_SECONDS * 3)
    wall = time.monotonic() - started
    if done.returncode != 0:
        return {"seed": seed, "ok": False, "exit": done.returncode, "wall_seconds": round(wall, 1),
                "error": (done.stdout + done.stderr)[-2000:]}
    summary = json.loads((run_dir / "summary.json").read_text())
    rewards = [e["reward"] for e in summary["evals"] if e.get("reward") is not None]
    solved_at = next((i for i, r in enumerate(rewards) if r >= TARGET_REWARD), None)
    after = summary["eval_reward_after"]
    sampled = sampled_reward_last(run_dir)
    return {
        "seed": seed, "wall_seconds": round(wall, 1), "steps": summary["steps"],
        "eval_reward_before": summary.get("eval_reward_before"), "eval_reward_after": after,
        "first_eval_version_at_target": summary["evals"][solved_at]["version"] if solved_at is not None else None,
        "lowest_eval_after_reaching_target": min(rewards[solved_at:]) if solved_at is not None else None,
        "reward_mean_last": summary["reward_mean_last"], "sampled_reward_last10": sampled,
        "skipped_steps_no_signal": summary.get("skipped_steps_no_signal"),
        "ok": (after is not None and after >= TARGET_REWARD and wall <= TARGET_SECONDS
               and (sampled_target is None or (sampled is not None and sampled >= sampled_target))),
    }


def run(results_dir: Path, seeds: tuple[int, ...] = (0, 1, 2, 3, 4), name: str = "convergence",
        sampled_target: float | None = None, **flags: Any) -> dict[str, Any]:
    """Every seed with the demo's defaults plus `flags`; results as bench/results/<name>.*.
    `sampled_target`: a seed is ok only if its sampled reward over the last 10 steps reaches it too."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-convergence-") as tmp:
        for seed in seeds:
            rows.append(run_seed(seed, Path(tmp) / f"seed{seed}", sampled_target, **flags))
            print(json.dumps(rows[-1]), flush=True)
    result = {"target": {"eval_reward_after": TARGET_REWARD, "wall_seconds": TARGET_SECONDS,
                         "sampled_reward_last10": sampled_target},
              "flags": flags, "rows": rows, "all_ok": all(r["ok"] for r in rows), "host": host()}
    extra = "".join(f" --{k.replace('_', '-')} {v}" for k, v in flags.items())
    lines = [f"# Demo convergence over seeds{extra}", "",
             f"`.venv/bin/python -m bench {name}`: `tandem demo --seed S{extra}` with the defaults, one seed after "
             f"another on this machine ({result['host']['cpus']} CPUs). Target: greedy eval after >= "
             f"{TARGET_REWARD}" + (f" and sampled reward (mean of the last 10 steps) >= {sampled_target}"
                                   if sampled_target is not None else "")
             + f" within {TARGET_SECONDS:.0f} s, every seed.", "",
             "| seed | ok | wall s | eval before | eval after | first version at >= 0.95 | lowest eval after that | "
             "sampled reward last step | sampled reward last 10 | steps without signal |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seed']} | {'yes' if r['ok'] else 'NO'} | {r['wall_seconds']} | {r.get('eval_reward_before')} | "
                     f"{r.get('eval_reward_after')} | "
                     f"{r.get('first_eval_version_at_target')} | {r.get('lowest_eval_after_reaching_target')} | "
                     f"{r.get('reward_mean_last')} | {r.get('sampled_reward_last10')} | {r.get('skipped_steps_no_signal')} |")
    write_results(results_dir, name, result, "\n".join(lines))
    return result
