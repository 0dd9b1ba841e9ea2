"""Run every benchmark, or the ones named: `python -m bench [NAME ...]`.

Each `bench/bench_<name>.py` exposes `run(results_dir: Path) -> dict` and writes its own
JSON and markdown into `bench/results/`.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main(argv: list[str]) -> int:
    available = sorted(p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py"))
    names = argv or available
    unknown = [n for n in names if n not in available]
    if unknown:
        print(f"unknown benchmarks {unknown}; available: {available}", file=sys.stderr)
        return 2
    results_dir = HERE / "results"
    results_dir.mkdir(exist_ok=True)
    for name in names:
        print(f"== bench {name}", flush=True)
        result = importlib.import_module(f"bench.bench_{name}").run(results_dir)
        print(json.dumps(result, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
