"""Multi-turn rollouts: what a model turn costs the sampler, and how long a multi-turn batch takes.

Part 1, sampler CPU per turn (instantaneous inference). Real processes on loopback, as in
bench_throughput: a private redis-server, the vLLM-protocol stand-in (token_latency 0, serves
/tokenize with the tiny model's chat template), `tandem sampler --env parity_dialogue` and a
trainer stand-in that takes each batch and publishes the next version at once (T = 0),
max_staleness 2. Every trajectory is one conversation; each model turn is one
POST /v1/completions (n = 1, token-id prompt); an environment turn costs one POST /tokenize
unless render.py has rendered the same messages before (it caches renders by message, and
the trajectories of a group asking at once share one request). parity_dialogue's messages
are the group's numbers, so most of its renders are shared; `UniqueParityDialogue` below
appends a counter to every message, so each of its environment turns needs a /tokenize.

The window runs from the trainer's receipt of batch `warmup` to the end. The sampler's CPU
seconds (utime + stime from /proc, all threads; the main thread's alone too) are set against
what was counted in the same window: model turns = completion requests and sampled tokens
(the sampler's GET /status `throughput`), /tokenize requests (the stand-in's own count).
Those include the batches the producer works on ahead of the trainer, which the CPU figure
also includes; counting delivered batches instead would miscount by up to max_staleness
batches. Every config's window holds about the same number of model turns (turns=1 runs 3x
the batches), about 4 s of sampler CPU here: 1 s windows varied by +-15%.

Derived, per trajectory: CPU(turns) = a + b * turns, from turns=1 and turns=3 at the same
shape (same trajectories per batch, so the per-batch and per-trajectory costs -- sealing,
hand-off, scoring, rollout log, the opening prompt's /tokenize -- are in `a`). `b` is the
cost of one more model turn: with parity_dialogue (renders shared) and with unique messages
(a /tokenize each); their difference per /tokenize added is the cost of one /tokenize
request. The per-token part comes from a pair at temperature 0, where the stand-in answers
exactly max_tokens tokens: turns=3 at max_tokens 8 and at 256. Goal (the issue): a turn
costs the sampler <= 100 us + 1 us per token.

A separate run (not timed: py-spy slows what it samples) profiles the sampler at turns=3
with py-spy when it is installed, and attributes its samples to the completion request,
the /tokenize request, aiohttp, the event loop, the env turn, scoring and the rest.

Part 2, time to a sealed batch on Tandem's CPU inference server (fresh tiny model from
`init_model`): `generation_seconds` of each batch (start of generation to sealed) at
turns=3 vs turns=1. max_staleness 0 there, so one batch is generated at a time and each
batch's time is its own (with overlap, concurrent batches would share the server).

The code measured (commit, trees of services/ and shared/, uncommitted changes) is recorded,
and flagged when it changed during the run: services/ is edited concurrently.

Writes bench/results/multiturn.json and multiturn.md; `python -m bench multiturn`.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from services.sampler.rollouts.envs.multiturn import Conversation, Message
from services.sampler.rollouts.envs.parity_dialogue import ParityDialogueEnv
from bench._common import (
    AUTH, CLK_TCK, REPO, cpu_seconds, host, median, redis_server, sampler_process, standin_process, token_env,
    trainer_loop, write_results,
)

class UniqueParityDialogue(ParityDialogueEnv):
    """parity_dialogue whose every environment message is new (the number, then a counter):
    render.py can take no environment turn from its cache, so each costs a /tokenize, as it
    does for environments whose answers depend on what the model said (tool output, code
    results). parity_dialogue's own messages repeat (the same numbers in every trajectory of
    a group), so most of its renders are cache hits. Loaded by the sampler as
    `bench.bench_multiturn:UniqueParityDialogue`."""

    name = "parity_dialogue_unique"

    async def env_response(self, convo: Conversation) -> list[Message] | None:
        new = await super().env_response(convo)
        if new:
            new = [{**new[0], "content": f"{new[0]['content']} ({next(_UNIQUE)})"}]
        return new


_UNIQUE = itertools.count()
ENVS = {"parity_dialogue": "parity_dialogue", "unique": "bench.bench_multiturn:UniqueParityDialogue"}

COMMAND = "make bench ARGS=multiturn  (or .venv/bin/python -m bench multiturn)"
GOAL_FIXED_US, GOAL_PER_TOKEN_US = 100.0, 1.0
PYSPY_RATE = 200  # samples per second of each busy thread


def _main_thread_cpu(pid: int) -> float:
    """CPU seconds of the process's main thread alone: the sampler's event loop, where every
    request, conversation and batch is handled (the other threads: rollout-log writes, env
    workers, Redis/HTTP helpers)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _code_state() -> dict[str, Any]:
    """The commit, and what the working tree changes in the code the bench runs: services/ and
    shared/ are edited concurrently, and numbers belong to the code that produced them."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False).stdout

    diff = git("diff", "HEAD", "--", "services", "shared")
    return {"head": git("rev-parse", "HEAD").strip(),
            # Trees, not the commit: commits that touch only tests or docs change nothing measured.
            "services_tree": git("rev-parse", "HEAD:services").strip(), "shared_tree": git("rev-parse", "HEAD:shared").strip(),
            "uncommitted_files": sorted(line[3:] for line in git("status", "--porcelain", "--", "services", "shared")
                                        .splitlines()),
            "uncommitted_diff_sha1": hashlib.sha1(diff.encode()).hexdigest() if diff else None}


def _median_range(x: dict[str, float], fmt: str = "{:g}") -> str:
    """A {median, min, max} summary as "median (min-max)"."""
    return f"{fmt.format(x['median'])} ({fmt.format(x['min'])}-{fmt.format(x['max'])})"


def _run_header(r: dict[str, Any], bench_seconds: float) -> list[str]:
    """The markdown lines saying how a run was made: the command, the machine and its load,
    and the code measured (`_code_state`), flagged when it changed during the run."""
    code = r["code"]
    return [
        f"`{r['command']}`. Machine: {r['host']['cpus']} CPUs shared by every process of the bench (and other "
        f"work: 1-minute load average {r['host']['loadavg_1m_at_start']} before, {r['host']['loadavg_1m_at_end']} "
        f"after). Python {r['host']['python']}. Whole bench {bench_seconds} s.",
        "",
        f"Code: commit {code['head'][:12]}"
        + (f" with uncommitted changes to {', '.join(code['uncommitted_files'])} (diff sha1 "
           f"{code['uncommitted_diff_sha1'][:12]})" if code["uncommitted_files"] else ", services/ and shared/ clean")
        + (". **The code changed during the run: these numbers mix two versions.**" if code["changed_during_run"]
           else "."),
    ]


def _env_args(turns: int) -> dict[str, int]:
    # Four-digit numbers and 2048 training conversations at every turn count: parity_dialogue's
    # defaults (one-digit numbers, 512) give only 10 distinct one-turn conversations, and a
    # turns=1 window (3x the batches of a turns=3 one) would pass the end of the first epoch,
    # after which its opening prompts come from render.py's cache and turns=3's do not. The
    # same numbers at turns=1 and 3 keep the opening prompts alike (same length, all new).
    return {"turns": turns, "max_digits": 4, "num_train": 2048}


def _counts(sampler_url: str, standin_url: str | None) -> dict[str, float]:
    """The sampler's own counters (GET /status) and, with the stand-in, its completion-request count."""
    status = httpx.get(sampler_url + "/status", headers=AUTH, timeout=30).json()
    envs = status["environments"].values()
    out = {
        "turns": status["throughput"]["completions"],  # one completion per request (n = 1)
        "tokens": status["throughput"]["completion_tokens"],
        "env_turns_counter": sum(e.get("turns", 0) for e in envs),
        "trajectories": sum(e.get("trajectories", 0) for e in envs),
        "pool_requests": sum(s["requests"] for s in status["inference_servers"]),
    }
    if standin_url:
        stats = httpx.get(standin_url + "/_standin/stats", headers=AUTH, timeout=30).json()
        out["standin_completion_requests"] = stats["requests"]
        # Counted by the stand-in on arrival, as its completion requests are (the sampler's pool
        # counts differently at the window's ends, which matters once /tokenize is rare).
        if "tokenize_requests" in stats:
            out["standin_tokenize_requests"] = stats["tokenize_requests"]
    return out


def _start_pyspy(pid: int, out: Path) -> subprocess.Popen:
    # Attached at the start of the window, not for the sampler's whole life (what
    # BENCH_PYSPY does): startup is mostly imports (pyarrow's on the first rollout-log write),
    # which would otherwise be a large share of a short profile. --nonblocking: stopping the
    # process for each sample (the default) made py-spy count every waiting thread as busy
    # (here 9.9 s of samples for 2.0 s of CPU).
    exe = Path(sys.executable).with_name("py-spy")
    return subprocess.Popen([str(exe), "record", "--pid", str(pid), "--rate", str(PYSPY_RATE), "--format", "raw",
                             "--output", str(out), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop_pyspy(spy: subprocess.Popen) -> None:
    spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
    try:
        spy.wait(60)
    except subprocess.TimeoutExpired:
        spy.kill()


def _standin_run(tmp: Path, redis_url: str, *, env: str, turns: int, max_tokens: int, temperature: float, steps: int,
                 warmup: int, shape: dict[str, int], max_concurrency: int, profile: Path | None = None) -> dict[str, Any]:
    spy: subprocess.Popen | None = None
    with standin_process(tmp, 0.0) as standin:
        with sampler_process(tmp / f"run-{uuid.uuid4().hex[:8]}", redis_url=redis_url,
                             namespace="m" + uuid.uuid4().hex[:10], inference_urls=[standin.url],
                             max_staleness=2, max_concurrency=max_concurrency, keep_batches=4,
                             env=ENVS[env], env_args=json.dumps(_env_args(turns)),
                             max_tokens=max_tokens, temperature=temperature, seed=0, **shape) as sampler:
            marks: dict[str, Any] = {}

            async def on_step(step: int) -> None:
                nonlocal spy
                if step == warmup:
                    # /status first: its own CPU then falls outside the window at both ends alike.
                    marks["counts"] = await asyncio.to_thread(_counts, sampler.url, standin.url)
                    if profile is not None:
                        spy = _start_pyspy(sampler.pid, profile)
                    marks.update(t=time.perf_counter(), sampler=cpu_seconds(sampler.pid),
                                 main=_main_thread_cpu(sampler.pid),
                                 standin=cpu_seconds(standin.pid))

            try:
                records = asyncio.run(trainer_loop(sampler.url, steps, 0.0, on_step=on_step, deadline_s=300))
            finally:
                end = {"t": time.perf_counter(), "sampler": cpu_seconds(sampler.pid),
                       "main": _main_thread_cpu(sampler.pid),
                       "standin": cpu_seconds(standin.pid)}
                if spy is not None:
                    _stop_pyspy(spy)
            end_counts = _counts(sampler.url, standin.url)
    d = {k: end_counts[k] - marks["counts"][k] for k in end_counts}
    wall = end["t"] - marks["t"]
    cpu = end["sampler"] - marks["sampler"]
    turns_done, tokens = d["turns"], d["tokens"]
    tokenize = d.get("standin_tokenize_requests", d["pool_requests"] - d["standin_completion_requests"])
    # Every parity_dialogue conversation runs all its turns (the stand-in's context is never
    # reached), so trajectories = model turns / turns. The sampler's `trajectories` counter
    # moves only when a whole conversation ends, so over a window it lags or leads by the
    # conversations in flight at either end; it is reported as a check (turns_per_trajectory).
    per_trajectory = turns_done / turns
    measured = records[warmup + 1:]
    return {
        "env": env, "turns": turns, "max_tokens": max_tokens, "temperature": temperature,
        "measured_batches_delivered": len(measured),
        "wall_s": round(wall, 3),
        "sampler_cpu_s": round(cpu, 3),
        "model_turns": turns_done,
        "completion_tokens": tokens,
        "tokens_per_turn": round(tokens / turns_done, 2),
        "turns_per_trajectory_counted": round(turns_done / d["trajectories"], 3) if d["trajectories"] else None,
        "completion_requests": d["standin_completion_requests"],
        "tokenize_requests": tokenize,
        "tokenize_per_trajectory": round(tokenize / per_trajectory, 3),
        "sampler_cpu_us_per_turn": round(cpu / turns_done * 1e6, 1),
        "sampler_cpu_us_per_token": round(cpu / tokens * 1e6, 2),
        "sampler_cpu_us_per_trajectory": round(cpu / per_trajectory * 1e6, 1),
        "sampler_core_utilisation": round(cpu / wall, 3),
        "main_thread_share_of_sampler_cpu": round((end["main"] - marks["main"]) / cpu, 3),
        "standin_cpu_us_per_turn": round((end["standin"] - marks["standin"]) / turns_done * 1e6, 1),
        "turns_per_s": round(turns_done / wall, 1),
        "finish_reasons_last_batch": measured[-1]["stats"]["finish_reasons"] if measured else None,
    }


def _summary(runs: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, dict[str, float]]:
    return {k: {"median": median([r[k] for r in runs]), "min": min(r[k] for r in runs), "max": max(r[k] for r in runs)}
            for k in keys}


# --- profile: py-spy raw (collapsed) stacks of the sampler, attributed by the frames they hold ---

# First match wins, so the more specific attributions come first. Frame text is py-spy's
# "Class.function (file:line)". The sampler runs on uvloop (uvicorn's loop), whose loop is
# native: py-spy shows no frame for it, so a sample whose stack ends at asyncio's
# Runner.run is the loop's own work (epoll, socket reads and writes, handle dispatch), and
# callbacks it runs outside any coroutine (aiohttp's protocol, its body-writer tasks) start
# right under Runner.run too.
_CATEGORIES = (
    ("completion request: Rollouts.generate (pool, aiohttp client, parse_completions)",
     ("Rollouts.generate (services/sampler/rollouts/rollout.py",)),
    ("/tokenize request: Rollouts._tokenize (pool, aiohttp client)", ("Rollouts._tokenize (services/sampler/rollouts/rollout.py",)),
    ("aiohttp callbacks and tasks outside the request coroutines (response parsing, body writes)", ("aiohttp/",)),
    ("env turn: env_step, env_response, render.after_turn (its /tokenize excluded)",
     ("env_step (services/sampler/rollouts/multiturn/conversation.py", "services/sampler/rollouts/multiturn/render.py")),
    ("scoring (rewards)", ("score (services/sampler/rollouts/multiturn/trajectories.py", "services/sampler/rollouts/envs/")),
    ("trajectory tasks: group_trajectories, TaskGroup, run_conversation's own code", ("services/sampler/rollouts/multiturn/",)),
    ("worker threads (rollout log parquet writes, synchronous env code)", ("Thread._bootstrap (threading.py",)),
    ("Redis (redis-py)", ("redis/asyncio/",)),
    ("sampler HTTP API (uvicorn: /batch, /weights_version, /status)", ("uvicorn/protocols", "starlette/", "fastapi/")),
    ("batch building and sealing (producer, sources, strategies, codec, rollout log)",
     ("services/sampler/", "shared/")),
)
# Threads parked on a queue, which py-spy still counted as active (--nonblocking reads the
# thread state without stopping it, and a thread can be caught between its wake-up and its wait).
_IDLE_LEAVES = ("Condition.wait (threading.py", "_worker (concurrent/futures/thread.py")
LOOP = "event loop (uvloop, native: epoll, socket I/O, callback dispatch)"


def _profile_shares(raw_path: Path) -> dict[str, Any]:
    samples: Counter[str] = Counter()
    total = idle = 0
    for line in raw_path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        if frames[-1].startswith(_IDLE_LEAVES):
            idle += n
            continue
        total += n
        # Only what runs under the loop (or a thread) counts: the frames above it are the
        # entry point (services/cli.py, services/sampler/entrypoint.py), in every stack.
        runner = next((i for i, f in enumerate(frames) if f.startswith("Runner.run (")), None)
        if runner is not None and runner == len(frames) - 1:
            samples[LOOP] += n
            continue
        tail = ";".join(frames if runner is None else frames[runner + 1:])
        for name, needles in _CATEGORIES:
            if any(needle in tail for needle in needles):
                samples[name] += n
                break
        else:
            samples["other"] += n
    return {"samples": total, "idle_samples_dropped": idle,
            "shares": {k: round(v / total, 3) for k, v in samples.most_common()} if total else {}}


def _profile(tmp: Path, redis_url: str, *, steps: int, warmup: int, shape: dict[str, int],
             max_concurrency: int) -> dict[str, Any]:
    exe = Path(sys.executable).with_name("py-spy")
    if not exe.exists():
        return {"skipped": "py-spy is not installed (the dev extra)"}
    out = tmp / "multiturn-profile.txt"
    run = _standin_run(tmp, redis_url, env="parity_dialogue", turns=3, max_tokens=8, temperature=1.0, steps=steps, warmup=warmup,
                       shape=shape, max_concurrency=max_concurrency, profile=out)
    if not out.exists():
        return {"skipped": "py-spy wrote no profile (ptrace not permitted?)"}
    shares = _profile_shares(out)
    return {"run": f"turns=3, max_tokens 8, temperature 1, same shape and window; py-spy at {PYSPY_RATE} Hz, "
                   "idle threads left out; this run's CPU is not reported above (py-spy slows what it samples)",
            # Samples / rate against the sampler's measured CPU checks that idle time stayed out.
            "sampled_busy_s": round(shares["samples"] / PYSPY_RATE, 2), "sampler_cpu_s": run["sampler_cpu_s"],
            "sampler_cpu_us_per_turn_while_profiled": run["sampler_cpu_us_per_turn"], **shares}


# --- part 2: time to a sealed batch on the CPU inference server ---


def _cpu_server_run(tmp: Path, model: Path, *, turns: int, max_tokens: int, batches: int, warmup: int,
                    shape: dict[str, int], max_concurrency: int) -> dict[str, Any]:
    from tests.support.servers import ServiceProcess, free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = ServiceProcess([sys.executable, "-m", "services.cli", "inference", "--model", str(model), "--port", str(port),
                             "--log-level", "warning"],
                            name="inference", log_path=tmp / f"inference-{port}.log", ready_url=url + "/health",
                            env=token_env())
    try:
        server.wait_ready(120)
        with sampler_process(tmp / f"cpu-{uuid.uuid4().hex[:8]}", inference_urls=[url], max_staleness=0,
                             max_concurrency=max_concurrency, keep_batches=4, env="parity_dialogue",
                             env_args=json.dumps(_env_args(turns)), max_tokens=max_tokens, seed=0, **shape) as sampler:
            records = asyncio.run(trainer_loop(sampler.url, warmup + batches, 0.0, deadline_s=600))
            counts = _counts(sampler.url, None)
    finally:
        server.terminate()
    measured = records[warmup:]
    gen = [r["stats"]["generation_seconds"] for r in measured]
    return {
        "turns": turns,
        "generation_seconds": [round(g, 3) for g in gen],
        "generation_seconds_median": round(median(gen), 3),
        "generation_seconds_min": round(min(gen), 3),
        "generation_seconds_max": round(max(gen), 3),
        "tokens_per_turn_whole_run": round(counts["tokens"] / counts["turns"], 2),
        "finish_reasons": [r["stats"]["finish_reasons"] for r in measured],
        "warmup_batches_discarded": [round(r["stats"]["generation_seconds"], 3) for r in records[:warmup]],
    }


def run(results_dir: Path, *, prompts_per_step: int = 8, num_generations: int = 16, max_concurrency: int = 64,
        repeats: int = 3, warmup: int = 3, turns_measured: int = 15360, profile: bool = True,
        server_batches: int = 6, server_warmup: int = 1) -> dict:
    shape = {"prompts_per_step": prompts_per_step, "num_generations": num_generations}
    trajectories = prompts_per_step * num_generations
    load_at_start = round(os.getloadavg()[0], 2)
    code_at_start = _code_state()

    def steps_for(turns: int) -> int:
        # The same number of model turns in every window (turns=1 gets 3x the batches), so
        # each window holds a similar amount of sampler work and as many garbage collections.
        return warmup + 1 + max(4, turns_measured // (trajectories * turns))

    # (label, env, turns, max_tokens, temperature). turns=1 has no environment turn, so it is
    # the baseline of both parity_dialogue and its unique-message variant.
    configs = [("turns1", "parity_dialogue", 1, 8, 1.0), ("turns3", "parity_dialogue", 3, 8, 1.0),
               ("turns3_unique", "unique", 3, 8, 1.0),
               ("turns3_t0_mt8", "parity_dialogue", 3, 8, 0.0), ("turns3_t0_mt256", "parity_dialogue", 3, 256, 0.0)]
    started = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {c[0]: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-multiturn-") as tmp_name:
        tmp = Path(tmp_name)
        with redis_server(tmp) as redis_url:
            for _ in range(repeats):  # interleaved, so a burst of other work hits every config alike
                for label, env, turns, max_tokens, temperature in configs:
                    runs[label].append(_standin_run(tmp, redis_url, env=env, turns=turns, max_tokens=max_tokens,
                                                    temperature=temperature, steps=steps_for(turns), warmup=warmup,
                                                    shape=shape, max_concurrency=max_concurrency))
            prof = (_profile(tmp, redis_url, steps=steps_for(3), warmup=warmup, shape=shape, max_concurrency=max_concurrency)
                    if profile else {"skipped": "profile=False"})
        part1_s = time.perf_counter() - started

        from services.inference.init_model import init_model

        model = init_model(tmp / "tiny", preset="tiny", seed=0)
        server_runs = [_cpu_server_run(tmp, model, turns=t, max_tokens=8, batches=server_batches, warmup=server_warmup,
                                       shape=shape, max_concurrency=max_concurrency) for t in (1, 3)]
    total_s = time.perf_counter() - started
    code_at_end = _code_state()

    keys = ("sampler_cpu_us_per_turn", "sampler_cpu_us_per_token", "sampler_cpu_us_per_trajectory", "tokens_per_turn",
            "tokenize_per_trajectory", "sampler_core_utilisation", "main_thread_share_of_sampler_cpu",
            "standin_cpu_us_per_turn", "turns_per_s")
    summary = {label: _summary(rs, keys) for label, rs in runs.items()}

    def mmm(values: list[float]) -> dict[str, float]:
        return {"median": round(median(values), 3), "min": min(values), "max": max(values)}

    def extra_turn(label: str) -> list[dict[str, float]]:
        """Per repeat, against turns=1 of the same repeat: b = the CPU per trajectory that two
        more turns add, / 2; the /tokenize requests those turns add, / 2; and a = turns=1's CPU
        per trajectory - b (what does not grow with the turns)."""
        out = []
        for r1, r3 in zip(runs["turns1"], runs[label]):
            b = (r3["sampler_cpu_us_per_trajectory"] - r1["sampler_cpu_us_per_trajectory"]) / 2
            out.append({"extra_turn_us": round(b, 1),
                        "tokenize_per_extra_turn": round((r3["tokenize_per_trajectory"] - r1["tokenize_per_trajectory"]) / 2, 3),
                        "per_trajectory_fixed_us": round(r1["sampler_cpu_us_per_trajectory"] - b, 1)})
        return out

    cached, unique = extra_turn("turns3"), extra_turn("turns3_unique")
    # One /tokenize request: what the unique-message turns cost over parity_dialogue's, per
    # /tokenize request they add (same repeat, so the same machine conditions).
    tokenize_us = [round((u["extra_turn_us"] - c["extra_turn_us"])
                         / (u["tokenize_per_extra_turn"] - c["tokenize_per_extra_turn"]), 1)
                   for c, u in zip(cached, unique) if u["tokenize_per_extra_turn"] - c["tokenize_per_extra_turn"] > 0.5]
    per_token = [round((hi["sampler_cpu_us_per_turn"] - lo["sampler_cpu_us_per_turn"])
                       / (hi["tokens_per_turn"] - lo["tokens_per_turn"]), 3)
                 for lo, hi in zip(runs["turns3_t0_mt8"], runs["turns3_t0_mt256"])]
    extra_cached = mmm([c["extra_turn_us"] for c in cached])
    extra_unique = mmm([u["extra_turn_us"] for u in unique])
    tok_cached = median([c["tokenize_per_extra_turn"] for c in cached])
    tokenize_med = median(tokenize_us) if tokenize_us else None
    per_token_med = median(per_token)
    tokens_per_turn = summary["turns3"]["tokens_per_turn"]["median"]
    goal_at_tokens = GOAL_FIXED_US + GOAL_PER_TOKEN_US * tokens_per_turn
    # A turn without its /tokenize: the completion request, env_response and the conversation's bookkeeping.
    no_tokenize = extra_cached["median"] - tok_cached * tokenize_med if tokenize_med is not None else None
    derived = {
        "extra_turn_cached_renders": cached,
        "extra_turn_unique_messages": unique,
        "extra_turn_us": extra_cached,
        "extra_turn_unique_us": extra_unique,
        "tokenize_per_extra_turn": {"cached": tok_cached,
                                    "unique": median([u["tokenize_per_extra_turn"] for u in unique])},
        "tokenize_request_us_per_repeat": tokenize_us,
        "tokenize_request_us": mmm(tokenize_us) if tokenize_us else None,
        "turn_without_tokenize_us": round(no_tokenize, 1) if no_tokenize is not None else None,
        "per_token_us_per_repeat": per_token,
        "per_token_us": mmm(per_token),
        "per_trajectory_fixed_us": round(median([c["per_trajectory_fixed_us"] for c in cached]), 1),
        "tokens_per_turn": tokens_per_turn,
        "goal_us_at_these_tokens": round(goal_at_tokens, 1),
        "meets_goal_extra_turn": extra_cached["median"] <= goal_at_tokens,
        "meets_goal_extra_turn_unique": extra_unique["median"] <= goal_at_tokens,
        "meets_goal_all_in_turn": summary["turns3"]["sampler_cpu_us_per_turn"]["median"] <= goal_at_tokens,
        "meets_goal_per_token": per_token_med <= GOAL_PER_TOKEN_US,
    }
    result = {
        "benchmark": "multiturn",
        "setup": {
            "env": "parity_dialogue (env_args turns), seed 0",
            "batch": f"{prompts_per_step} prompts x {num_generations} generations = {trajectories} trajectories",
            "num_generations": num_generations,
            "part1": {"inference": "stand-in, token_latency 0", "max_staleness": 2, "max_concurrency": max_concurrency,
                      "trainer": "GET /batch (msgpack) -> POST /weights_version at once (T = 0)",
                      "warmup_batches_discarded": warmup, "repeats": repeats,
                      "steps": {c[0]: steps_for(c[2]) for c in configs},
                      "configs": [{"label": c[0], "env": ENVS[c[1]], "turns": c[2], "max_tokens": c[3],
                                   "temperature": c[4]} for c in configs]},
            "part2": {"inference": "tandem inference (CPU server), fresh tiny model (init_model preset tiny, seed 0)",
                      "max_staleness": 0, "max_tokens": 8, "temperature": 1.0,
                      "batches_measured": server_batches, "warmup_batches_discarded": server_warmup},
        },
        "part1_runs": runs,
        "part1_summary": summary,
        "derived": derived,
        "goal": f"a turn costs the sampler <= {GOAL_FIXED_US:g} us + {GOAL_PER_TOKEN_US:g} us per token",
        "profile": prof,
        "part2": server_runs,
        "part2_ratio_turns3_over_turns1": round(server_runs[1]["generation_seconds_median"]
                                                / server_runs[0]["generation_seconds_median"], 2),
        "bench_seconds": {"part1_and_profile": round(part1_s, 1), "total": round(total_s, 1)},
        "host": {**host(), "loadavg_1m_at_start": load_at_start},
        "code": {**code_at_start, "changed_during_run": {k: v for k, v in code_at_end.items() if k != "head"}
                 != {k: v for k, v in code_at_start.items() if k != "head"}},
        "command": COMMAND,
    }
    write_results(results_dir, "multiturn", result, _markdown(result))
    return result


def _reading(r: dict[str, Any]) -> list[str]:
    """What dominates a turn, from the counts and the profile of this run."""
    s, d, prof = r["part1_summary"], r["derived"], r["profile"]
    n = r["setup"]["num_generations"]
    tok1 = s["turns1"]["tokenize_per_trajectory"]["median"]
    lines = ["", "### What dominates a turn", ""]
    if d["tokenize_request_us"] is not None:
        lines += [
            f"Each /tokenize request costs the sampler about {d['tokenize_request_us']['median']:g} us "
            f"({d['tokenize_request_us']['min']:g}-{d['tokenize_request_us']['max']:g}): the unique-message turns' "
            "extra CPU over parity_dialogue's, per /tokenize they add. A turn without its /tokenize (its completion "
            f"request, env_response and the conversation's bookkeeping) is then about {d['turn_without_tokenize_us']:g} "
            "us. The per-token part is small next to both: at "
            f"{d['tokens_per_turn']:g} tokens per turn it is {d['per_token_us']['median'] * d['tokens_per_turn']:.1f} us. "
            f"The rest of a trajectory's cost, a = {d['per_trajectory_fixed_us']:g} us (CPU per trajectory at turns=1 "
            "minus one extra turn), is scoring, building the sample, sealing, packing, the rollout log and the "
            "hand-off.",
            "",
        ]
    lines += [
        f"Opening prompts: {tok1:g} /tokenize per trajectory at turns=1, where every /tokenize is an opening "
        f"prompt's (one per group of {n} would be {1 / n:.3f}; every prompt is new here: each window stays inside "
        "the first epoch of the 2048 training prompts, a seeded permutation)."
        + (" So each trajectory of a group renders the same opening prompt itself: the group's trajectories start "
           "together, and each misses the cache before the first render returns." if tok1 > 0.5 else ""),
    ]
    if "shares" in prof:
        sh = prof["shares"]
        http = sum(v for k, v in sh.items() if k.startswith(("completion request", "/tokenize request", "aiohttp", "event loop")))
        own = sum(v for k, v in sh.items() if k.startswith(("env turn", "trajectory tasks")))
        lines += [
            "",
            f"The profile (parity_dialogue, turns=3): the requests' coroutines, aiohttp's callbacks and the native "
            f"event loop (mostly the same requests' socket I/O) hold {http:.0%} of the sampled time; the "
            f"conversation's own code (env_response, rendering, run_conversation, the trajectory tasks) {own:.0%}.",
        ]
    if d["turn_without_tokenize_us"] is not None:
        verdict = "above" if d["turn_without_tokenize_us"] > d["goal_us_at_these_tokens"] else "within"
        lines += [
            "",
            f"Against the goal ({d['goal_us_at_these_tokens']:g} us for a turn of {d['tokens_per_turn']:g} tokens): "
            f"a turn whose render is cached is {d['extra_turn_us']['median']:g} us, one that needs its /tokenize "
            f"{d['extra_turn_unique_us']['median']:g} us; even without any /tokenize, a turn "
            f"(about {d['turn_without_tokenize_us']:g} us, mostly its completion request's HTTP work: see the profile "
            f"below) is {verdict} the goal.",
        ]
    return lines


def _markdown(r: dict[str, Any]) -> str:
    s, d, setup = r["part1_summary"], r["derived"], r["setup"]

    mmm = _median_range
    lines = [
        "# Multi-turn rollouts: sampler CPU per turn, and time to a sealed batch",
        "",
        *_run_header(r, r["bench_seconds"]["total"]),
        "",
        "## 1. Sampler CPU per model turn (instantaneous stand-in)",
        "",
        f"parity_dialogue, batch {setup['batch']}, stand-in with token_latency 0, trainer stand-in with T = 0, "
        f"max_staleness 2, {setup['part1']['warmup_batches_discarded']} warm-up batches, "
        f"{setup['part1']['repeats']} repeats per config (interleaved); median (min-max). Each model turn is one "
        "POST /v1/completions (n = 1); an environment turn is rendered by POST /tokenize unless render.py has "
        "rendered the same messages before. turns3_unique runs `bench.bench_multiturn:UniqueParityDialogue`, "
        "parity_dialogue with a counter after each environment message, so that no environment turn is a cache "
        "hit. Counts are the sampler's own (GET /status) over the same window as its CPU; env_args max_digits 4 "
        "and num_train 2048 in every config, so every opening prompt in a window is new.",
        "",
        "| config | env | turns | max_tokens | temp | tokens/turn | /tokenize per trajectory | sampler CPU us/turn | "
        "sampler CPU us/token | sampler CPU us/trajectory | sampler cores busy | main thread share of sampler CPU | "
        "stand-in CPU us/turn |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in setup["part1"]["configs"]:
        x = s[c["label"]]
        lines.append(f"| {c['label']} | {c['env'].rsplit(':', 1)[-1]} | {c['turns']} | {c['max_tokens']} | {c['temperature']:g} | "
                     f"{x['tokens_per_turn']['median']:g} | {x['tokenize_per_trajectory']['median']:g} | "
                     f"{mmm(x['sampler_cpu_us_per_turn'])} | {mmm(x['sampler_cpu_us_per_token'])} | "
                     f"{mmm(x['sampler_cpu_us_per_trajectory'])} | {x['sampler_core_utilisation']['median']:g} | "
                     f"{x['main_thread_share_of_sampler_cpu']['median']:.0%} | "
                     f"{x['standin_cpu_us_per_turn']['median']:g} |")
    lines += [
        "",
        "Derived (per repeat against turns=1 of the same repeat, then median (min-max)):",
        "",
        f"* One extra model turn, parity_dialogue (turns3 vs turns1: CPU per trajectory difference / 2): "
        f"**{mmm(d['extra_turn_us'])} us**, at {d['tokens_per_turn']:g} tokens per turn, with "
        f"{d['tokenize_per_extra_turn']['cached']:g} /tokenize requests (the trajectories of a group hear the same "
        "numbers, and render.py renders each environment message once).",
        f"* One extra model turn whose environment message is new every time (turns3_unique vs turns1): "
        f"**{mmm(d['extra_turn_unique_us'])} us**, with {d['tokenize_per_extra_turn']['unique']:g} /tokenize "
        "requests: a completion request, a /tokenize request and an env_response.",
        "* One /tokenize request: "
        + (f"**{mmm(d['tokenize_request_us'])} us** (the difference of the two, per /tokenize request added)."
           if d["tokenize_request_us"] else "not derived (the two configs did not differ by a /tokenize per turn)."),
        f"* Per sampled token (temperature 0, turns=3, max_tokens 8 vs 256, tokens per turn exactly max_tokens): "
        f"**{mmm(d['per_token_us'], '{:.3g}')} us/token**.",
        f"* Goal {r['goal']}: {d['goal_us_at_these_tokens']:g} us at {d['tokens_per_turn']:g} tokens per turn. "
        f"Extra turn, parity_dialogue: **{'met' if d['meets_goal_extra_turn'] else 'NOT met'}** "
        f"({d['extra_turn_us']['median'] / d['goal_us_at_these_tokens']:.1f}x the goal); with a new message each "
        f"turn: **{'met' if d['meets_goal_extra_turn_unique'] else 'NOT met'}** "
        f"({d['extra_turn_unique_us']['median'] / d['goal_us_at_these_tokens']:.1f}x); all-in CPU per turn at "
        f"turns=3 ({s['turns3']['sampler_cpu_us_per_turn']['median']:g} us, batch costs included): "
        f"**{'met' if d['meets_goal_all_in_turn'] else 'NOT met'}**; per-token part: "
        f"**{'met' if d['meets_goal_per_token'] else 'NOT met'}**.",
    ]
    lines += _reading(r)
    prof = r["profile"]
    lines += ["", "### Where the sampler's CPU goes (py-spy)", ""]
    if "skipped" in prof:
        lines.append(f"Skipped: {prof['skipped']}.")
    else:
        lines += [f"{prof['run']}. {prof['samples']} samples kept ({prof['idle_samples_dropped']} of threads parked "
                  f"on a queue dropped): {prof['sampled_busy_s']} s of samples against {prof['sampler_cpu_s']} s of "
                  "sampler CPU in the same window. py-spy counts a thread that is runnable but waiting for a core "
                  "as busy, and on 2 shared cores it often waits, so these are shares of the sampler's busy "
                  "(running or runnable) time, an approximation of its CPU split. Each sample goes to the first "
                  "of these that its stack holds:", "",
                  "| share | where |", "|---|---|"]
        lines += [f"| {v:.1%} | {k} |" for k, v in prof["shares"].items()]
    lines += [
        "",
        "## 2. Time to a sealed batch, CPU inference server",
        "",
        f"{setup['part2']['inference']}; parity_dialogue, batch {setup['batch']}, max_tokens 8, temperature 1, "
        f"max_staleness 0 (one batch generated at a time), trainer stand-in publishing at once. "
        f"generation_seconds = sealed_at - generation_started_at of each batch; "
        f"{setup['part2']['warmup_batches_discarded']} warm-up batch discarded. Server and sampler share the CPUs.",
        "",
        "| turns | generation s per batch (median) | min | max | each batch | tokens/turn |",
        "|---|---|---|---|---|---|",
    ]
    for p in r["part2"]:
        lines.append(f"| {p['turns']} | {p['generation_seconds_median']} | {p['generation_seconds_min']} | "
                     f"{p['generation_seconds_max']} | {', '.join(map(str, p['generation_seconds']))} | "
                     f"{p['tokens_per_turn_whole_run']} |")
    lines += ["", f"turns=3 over turns=1: {r['part2_ratio_turns3_over_turns1']}x the time to a sealed batch "
              "(medians). Not broken down here; a later turn's prompt is the whole conversation so far (a longer "
              "prefill on a server that shares the 2 cores), and an environment turn whose render is not cached "
              "waits for a /tokenize round trip to the same server before its next completion request. Tokens per "
              "turn are from the sampler's counters over the whole run (warm-up included).", ""]
    return "\n".join(lines)
