"""`bench verifiers` against the results it replaces: each config's sampler CPU per turn
before (the bench/results/verifiers.json in place when the run started) and now, and whether
a verifiers config meets issue 43's target of at most 5 ms of sampler CPU per turn.

The native configs' code did not change between two runs unless their own did; their ratio
says how much the machine (its load, other work on its 2 CPUs) moved the numbers between the
runs, the noise the verifiers ratios are to be read against.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TARGET_US_PER_TURN = 5000.0  # issue 43, point 5


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


def markdown(r: dict[str, Any]) -> list[str]:
    before = r.get("previous")
    if not before:
        return []
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
        met = ("native" if label.startswith("native")
               else "**yes**" if x["sampler_cpu_us_per_turn"]["median"] <= TARGET_US_PER_TURN else "**no**")
        busy = f"{before['machine_busy'].get(label, 0):.0%} -> {x['machine_busy']['median']:.0%}"
        lines.append(f"| {label} | {_range(old)} | {_range(x['sampler_cpu_us_per_turn'])} | {ratio:.2f} | {busy} "
                     f"| {met} |")
    return lines
