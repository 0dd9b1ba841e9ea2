"""Run every benchmark, or the ones named: `python -m bench [NAME ...]`; or one with options:
`python -m bench NAME --option ...`, for a bench that has `parse_args` (e.g. corrections, overlap:
`python -m bench overlap --servers cpu --steps 20`).

Each `bench/bench_<name>.py` exposes `run(results_dir: Path) -> dict` and writes its own
JSON and markdown into `bench/results/`; one with options also `parse_args(argv) -> dict`,
the keyword arguments for its `run`.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main(argv: list[str]) -> int:
    available = sorted(p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py"))
    first_option = next((i for i, a in enumerate(argv) if a.startswith("-")), len(argv))
    names, options = argv[:first_option] or available, argv[first_option:]
    unknown = [n for n in names if n not in available]
    if unknown:
        print(f"unknown benchmarks {unknown}; available: {available}", file=sys.stderr)
        return 2
    if options and len(names) != 1:
        print(f"options {options} need exactly one benchmark named before them", file=sys.stderr)
        return 2
    results_dir = HERE / "results"
    results_dir.mkdir(exist_ok=True)
    for name in names:
        print(f"== bench {name}", flush=True)
        module = importlib.import_module(f"bench.bench_{name}")
        if options and not hasattr(module, "parse_args"):
            print(f"bench {name} takes no options (got {options})", file=sys.stderr)
            return 2
        result = module.run(results_dir, **(module.parse_args(options) if options else {}))
        print(json.dumps(result, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
