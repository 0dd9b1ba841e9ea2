"""`make stress`: the restart drills, many times in a row, outside `make test`.

    make stress                                   # Redis kill -9 drill, 30 runs
    make stress ARGS="--drill embedded --runs 50"
    .venv/bin/python -m tests.reliability.stress --drill external --runs 100

Each run is the whole drill of tests/reliability/test_redis_crash.py: a trainer on
`SamplerClient`, Redis killed -9 after its third step, restarted after an outage that cycles
through 0.05-6 s (external; the embedded Redis is restarted by the sampler's watchdog), and
every batch and version checked afterwards. A run that stalls fails
with the sampler's steps and versions. The report (runs, failures, seconds from Redis's
restart to the trainer's last step) is printed and written to bench/results/stress-<drill>.md;
a failed run's files are kept and named.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from tests.reliability.support import Cleanup

OUTAGES = (0.05, 0.3, 1.0, 1.5, 3.0, 6.0)
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def _run_one(drill: str, tmp: Path, outage: float) -> float:
    from tests.reliability import test_redis_crash as drills

    cleanup = Cleanup()
    try:
        if drill == "external":
            return drills.external_redis_drill(tmp, cleanup, outage)
        if drill == "embedded":
            return drills.embedded_redis_drill(tmp, cleanup)
        raise ValueError(f"unknown drill {drill!r}")
    finally:
        cleanup.run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make stress", description=__doc__.splitlines()[0])
    parser.add_argument("--drill", choices=["external", "embedded"], default="external",
                        help="external: a Redis the drill restarts; embedded: the sampler's watchdog restarts it")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--keep-going", action="store_true", help="do not stop at the first failure")
    args = parser.parse_args(argv)

    recoveries: list[float] = []
    failures: list[str] = []
    started = time.time()
    for i in range(args.runs):
        outage = OUTAGES[i % len(OUTAGES)]
        tmp = Path(tempfile.mkdtemp(prefix=f"tandem-stress-{args.drill}-{i}-"))
        t0 = time.monotonic()
        try:
            recovered = _run_one(args.drill, tmp, outage)
        except Exception:  # noqa: BLE001 - a failed run is reported, with its files kept
            failures.append(f"run {i} (outage {outage}s): files in {tmp}\n{traceback.format_exc()}")
            print(f"run {i + 1}/{args.runs}: outage {outage:.2f}s FAILED after {time.monotonic() - t0:.0f}s "
                  f"(files kept in {tmp})", flush=True)
            if not args.keep_going:
                break
            continue
        recoveries.append(recovered)
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"run {i + 1}/{args.runs}: outage {outage:.2f}s ok; trainer done {recovered:.1f}s after the restart "
              f"({time.monotonic() - t0:.0f}s in all)", flush=True)

    report = _report(args.drill, args.runs, recoveries, failures, time.time() - started)
    print(report)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"stress-{args.drill}.md").write_text(report)
    (RESULTS / f"stress-{args.drill}.json").write_text(json.dumps(
        {"drill": args.drill, "runs_asked": args.runs, "passed": len(recoveries), "failed": len(failures),
         "recovery_seconds": recoveries, "failures": failures}, indent=1) + "\n")
    return 1 if failures or len(recoveries) < args.runs else 0


def _report(drill: str, runs: int, recoveries: list[float], failures: list[str], seconds: float) -> str:
    lines = [f"# Stress: Redis kill -9 drill ({drill})", "",
             f"Command: `make stress ARGS=\"--drill {drill} --runs {runs}\"`", "",
             f"- runs passed in a row: **{len(recoveries)}** of {runs} asked; failed: {len(failures)}",
             f"- wall time: {seconds:.0f} s"]
    if recoveries:
        lines.append(f"- trainer's last step after Redis's restart: median {statistics.median(recoveries):.1f} s, "
                     f"max {max(recoveries):.1f} s (the drill has 10 steps of 0.4 s training each; "
                     f"outages cycle through {', '.join(str(o) for o in OUTAGES)} s)")
    for failure in failures:
        lines += ["", "```", failure.strip(), "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
