"""Does `make demo ARGS="--env parity_dialogue"` solve the multi-turn task on every seed, and
stay solved? The same runs and table as `bench convergence` (issue 16), for the 3-turn
conversation environment (issue 26: greedy eval from <= 0.2 to >= 0.9 within 5 minutes).

    .venv/bin/python -m bench convergence_dialogue
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import bench_convergence


def run(results_dir: Path) -> dict[str, Any]:
    return bench_convergence.run(results_dir, name="convergence_dialogue", env="parity_dialogue")
