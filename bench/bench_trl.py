"""The native trainer and TRL's GRPOTrainer fed by Tandem, on the same demo (issue 17).

`tandem demo --seed S` and `tandem demo --seed S --trainer trl` with the demo's defaults, one
run after another (each the whole stack: Redis, the CPU inference server, the sampler and the
trainer), seeds 0-4. Same sampler, batch shape, steps, learning rate, loss and evals; only the
trainer process differs. Records what `bench convergence` records for each.

    .venv/bin/python -m bench trl
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from statistics import median
from typing import Any

from bench._common import host, write_results
from bench.bench_convergence import TARGET_REWARD, TARGET_SECONDS, run_seed

TRAINERS = ("native", "trl")


def run(results_dir: Path, seeds: tuple[int, ...] = (0, 1, 2, 3, 4)) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-trl-bench-") as tmp:
        for seed in seeds:
            for trainer in TRAINERS:
                row = {"trainer": trainer, **run_seed(seed, Path(tmp) / f"{trainer}-{seed}", trainer=trainer)}
                rows.append(row)
                print(json.dumps(row), flush=True)

    def column(trainer: str, key: str) -> list[float]:
        return [r[key] for r in rows if r["trainer"] == trainer and isinstance(r.get(key), (int, float))]

    medians = {t: {"wall_seconds": median(column(t, "wall_seconds")) if column(t, "wall_seconds") else None,
                   "eval_reward_after": median(column(t, "eval_reward_after")) if column(t, "eval_reward_after")
                   else None,
                   "seeds_ok": sum(r["ok"] for r in rows if r["trainer"] == t)} for t in TRAINERS}
    result = {"target": {"eval_reward_after": TARGET_REWARD, "wall_seconds": TARGET_SECONDS},
              "rows": rows, "medians": medians, "host": host()}
    write_results(results_dir, "trl", result, markdown(result))
    return result


def markdown(result: dict[str, Any]) -> str:
    lines = ["# Native trainer vs TRL's GRPOTrainer fed by Tandem", "",
             "`.venv/bin/python -m bench trl`: `tandem demo --seed S [--trainer trl]` with the demo's defaults "
             "(toy task, 150 steps of 8 prompts x 16 generations, max_staleness 1, lr 1e-3, grpo loss, greedy "
             f"eval of 64 prompts every 10 steps), one run after another on this machine ({result['host']['cpus']} "
             "CPUs).", "",
             "| seed | trainer | ok | wall s | eval after | first version at >= 0.95 | lowest eval after that | "
             "sampled reward last step | steps without signal |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result['rows']:
        lines.append(f"| {r['seed']} | {r['trainer']} | {'yes' if r['ok'] else 'NO'} | {r['wall_seconds']} | "
                     f"{r.get('eval_reward_after')} | {r.get('first_eval_version_at_target')} | "
                     f"{r.get('lowest_eval_after_reaching_target')} | {r.get('reward_mean_last')} | "
                     f"{r.get('skipped_steps_no_signal')} |")
    lines += ["", "| trainer | seeds at target | median wall s | median eval after |", "|---|---|---|---|"]
    for t, m in result['medians'].items():
        lines.append(f"| {t} | {m['seeds_ok']}/{len(result['rows']) // len(TRAINERS)} | {m['wall_seconds']} | {m['eval_reward_after']} |")
    return "\n".join(lines)
