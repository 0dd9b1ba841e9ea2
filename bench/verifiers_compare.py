"""`bench verifiers` against the results it replaces: each config's sampler CPU per turn
before (the bench/results/verifiers.json in place when the run started) and now, and whether
a verifiers config meets issue 43's target of at most 5 ms of sampler CPU per turn; and the
verifiers configs against fixed milestones of that work (MILESTONES), which stay in the
report when later runs replace the previous results.

The native configs' code did not change between two runs unless their own did; their ratio
says how much the machine (its load, other work on its 2 CPUs) moved the numbers between the
runs, the noise the verifiers ratios are to be read against.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TARGET_US_PER_TURN = 5000.0  # issue 43, point 5
# Fixed points of issue 43 point 5's work, shown with every run (the previous results move
# with each run): sampler CPU us per turn, the medians bench/results/verifiers.md reported.
MILESTONES: tuple[tuple[str, str, dict[str, float]], ...] = (
    ("9c4ea61", "before issue 43 point 5's work (1-minute load 0.79 before the run, 1.1 after)",
     {"vf_parity": 17046.0, "vf_dialogue1": 13838.2, "vf_dialogue3": 15630.9}),
    ("41393ad", "with the in-process TrainClient, before the harness's in-process calls to the interception server "
                "and the episodes' collector settings (load 1.76 before, 1.6 after)",
     {"vf_parity": 5602.8, "vf_dialogue1": 4727.9, "vf_dialogue3": 3046.9}),
)


def previous(results_dir: Path) -> dict[str, Any] | None:
    """What the results file in `results_dir` says, reduced to what a comparison needs."""
    path = Path(results_dir) / "verifiers.json"
    if not path.exists():
        return None
    old = json.loads(path.read_text())
    return {
        "commit": old["code"]["head"][:12],
        "uncommitted_files": old["code"].get("uncommitted_files") or [],
        "loadavg_1m": [old["host"].get("loadavg_1m_at_start"), old["host"].get("loadavg_1m_at_end")],
        "bench_seconds": old.get("bench_seconds"),
        "sampler_cpu_us_per_turn": {label: s["sampler_cpu_us_per_turn"] for label, s in old["summary"].items()},
        "machine_busy": {label: s["machine_busy"]["median"] for label, s in old["summary"].items()},
    }


def _range(x: dict[str, float]) -> str:
    return f"{x['median']:g} ({x['min']:g}-{x['max']:g})"


def _met(label: str, us: float) -> str:
    return "native" if label.startswith("native") else "**yes**" if us <= TARGET_US_PER_TURN else "**no**"


def milestones(r: dict[str, Any]) -> list[str]:
    """This run's verifiers configs against MILESTONES."""
    now = r["summary"]
    labels = [label for label in now if any(label in m[2] for m in MILESTONES)]
    if not labels:
        return []
    lines = ["", "## Against issue 43 point 5's milestones", "",
             "Sampler CPU us per turn, median of the windows: "
             + "; ".join(f"{commit}: {what}" for commit, what, _ in MILESTONES)
             + f"; now: this run (above). Target: at most {TARGET_US_PER_TURN / 1e3:g} ms per turn.", "",
             "| config | " + " | ".join(commit for commit, _, _ in MILESTONES) + " | now | now / "
             + MILESTONES[-1][0] + " | <= 5 ms per turn |",
             "|---|" + "---|" * (len(MILESTONES) + 3)]
    for label in labels:
        us = now[label]["sampler_cpu_us_per_turn"]["median"]
        old = [m[2].get(label) for m in MILESTONES]
        cells = [f"{x:g}" if x is not None else "-" for x in old]
        ratio = f"{us / old[-1]:.2f}" if old[-1] else "-"
        lines.append(f"| {label} | {' | '.join(cells)} | {us:g} | {ratio} | {_met(label, us)} |")
    return lines


def markdown(r: dict[str, Any]) -> list[str]:
    before = r.get("previous")
    if not before:
        return milestones(r)
    now = r["summary"]
    lines = [
        "",
        f"## Against the previous results (commit {before['commit']})",
        "",
        f"Sampler CPU us per turn, median (min-max) over the windows, from the results this run replaced (commit "
        f"{before['commit']}"
        + (f" with uncommitted changes to {', '.join(before['uncommitted_files'])}" if before["uncommitted_files"]
           else "")
        + f"; 1-minute load average {before['loadavg_1m'][0]} before, {before['loadavg_1m'][1]} after) and from this "
        f"one (above). Target: a verifiers config at most {TARGET_US_PER_TURN / 1e3:g} ms per turn.",
        "",
        "| config | before us/turn | now us/turn | now / before | machine busy before -> now | <= 5 ms per turn |",
        "|---|---|---|---|---|---|",
    ]
    for label, x in now.items():
        old = before["sampler_cpu_us_per_turn"].get(label)
        if old is None:
            continue
        ratio = x["sampler_cpu_us_per_turn"]["median"] / old["median"]
        met = _met(label, x["sampler_cpu_us_per_turn"]["median"])
        busy = f"{before['machine_busy'].get(label, 0):.0%} -> {x['machine_busy']['median']:.0%}"
        lines.append(f"| {label} | {_range(old)} | {_range(x['sampler_cpu_us_per_turn'])} | {ratio:.2f} | {busy} "
                     f"| {met} |")
    return lines + milestones(r)
