"""`make stress`: the restart drills, many times in a row, outside `make test`.

    make stress                                   # both default drills, 30 runs each, 2 CPU hogs
    make stress ARGS="--drill trainer"            # the trainer killed at varied moments only
    make stress ARGS="--drill external --runs 50"
    .venv/bin/python -m tests.reliability.stress --drill moments --runs 100 --load 0

Drills:
* `moments` (tests/reliability/test_redis_moments.py): Redis killed -9 at a chosen moment of
  step 3 (claim taken, batch built, seal acknowledged, version being written, version written),
  durable (`appendfsync always`) or lossy (AOF cut back, as an `everysec` Redis loses its last
  writes), the sampler let on into the outage or held until Redis is back; the run number picks
  the moment, the variant and an outage of 0.05-6 s. Each run checks no skipped step, no changed
  batch, no step waiting over 60 s on the sampler, the expected heals and no traceback.
* `trainer` (tests/reliability/test_trainer_kills.py): the trainer killed -9 at one of its pause
  points (fetched, trained, written, checkpoint, checkpointed, published) in steps 2-6, or
  after a random delay, and the same command run again. Each run checks the rerun finishes,
  every step has one metrics record (retrained ones marked), the same batches, the final
  version served, no staging directory left.
* `external` / `embedded` (tests/reliability/test_redis_crash.py): Redis killed -9 after the
  trainer's third step, restarted by the drill (external) or the sampler's watchdog (embedded).
* `hang` (tests/reliability/hang_drill.py): an inference server, Redis or the sampler frozen
  with SIGSTOP mid-batch, mid-sync (a server paused) or mid-swap (a one-request sync loading)
  for 2-7 s, then thawed; the run number picks which, when
  and how long. Each run checks long polls stay bounded, every step arrives once, every version
  is published once, and no server is left paused or out of rotation.

Every run's stack is closed, as every run is (issue 41), with a token of its own: the inference
server or stand-in, the sampler (in its environment) and the trainer get it, every read the
drill makes sends it, and each run checks the sampler and the inference server answer 401
without it.

`--load N` runs N busy processes (one core each) for the whole stress run. The report (runs,
failures, seconds from Redis's restart to the trainer's last step, the longest a step waited
on the sampler) is printed and written to bench/results/stress-<drill>.md; a failed run's files are kept
and named.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from tests.reliability.support import Cleanup

OUTAGES = (0.05, 0.3, 1.0, 1.5, 3.0, 6.0)
DRILLS = ("moments", "trainer", "external", "embedded", "hang")
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def moment_variants() -> list[tuple[str, bool, bool | None]]:
    """(moment, lossy, release_during_outage) in the order runs take them."""
    from tests.reliability.test_redis_moments import LOSSY, MOMENTS

    return ([(m, False, True) for m in MOMENTS] + [(m, True, False) for m in LOSSY]
            + [(m, False, False) for m in MOMENTS])


def describe(drill: str, i: int) -> str:
    if drill == "trainer":
        from tests.reliability.test_trainer_kills import random_moment

        moment = random_moment(i)
        return (f"killed at {moment['point']} {moment['step']}" if "point" in moment
                else f"killed {moment['delay']:.2f}s after step {moment['step'] - 1}")
    if drill == "hang":
        from tests.reliability.hang_drill import variant

        target, moment, freeze = variant(i)
        return f"{target} frozen {moment} for {freeze:g}s"
    outage = OUTAGES[i % len(OUTAGES)]
    if drill != "moments":
        return f"outage {outage:.2f}s"
    moment, lossy, during = moment_variants()[i % len(moment_variants())]
    return (f"{moment}, {'lossy' if lossy else 'durable'}, released {'during' if during else 'after'} the outage, "
            f"outage {outage:.2f}s")


def _run_one(drill: str, tmp: Path, i: int, model: Path | None) -> dict[str, Any]:
    from tests.reliability import hang_drill as hang
    from tests.reliability import test_redis_crash as crash
    from tests.reliability import test_redis_moments as moments
    from tests.reliability import test_trainer_kills as kills

    outage = OUTAGES[i % len(OUTAGES)]
    cleanup = Cleanup()
    try:
        if drill == "trainer":
            return kills.kill_and_resume(tmp, cleanup, model, **kills.random_moment(i))
        if drill == "moments":
            moment, lossy, during = moment_variants()[i % len(moment_variants())]
            return moments.moment_drill(tmp, cleanup, moment, lossy=lossy, outage=outage,
                                        release_during_outage=during)
        if drill == "external":
            return {"recovered": crash.external_redis_drill(tmp, cleanup, outage)}
        if drill == "embedded":
            return {"recovered": crash.embedded_redis_drill(tmp, cleanup)}
        if drill == "hang":
            return hang.hang_drill(tmp, cleanup, *hang.variant(i))
        raise ValueError(f"unknown drill {drill!r}")
    finally:
        cleanup.run()


class Load:
    """`count` processes spinning on a core each, for the stress run's duration."""

    def __init__(self, count: int):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make stress", description=__doc__.splitlines()[0])
    parser.add_argument("--drill", default="moments,trainer",
                        help="comma-separated, run one after the other (default moments,trainer). moments: Redis "
                             "killed at chosen moments; trainer: the trainer killed at chosen moments and rerun; "
                             "external: a Redis the drill restarts; embedded: the sampler's watchdog restarts it; "
                             "hang: an inference server, Redis or the sampler frozen (SIGSTOP) and thawed")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--load", type=int, default=2, help="busy processes running meanwhile (default 2)")
    parser.add_argument("--keep-going", action="store_true", help="do not stop at the first failure")
    args = parser.parse_args(argv)
    drills = [d.strip() for d in args.drill.split(",") if d.strip()]
    unknown = [d for d in drills if d not in DRILLS]
    if unknown or not drills:
        parser.error(f"--drill {args.drill!r}: each must be one of {', '.join(DRILLS)}")
    code = 0
    for drill in drills:
        code |= _stress(argparse.Namespace(**{**vars(args), "drill": drill}))
    return code


def _stress(args: argparse.Namespace) -> int:
    model = None
    if args.drill == "trainer":
        from services.inference.init_model import init_model

        model = init_model(Path(tempfile.mkdtemp(prefix="tandem-stress-model-")) / "tiny", preset="tiny", seed=0)
    results: list[dict[str, Any]] = []
    failures: list[str] = []
    started = time.time()
    load = Load(args.load)
    try:
        for i in range(args.runs):
            what = describe(args.drill, i)
            tmp = Path(tempfile.mkdtemp(prefix=f"tandem-stress-{args.drill}-{i}-"))
            t0 = time.monotonic()
            try:
                result = _run_one(args.drill, tmp, i, model)
            except Exception:  # noqa: BLE001 - a failed run is reported, with its files kept
                failures.append(f"run {i} ({what}): files in {tmp}\n{traceback.format_exc()}")
                print(f"run {i + 1}/{args.runs}: {what} FAILED after {time.monotonic() - t0:.0f}s "
                      f"(files kept in {tmp})", flush=True)
                if not args.keep_going:
                    break
                continue
            results.append(result)
            shutil.rmtree(tmp, ignore_errors=True)
            waited = f", longest wait {result['max_wait']:.1f}s" if "max_wait" in result else ""
            done = "the rerun done in" if args.drill == "trainer" else "trainer done"
            after = "the thaw" if args.drill == "hang" else "the restart"
            print(f"run {i + 1}/{args.runs}: {what} ok; {done} {result['recovered']:.1f}s after {after}"
                  f"{waited} ({time.monotonic() - t0:.0f}s in all)", flush=True)
    finally:
        load.stop()

    report = _report(args, results, failures, time.time() - started)
    print(report)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"stress-{args.drill}.md").write_text(report)
    (RESULTS / f"stress-{args.drill}.json").write_text(json.dumps(
        {"drill": args.drill, "runs_asked": args.runs, "load": args.load, "passed": len(results),
         "failed": len(failures), "results": results, "failures": failures}, indent=1) + "\n")
    return 1 if failures or len(results) < args.runs else 0


def _report(args: argparse.Namespace, results: list[dict[str, Any]], failures: list[str], seconds: float) -> str:
    title = {"moments": "Redis killed -9 at chosen moments", "external": "Redis kill -9 drill (external)",
             "embedded": "Redis kill -9 drill (embedded)",
             "trainer": "the trainer killed -9 at chosen moments, the same command rerun",
             "hang": "an inference server, Redis or the sampler frozen (SIGSTOP) at chosen moments, then thawed"}[args.drill]
    lines = [f"# Stress: {title}", "",
             f"Command: `make stress ARGS=\"--drill {args.drill} --runs {args.runs} --load {args.load}\"`", "",
             f"- runs passed in a row: **{len(results)}** of {args.runs} asked; failed: {len(failures)}",
             f"- load: {args.load} busy process(es) beside the drill; wall time: {seconds:.0f} s"]
    recoveries = [r["recovered"] for r in results]
    if recoveries and args.drill == "trainer":
        lines.append(f"- the rerun, start to last step: median {statistics.median(recoveries):.1f} s, "
                     f"max {max(recoveries):.1f} s; steps retrained after a kill: "
                     f"{sum(r['retrained'] for r in results)} over all runs; runs that resumed behind the "
                     f"sampler's version (needing batches keep_batches alone would have trimmed): "
                     f"{sum(r['resumed_at'] < r['published_at_kill'] - 1 for r in results)}")
        lines.append("- moments: " + "; ".join(r["moment"] for r in results))
    elif recoveries and args.drill == "hang":
        from tests.reliability.hang_drill import FREEZES, MOMENTS, TARGETS

        lines.append(f"- trainer's last step after the thaw: median {statistics.median(recoveries):.1f} s, "
                     f"max {max(recoveries):.1f} s; longest a step waited on the sampler (fetch + publish): "
                     f"{max(r['max_wait'] for r in results):.1f} s")
        lines.append(f"- variants cycle through targets {', '.join(TARGETS)} x moments {', '.join(MOMENTS)}, "
                     f"frozen for {', '.join(f'{f:g}' for f in FREEZES)} s; every run checks every step once, "
                     "every version once, no server left paused or out of rotation")
    elif recoveries:
        lines.append(f"- trainer's last step after Redis's restart: median {statistics.median(recoveries):.1f} s, "
                     f"max {max(recoveries):.1f} s (outages cycle through {', '.join(str(o) for o in OUTAGES)} s)")
    waits = [r["max_wait"] for r in results if "max_wait" in r]
    if waits and args.drill == "moments":
        heals: dict[str, int] = {}
        for r in results:
            for how, n in r.get("heals", {}).items():
                heals[how] = heals.get(how, 0) + n
        lines.append(f"- longest a step waited on the sampler (fetch + publish) in any run: {max(waits):.1f} s "
                     f"(limit 60 s); skipped steps: 0, "
                     f"changed batches: 0 (each run fails otherwise)")
        lines.append("- heals over all runs: " + ", ".join(f"{how} {n}" for how, n in sorted(heals.items())))
        variants = [f"{m} ({'lossy' if lossy else 'durable'}, released {'during' if during else 'after'} the outage)"
                    for m, lossy, during in moment_variants()]
        lines.append(f"- variants, cycled in this order: {'; '.join(variants)}")
    for failure in failures:
        lines += ["", "```", failure.strip(), "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
