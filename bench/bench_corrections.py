"""Which off-policy correction should a user pick when samples are stale? (issue 29)

Runs the toy task (`tandem demo`, the whole stack on CPU) at max_staleness 4 with a learning
rate high enough that staleness hurts (LEARNING_RATE; how it was found: the "search" mode
below and bench/results/corrections_lr_search.md), once per configuration and seed, one run
after another:

* `none`: no importance sampling (`tis_cap 0`): the PPO ratio is taken against the
  behaviour logprobs mu;
* `truncate`: the trainer's default, IS weight pi_old/mu truncated at tis_cap 2;
* `mask`: IcePop-style token masking (`is_mode mask`): tokens whose pi_old/mu is outside
  [is_low, is_high] = [0.5, 5] carry no loss;
* `seq_reject`: the default truncation plus sequence rejection: a completion whose
  geometric-mean pi_old/mu over its loss tokens is outside SEQ_REJECT_BAND carries no loss.

Every run disables the trainer's behaviour-mismatch guard (`max_behaviour_mismatch 0`): at
this learning rate and staleness it would stop most runs, whatever the correction.

Per run: the greedy eval after training, the version of the first eval >= 0.9 and the lowest
eval after it, the measured staleness, the mean over steps of behaviour_mismatch
(mean |log pi_old - log mu|) and mismatch_k3 (k3 estimate of KL(mu || pi_old)), the fractions
of loss tokens truncated / masked and of completions rejected, and the wall time. Results:
bench/results/corrections.{json,md} (a subset, e.g. `--seeds 0 --configs none`, writes
corrections-subset.* unless --name says otherwise).

    .venv/bin/python -m bench corrections                     # the whole comparison (20 runs)
    .venv/bin/python -m bench corrections --seeds 0,1 --configs none,mask --lr 5e-3 --steps 100
    .venv/bin/python -m bench corrections --search 2e-3,5e-3,1e-2 --seeds 0,1   # the LR search
    .venv/bin/python -m bench corrections --render    # rewrite the markdown from the JSON
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import REPO, host, write_results
from bench.bench_multiturn import _code_state

MAX_STALENESS = 4
LEARNING_RATE = 5e-3  # 5x the demo's default; how it was chosen: corrections_lr_search.md
STEPS = 150  # the demo's default for the toy task
TARGET = 0.9
# |log of the geometric mean| < 0.22 nats, about twice the mean per-token behaviour_mismatch (~0.1)
# measured at LEARNING_RATE; [0.9, 1.1] rejected 31% of the completions in a pilot run, this band
# ~10% (corrections_lr_search.md, "Band pilot").
SEQ_REJECT_BAND = (0.8, 1.25)
# Every run: the guard would stop the runs this bench is about (see the module docstring).
COMMON_TRAINER_ARGS: dict[str, Any] = {"max_behaviour_mismatch": 0}
CONFIGS: dict[str, dict[str, Any]] = {
    "none": {"tis_cap": 0},
    "truncate": {},
    "mask": {"is_mode": "mask"},
    "seq_reject": {"seq_reject_low": SEQ_REJECT_BAND[0], "seq_reject_high": SEQ_REJECT_BAND[1]},
}
SEARCH_CONFIGS = ("none", "truncate")
RUN_TIMEOUT = 900.0

# What a user should choose, from the committed full run (bench/results/corrections.md); it
# names the code it was measured on, and a rerun keeps it unless it is rewritten.
VERDICT = (
    "Measured at commit 6602f20, lr 5e-3, staleness 3.9 on average. Every correction reached an eval >= 0.9 "
    "sooner than none (mean first version 32-46 against 60, and none missed it on one seed), but the final evals "
    "are within seed noise of one another (means 0.89-0.96 with sd 0.05-0.24; every configuration has seeds "
    "ending below 0.95, and seq_reject's mean is pulled down by one seed that fell to 0.47 at the end); none "
    "seed 0 reached 0.9 at version 80 in the learning-rate search (on the commit before the corrections) and "
    "never here. "
    "So: keep a correction on when samples are stale; the default truncation is as good as any here on eval. "
    "mask (or seq_reject) bounded the mismatch better (mean behaviour_mismatch 0.14 / 0.11 against 0.27, "
    "largest step 1.2 / 1.7 nats against 6.3-6.8 on two truncate seeds) without a measurable gain in eval; "
    "5 seeds on this task cannot rank them. Wall times cannot be compared across configurations: none ran "
    "first, while other work loaded the machine (91-136 s a run against 55-74 s for the rest).")


def _mean(values: list[Any]) -> float | None:
    xs = [float(v) for v in values if isinstance(v, (int, float))]
    return statistics.fmean(xs) if xs else None


def _std(values: list[Any]) -> float | None:
    xs = [float(v) for v in values if isinstance(v, (int, float))]
    return statistics.stdev(xs) if len(xs) > 1 else None


def run_one(config: str, seed: int, run_dir: Path, *, lr: float, steps: int,
            trainer_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """One `tandem demo` run; its row (see `row_of`), or the error when the demo failed."""
    args = COMMON_TRAINER_ARGS | CONFIGS[config] if trainer_args is None else trainer_args
    argv = [sys.executable, "-m", "services.cli", "demo", "--seed", str(seed), "--run-dir", str(run_dir),
            "--no-progress", "--max-staleness", str(MAX_STALENESS), "--learning-rate", repr(lr),
            "--steps", str(steps), "--trainer-args", json.dumps(args)]
    started = time.monotonic()
    try:
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        return {"config": config, "seed": seed, "lr": lr, "ok": False, "error": f"timed out after {RUN_TIMEOUT:.0f} s"}
    wall = time.monotonic() - started
    if done.returncode != 0:
        return {"config": config, "seed": seed, "lr": lr, "ok": False, "exit": done.returncode,
                "wall_seconds": round(wall, 1), "error": (done.stdout + done.stderr)[-2000:]}
    summary = json.loads((run_dir / "summary.json").read_text())
    steps_records = [json.loads(line) for line in (run_dir / "trainer_metrics.jsonl").read_text().splitlines()
                     if line.strip()]
    return {"config": config, "seed": seed, "lr": lr, **row_of(summary, steps_records), "wall_seconds": round(wall, 1)}


def row_of(summary: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's row from the demo's summary.json and the trainer's metric records."""
    steps = [r for r in records if r.get("event") == "step"]
    evals = [e for e in summary.get("evals", []) if isinstance(e.get("reward"), (int, float))]
    first = next((i for i, e in enumerate(evals) if e["reward"] >= TARGET), None)

    def per_step(key: str) -> float | None:
        return _mean([r.get(key) for r in steps])

    return {
        "ok": True,
        "steps": summary.get("steps"),
        "eval_reward_after": summary.get("eval_reward_after"),
        "first_version_at_target": evals[first]["version"] if first is not None else None,
        "lowest_eval_after_target": min(e["reward"] for e in evals[first:]) if first is not None else None,
        "eval_max": max((e["reward"] for e in evals), default=None),
        "staleness_mean": summary.get("staleness_mean"),
        "staleness_max": summary.get("staleness_max"),
        "behaviour_mismatch_mean": per_step("behaviour_mismatch"),
        "behaviour_mismatch_max": max((r["behaviour_mismatch"] for r in steps if "behaviour_mismatch" in r),
                                      default=None),
        "mismatch_k3_mean": per_step("mismatch_k3"),
        "truncated_fraction": per_step("is_truncated_fraction"),
        "masked_fraction": per_step("is_masked_fraction"),
        "rejected_fraction": per_step("rejected_fraction"),
        "clip_fraction": per_step("clip_fraction"),
        "reward_mean_last": summary.get("reward_mean_last"),
        "skipped_steps_non_finite": summary.get("skipped_steps_non_finite"),
    }


def aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over one configuration's successful runs (steps to target over the runs that got there)."""
    ok = [r for r in rows if r.get("ok")]
    reached = [r for r in ok if r.get("first_version_at_target") is not None]
    keys = ("eval_reward_after", "lowest_eval_after_target", "staleness_mean", "behaviour_mismatch_mean",
            "mismatch_k3_mean", "truncated_fraction", "masked_fraction", "rejected_fraction", "wall_seconds")
    out: dict[str, Any] = {"runs": len(rows), "ok": len(ok), "reached_target": len(reached),
                           "eval_reward_after_std": _std([r.get("eval_reward_after") for r in ok]),
                           "first_version_at_target": _mean([r["first_version_at_target"] for r in reached])}
    out.update({k: _mean([r.get(k) for r in ok]) for k in keys})
    return out


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None:
        return "-"
    return format(value, spec) if isinstance(value, float) else str(value)


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def config_table(by_config: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| config | eval after (mean ± sd) | reached >= 0.9 | first version >= 0.9 | lowest eval after | "
             "staleness | behaviour_mismatch | mismatch_k3 | truncated | masked | rejected | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, a in by_config.items():
        sd = a.get("eval_reward_after_std")
        after = _fmt(a.get("eval_reward_after")) + (f" ± {sd:.3f}" if sd is not None else "")
        lines.append(
            f"| {name} | {after} | {a['reached_target']}/{a['runs']} | {_fmt(a.get('first_version_at_target'), '.1f')} | "
            f"{_fmt(a.get('lowest_eval_after_target'))} | {_fmt(a.get('staleness_mean'), '.2f')} | "
            f"{_fmt(a.get('behaviour_mismatch_mean'), '.4f')} | {_fmt(a.get('mismatch_k3_mean'), '.4f')} | "
            f"{_pct(a.get('truncated_fraction'))} | {_pct(a.get('masked_fraction'))} | "
            f"{_pct(a.get('rejected_fraction'))} | {_fmt(a.get('wall_seconds'), '.1f')} |")
    return lines


def run_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| config | lr | seed | eval after | first version >= 0.9 | lowest eval after | staleness | "
             "behaviour_mismatch (mean / max) | mismatch_k3 | truncated | masked | rejected | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("ok"):
            error = (r.get("error") or "").strip().splitlines()
            lines.append(f"| {r['config']} | {r['lr']:g} | {r['seed']} | FAILED (exit {r.get('exit')}): "
                         f"{error[-1][:120] if error else ''} | | | | | | | | | {_fmt(r.get('wall_seconds'))} |")
            continue
        lines.append(
            f"| {r['config']} | {r['lr']:g} | {r['seed']} | {_fmt(r.get('eval_reward_after'))} | "
            f"{_fmt(r.get('first_version_at_target'))} | {_fmt(r.get('lowest_eval_after_target'))} | "
            f"{_fmt(r.get('staleness_mean'), '.2f')} | {_fmt(r.get('behaviour_mismatch_mean'), '.4f')} / "
            f"{_fmt(r.get('behaviour_mismatch_max'), '.3f')} | {_fmt(r.get('mismatch_k3_mean'), '.4f')} | "
            f"{_pct(r.get('truncated_fraction'))} | {_pct(r.get('masked_fraction'))} | "
            f"{_pct(r.get('rejected_fraction'))} | {_fmt(r.get('wall_seconds'), '.1f')} |")
    return lines


def _trainer_flags(config: str) -> str:
    args = CONFIGS[config]
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in args.items()) or "(defaults)"


def markdown(result: dict[str, Any], search: dict[str, Any] | None) -> str:
    s = result["setup"]
    lines = [
        "# Off-policy corrections under staleness (issue 29)", "",
        f"`{result['command']}` on this machine ({result['host']['cpus']} CPUs, shared by the demo's processes; "
        f"load {result['host']['loadavg_1m_at_end']} at the end); code: commit {result['code']['head'][:12]}"
        + (f", uncommitted changes in {', '.join(result['code']['uncommitted_files'])}"
           if result["code"]["uncommitted_files"] else "") + ".", "",
        f"Each run is `tandem demo --seed S --max-staleness {s['max_staleness']} --learning-rate {s['lr']:g} "
        f"--steps {s['steps']} --trainer-args '{{...}}'` (the toy task; the demo's default learning rate is 1e-3), "
        "one after another. Every run passes `max_behaviour_mismatch 0` to the trainer (the guard would "
        "otherwise stop runs at this learning rate and staleness), plus its configuration's trainer settings:", "",
    ]
    lines += [f"* `{name}`: {_trainer_flags(name)}" for name in result["configs"]]
    lines += ["", "Columns: greedy eval (64 held-out prompts) after training; runs whose periodic eval (every 10 "
              "versions) reached >= 0.9, the first such version and the lowest eval after it (a run that learns "
              "then forgets shows here); staleness = mean over samples of trainer step - policy version; "
              "behaviour_mismatch = mean |log pi_old - log mu| over loss tokens, mismatch_k3 = the k3 estimate of "
              "KL(mu || pi_old), both averaged over steps; truncated/masked = fraction of loss tokens whose IS "
              "weight hit tis_cap / fell outside the band; rejected = fraction of completions rejected; means over "
              "steps, then over seeds.", "", "## By configuration (mean over seeds)", ""]
    lines += config_table(result["by_config"])
    lines += ["", "## Every run", ""]
    lines += run_table(result["rows"])
    if VERDICT:
        lines += ["", "## What to choose", "", VERDICT]
    if search:
        lines += ["", "## Choosing the learning rate", "", *search_summary(search)]
    return "\n".join(lines)


def search_summary(search: dict[str, Any]) -> list[str]:
    lines = [f"`{search['command']}` (commit {search['code']['head'][:12]}): configs "
             f"{', '.join(search['configs'])} at max_staleness {search['setup']['max_staleness']}, "
             f"{search['setup']['steps']} steps, seeds {', '.join(map(str, search['setup']['seeds']))}; "
             "every run in corrections_lr_search.md.", "",
             "| lr | config | eval after (per seed) | first version >= 0.9 (per seed) | behaviour_mismatch mean | staleness |",
             "|---|---|---|---|---|---|"]
    groups: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for r in search["rows"]:
        groups.setdefault((r["lr"], r["config"]), []).append(r)
    for (lr, config), rows in groups.items():
        evals = ", ".join(_fmt(r.get("eval_reward_after")) if r.get("ok") else "FAILED" for r in rows)
        firsts = ", ".join(_fmt(r.get("first_version_at_target")) for r in rows)
        a = aggregate(rows)
        lines.append(f"| {lr:g} | {config} | {evals} | {firsts} | {_fmt(a.get('behaviour_mismatch_mean'), '.4f')} | "
                     f"{_fmt(a.get('staleness_mean'), '.2f')} |")
    if search.get("notes"):
        lines += ["", search["notes"]]
    return lines


def search_markdown(search: dict[str, Any]) -> str:
    lines = ["# Learning-rate search for the corrections bench", "", *search_summary(search), "",
             "## Every run", "", *run_table(search["rows"])]
    pilot = search.get("band_pilot")
    if pilot:  # recorded by hand: runs that chose SEQ_REJECT_BAND (and a first look at mask)
        lines += ["", "## Band pilot", "", pilot["description"], "", *run_table(pilot["rows"])]
    return "\n".join(lines)


def render(results_dir: Path) -> None:
    """Rewrite corrections.md and corrections_lr_search.md from their JSON (after editing VERDICT or
    the search's notes), without running anything."""
    results_dir = Path(results_dir)
    search_path = results_dir / "corrections_lr_search.json"
    search = json.loads(search_path.read_text()) if search_path.exists() else None
    if search is not None:
        (results_dir / "corrections_lr_search.md").write_text(search_markdown(search).rstrip() + "\n")
    main = results_dir / "corrections.json"
    if main.exists():
        (results_dir / "corrections.md").write_text(markdown(json.loads(main.read_text()), search).rstrip() + "\n")


def run(results_dir: Path, seeds: tuple[int, ...] = (0, 1, 2, 3, 4), configs: tuple[str, ...] = tuple(CONFIGS),
        steps: int = STEPS, lr: float = LEARNING_RATE, name: str | None = None,
        search: tuple[float, ...] = (), command: str | None = None, render_only: bool = False) -> dict[str, Any]:
    """Every configuration on every seed (or, with `search`, SEARCH_CONFIGS at each learning rate);
    with `render_only`, rewrite the markdown from the JSON results (`render`) and return those."""
    if render_only:
        render(results_dir)
        path = Path(results_dir) / "corrections.json"
        return json.loads(path.read_text()) if path.exists() else {}
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configs {unknown}; available: {list(CONFIGS)}")
    results_dir = Path(results_dir)
    full = tuple(seeds) == (0, 1, 2, 3, 4) and tuple(configs) == tuple(CONFIGS) and steps == STEPS and lr == LEARNING_RATE
    if search:
        configs = configs if configs != tuple(CONFIGS) else SEARCH_CONFIGS
        name = name or "corrections_lr_search"
        plan = [(c, s, x) for x in search for s in seeds for c in configs]
    else:
        name = name or ("corrections" if full else "corrections-subset")
        plan = [(c, s, lr) for c in configs for s in seeds]
    rows = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tandem-corrections-") as tmp:
        for config, seed, rate in plan:
            rows.append(run_one(config, seed, Path(tmp) / f"{config}-{seed}-{rate:g}", lr=rate, steps=steps))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "error"}), flush=True)
            if not rows[-1]["ok"]:
                print(rows[-1]["error"], file=sys.stderr, flush=True)
    result: dict[str, Any] = {
        "command": command or f".venv/bin/python -m bench corrections{'' if full else ' (subset)'}",
        "setup": {"max_staleness": MAX_STALENESS, "lr": lr if not search else None, "search_lrs": list(search),
                  "steps": steps, "seeds": list(seeds), "target": TARGET, "common_trainer_args": COMMON_TRAINER_ARGS},
        "configs": {c: CONFIGS[c] for c in configs}, "rows": rows,
        "by_config": {c: aggregate([r for r in rows if r["config"] == c]) for c in configs} if not search else None,
        "bench_seconds": round(time.monotonic() - started, 1), "host": host(), "code": _code_state(),
    }
    if search:
        previous = results_dir / f"{name}.json"
        if previous.exists():  # what was written by hand survives a rerun
            old = json.loads(previous.read_text())
            result.update({k: old[k] for k in ("notes", "band_pilot") if k in old})
        md = search_markdown(result)
    else:
        lr_search = results_dir / "corrections_lr_search.json"
        md = markdown(result, json.loads(lr_search.read_text()) if lr_search.exists() else None)
    write_results(results_dir, name, result, md)
    return result


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def parse_args(argv: list[str]) -> dict[str, Any]:
    """The options of `python -m bench corrections [OPTIONS]`, as keyword arguments of `run`."""
    parser = argparse.ArgumentParser(prog="python -m bench corrections", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds (default 0-4)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--lr", type=float, default=LEARNING_RATE)
    parser.add_argument("--search", default="", help="comma-separated learning rates: run configs none and "
                        "truncate at each instead (writes corrections_lr_search.*)")
    parser.add_argument("--render", action="store_true", help="only rewrite the markdown from the JSON results")
    parser.add_argument("--name", default=None, help="results file stem (default: corrections, "
                        "corrections-subset for a subset, corrections_lr_search for --search)")
    ns = parser.parse_args(argv)
    if ns.render:
        return {"render_only": True}
    return {"seeds": tuple(int(x) for x in ns.seeds.split(",") if x.strip()),
            "configs": tuple(c.strip() for c in ns.configs.split(",") if c.strip()),
            "steps": ns.steps, "lr": ns.lr, "search": _floats(ns.search), "name": ns.name,
            "command": " ".join([".venv/bin/python -m bench corrections", *argv])}


if __name__ == "__main__":
    print(json.dumps(run(REPO / "bench" / "results", **parse_args(sys.argv[1:])), indent=2))
