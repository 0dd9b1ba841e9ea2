"""verifiers environments vs Tandem's native paths: what a trajectory and a model turn cost the sampler.

Real processes on loopback, as in bench_multiturn: one private redis-server and one
vLLM-protocol stand-in (token_latency 0: generation is free, so what is measured is the
sampler's own work, and for verifiers that of verifiers' machinery in it), and one sampler
process per config (tests/support/servers.start_sampler_process, max_staleness 2) fed by a
trainer stand-in that takes each batch (msgpack arrays, as SamplerClient asks) and publishes
the next version at once (T = 0).

The same conversations through both paths, 8 prompts x 16 generations, max_tokens 8,
temperature 0 (the stand-in then answers every turn with exactly 8 tokens; at temperature 1
it ends 10% of turns before their first token, and a verifiers trajectory with an empty model
turn fails in vf/traces.py and is retried, which would mix retries into the numbers):

* single turn: `toy` (the native single-turn path: one POST /v1/completions with n = 16 per
  group, text prompt) and `EchoDialogue` with max_turns 1 (tests/support/envs.py: the native
  multi-turn path, n = 1 per trajectory, the prompt rendered with the chat template) vs
  `verifiers:tandem-vf-parity` (tests/vf/plugins: a plain taskset, one model call);
* three turns: `EchoDialogue` max_turns 3 ("hello i", then "next k" twice) vs
  `verifiers:tandem-vf-dialogue` turns 3 ("count i", then "again" twice); turns 1 of each
  gives the cost of one more turn.

A verifiers model turn, all inside the sampler process: the tandem-chat harness
(services/sampler/rollouts/vf/harness.py) hands its /chat/completions to verifiers' interception
server (an aiohttp app; with vf_client = in_process, the default, its route handler is called
in-process, vf/local_interception.py, else POSTed to), which records the turn in the trace graph and
has its TrainClient render the messages with services/sampler/rollouts/vf/renderer.py in a worker
thread and hand the token ids to the sampler's generate code: in-process by default
(vf_client = in_process, vf/local_client.py), else through the openai SDK's httpx client to
the sampler's own POST /inference/v1/generate (FastAPI); that code forwards them to the
stand-in through the inference pool. In-process, one HTTP round trip per turn, as for a native
turn (the pool's request to the server); over HTTP, three; and per episode,
verifiers' runtime (`subprocess`: a scratch directory per rollout), trace and scoring.
When bench/results/verifiers.json exists, the new results are also set against it
(bench/verifiers_compare.py: CPU per turn before and now, and issue 43's 5 ms target).

Measured per config, after a warm-up (native: 3 batches received; verifiers: a batch's worth
of model turns done, past the tokenizer load and the interception server's start), over
`REPEATS` consecutive windows of fixed length in the same process: the sampler's CPU seconds
(utime + stime of all its threads from /proc; the main thread's alone; its waited-for
children's) against the sampler's own counters over the same window (GET /status: model
turns = completions, sampled tokens) and the stand-in's (requests). Trajectories = model
turns / turns (every conversation runs all its turns; the env's `trajectories` counter,
which moves when a whole episode ends, is kept as a check). Seconds per sealed batch = 128
trajectories at the window's rate (at max_staleness 2 the producer works on up to 3 batches
at once, so a batch's own generation_seconds overlaps others'; those are reported too). One
more window of each verifiers config with `profile` runs under py-spy (not timed: py-spy
slows what it samples) and its samples are attributed to the parts of a turn.

Writes bench/results/verifiers.json and verifiers.md; `python -m bench verifiers`.
"""

from __future__ import annotations

import asyncio
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

from bench._common import (
    AUTH, REPO, CLK_TCK, cpu_seconds, host, median, redis_server, sampler_process, standin_process, write_results,
)
from bench import verifiers_compare
from bench.bench_multiturn import _code_state, _main_thread_cpu, _median_range, _run_header

COMMAND = ".venv/bin/python -m bench verifiers  (or make bench ARGS=verifiers)"
PLUGINS = REPO / "tests" / "vf" / "plugins"
SHAPE = {"prompts_per_step": 8, "num_generations": 16}
TRAJECTORIES_PER_BATCH = SHAPE["prompts_per_step"] * SHAPE["num_generations"]
MAX_TOKENS = 8
TEMPERATURE = 0.0
MAX_CONCURRENCY = 64
REPEATS = 3
PROFILE_S = 4.0  # at least
PYSPY_RATE = 50  # py-spy pauses the process for each sample (--native): fewer pauses, less slowdown

# Verifiers windows are longer: a verifiers trajectory costs far more, and each window
# should hold a few hundred of them.
CONFIGS: list[dict[str, Any]] = [
    {"label": "native_toy", "path": "native", "env": "toy", "env_args": {"num_train": 2048}, "turns": 1, "window_s": 1.5,
     "what": "toy: native single-turn path (n = 16 per request, text prompt)"},
    {"label": "native_echo1", "path": "native", "env": "tests.support.envs:EchoDialogue",
     "env_args": {"size": 16, "max_turns": 1}, "turns": 1, "window_s": 1.5,
     "what": "EchoDialogue max_turns 1: native multi-turn path, one turn (n = 1, chat template)"},
    {"label": "vf_parity", "path": "verifiers", "env": "verifiers:tandem-vf-parity", "env_args": {}, "turns": 1,
     "window_s": 6.0, "profile": True, "what": "verifiers:tandem-vf-parity: a plain taskset, one model call"},
    {"label": "native_echo3", "path": "native", "env": "tests.support.envs:EchoDialogue",
     "env_args": {"size": 16, "max_turns": 3}, "turns": 3, "window_s": 1.5, "profile": True,
     "what": "EchoDialogue max_turns 3: native multi-turn path"},
    {"label": "vf_dialogue1", "path": "verifiers", "env": "verifiers:tandem-vf-dialogue", "env_args": {"turns": 1},
     "turns": 1, "window_s": 6.0, "what": "verifiers:tandem-vf-dialogue turns 1 (interaction(), one turn)"},
    {"label": "vf_dialogue3", "path": "verifiers", "env": "verifiers:tandem-vf-dialogue", "env_args": {"turns": 3},
     "turns": 3, "window_s": 6.0, "profile": True, "what": "verifiers:tandem-vf-dialogue turns 3"},
]


# --- CPU and counters ---

def _machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of every CPU of the machine since boot (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _proc_cpu(pid: int) -> dict[str, float]:
    """The process's CPU seconds from /proc/PID/stat, all threads: user, system, and its
    waited-for children's (a runtime's subprocesses, tool servers that exited)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # After the command name: state is fields[0]; utime, stime, cutime, cstime are stat fields 14-17.
    return {"user": int(fields[11]) / CLK_TCK, "system": int(fields[12]) / CLK_TCK,
            "children": (int(fields[13]) + int(fields[14])) / CLK_TCK}


async def _snapshot(http: httpx.AsyncClient, sampler: Any, standin: Any) -> dict[str, float]:
    # /status first, then the CPU: the request's own CPU falls outside the window at both ends alike.
    status = (await http.get(sampler.url + "/status")).json()
    stats = (await http.get(standin.url + "/_standin/stats")).json()
    envs = list(status["environments"].values())
    cpu = _proc_cpu(sampler.pid)
    busy, ticks = _machine_ticks()
    return {
        "machine_busy_ticks": busy, "machine_ticks": ticks,
        "t": time.perf_counter(), "cpu": cpu["user"] + cpu["system"], "system": cpu["system"],
        "main": _main_thread_cpu(sampler.pid), "children": cpu["children"], "standin_cpu": cpu_seconds(standin.pid),
        "turns": status["throughput"]["completions"], "tokens": status["throughput"]["completion_tokens"],
        "trajectories_counted": sum(e.get("trajectories", 0) for e in envs),
        "env_errors": sum(e.get("env_errors", 0) for e in envs),
        "requests": stats["requests"],
    }


def _window(a: dict[str, float], b: dict[str, float], turns: int) -> dict[str, Any]:
    d = {k: b[k] - a[k] for k in a}
    wall, cpu, done = d["t"], d["cpu"], d["turns"]
    if done <= 0:
        raise RuntimeError(f"no model turn done in a {wall:.1f} s window")
    trajectories = done / turns
    return {
        "wall_s": round(wall, 3), "sampler_cpu_s": round(cpu, 3), "model_turns": done,
        "trajectories": round(trajectories, 1),
        # Native single-turn envs keep no per-env counters (0 here).
        "trajectories_counted": d["trajectories_counted"], "env_errors": d["env_errors"],
        "tokens_per_turn": round(d["tokens"] / done, 2),
        "trajectories_per_s": round(trajectories / wall, 2),
        "turns_per_s": round(done / wall, 1),
        "seconds_per_batch": round(TRAJECTORIES_PER_BATCH / (trajectories / wall), 3),
        "sampler_cpu_us_per_trajectory": round(cpu / trajectories * 1e6, 1),
        "sampler_cpu_us_per_turn": round(cpu / done * 1e6, 1),
        "sampler_cores_busy": round(cpu / wall, 3),
        "main_thread_share": round(d["main"] / cpu, 3) if cpu else 0.0,
        "system_share": round(d["system"] / cpu, 3) if cpu else 0.0,
        # How busy the whole machine was (every process, the bench's and others'), of all its CPUs.
        "machine_busy": round(d["machine_busy_ticks"] / d["machine_ticks"], 3) if d["machine_ticks"] else 0.0,
        "children_cpu_s": round(d["children"], 3),
        "standin_cpu_us_per_turn": round(d["standin_cpu"] / done * 1e6, 1),
        "inference_requests_per_trajectory": round(d["requests"] / trajectories, 3),
    }


async def _consume(url: str, stop: asyncio.Event, records: list[dict[str, Any]]) -> None:
    """The trainer stand-in: GET /batch?step=N (msgpack arrays, as SamplerClient asks), publish
    N + 1 at once, until `stop`."""
    from shared import codec

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(30.0, read=120.0), headers=AUTH) as http:
        step = 0
        while not stop.is_set():
            response = await http.get("/batch", params={"step": step, "timeout": 5}, headers={"Accept": codec.ARRAYS})
            if response.status_code == 204:
                continue
            if response.status_code != 200:
                raise RuntimeError(f"GET /batch step={step}: HTTP {response.status_code}: {response.text[:300]}")
            stats = codec.decode(response.headers.get("content-type"), response.content)["stats"]
            records.append({"step": step, "got": time.perf_counter(), "generation_seconds": stats["generation_seconds"]})
            published = await http.post("/weights_version", json={"version": step + 1, "checkpoint_path": None})
            if published.status_code != 200:
                raise RuntimeError(f"POST /weights_version {step + 1}: HTTP {published.status_code}: {published.text[:300]}")
            step += 1


# --- py-spy: where a verifiers turn's CPU goes ---

# First match wins, so the more specific attributions come first. Frame text is py-spy's
# "Class.function (file:line)". The sampler runs on uvloop, whose loop is native: a sample
# whose stack ends at asyncio's Runner.run is the loop's own work (epoll, socket I/O,
# dispatch), and callbacks it runs outside any coroutine start right under Runner.run.
_CATEGORIES = (
    ("pydantic model_construct -> FieldInfo.get_default -> inspect.signature of a default_factory, every call "
     "(verifiers' trace graph: PendingTurn.commit / _commit_turn)", ("FieldInfo.get_default (pydantic/fields.py",)),
    ("httpcore pool scan: has_expired -> is_socket_readable on every pooled connection at each request and response "
     "close (the TrainClient's openai client, up to 100 keep-alive connections)", ("has_expired (httpcore/",)),
    ("verifiers subprocess runtime: a scratch directory per rollout (mkdir; rmtree in a worker thread)",
     ("runtimes/subprocess.py", "rmtree (shutil.py", "_rmtree_safe_fd (shutil.py")),
    ("harness: building httpx clients (an SSL context each; the CA bundle unless verify=False) and their new "
     "TCP connections",
     ("AsyncClient.__init__ (httpx/_client.py", "AsyncHTTPConnection._connect (httpcore/")),
    ("TrainClient rendering in worker threads (vf/renderer.py: chat template, tokenizer encode)",
     ("services/sampler/rollouts/vf/renderer.py", "RendererSlot.run", "tokenizers", "transformers/")),
    ("inference pool requests to the stand-in (aiohttp client, parsing the answer; verifiers: the generate route's code)",
     ("services/sampler/rollouts/vf/generate.py", "services/sampler/api/routes/generate.py", "services/sampler/fleet/inference_pool.py",
      "services/sampler/rollouts/completions.py")),
    ("TrainClient -> the sampler's generate code in-process (vf/local_client.py: no HTTP; answer as JSON bytes)",
     ("services/sampler/rollouts/vf/local_client.py",)),
    ("TrainClient -> the sampler's /inference/v1/generate: renderers.client.generate, openai SDK, httpx client",
     ("renderers/client.py", "openai/", "TrainClient.get_response")),
    ("interception server: aiohttp handler, checks, trace graph (handle_request, PendingTurn.commit)",
     ("verifiers/v1/interception/",)),
    ("harness: its calls to the interception server (in-process: vf/local_interception.py; over HTTP: aiohttp "
     "client; JSON)",
     ("services/sampler/rollouts/vf/harness.py", "services/sampler/rollouts/vf/local_interception.py")),
    ("verifiers episode machinery (Env.run_episode, Rollout, Agent, Interaction, Trace, scoring)", ("verifiers/v1/",)),
    ("httpx/httpcore/anyio outside the above", ("httpx/", "httpcore/", "anyio/")),
    ("aiohttp callbacks outside the request coroutines (client reads, body writes; verifiers: the interception "
     "server's protocol)",
     ("aiohttp/",)),
    ("the sampler's HTTP server stack (uvicorn, starlette, fastapi, middlewares: /batch, /status; verifiers: every "
     "generate call)",
     ("uvicorn/", "starlette/", "fastapi/", "services/sampler/observability/", "services/sampler/api/guards.py")),
    ("trajectory tasks and their samples (multiturn/, vf/environment.py, vf/traces.py)",
     ("services/sampler/rollouts/vf/", "services/sampler/rollouts/multiturn/")),
    ("imports (modules first used in the window)", ("<frozen importlib",)),
    ("other worker threads (rollout log writes)", ("Thread._bootstrap (threading.py",)),
    ("batch building and sealing (producer, sources, strategies, codec, Redis)", ("services/sampler/", "shared/", "redis/")),
    ("pydantic outside the above", ("pydantic",)),
)
GC = "garbage collection (gc_collect_main, in whichever frame allocated)"
# Threads waiting: py-spy's default mode pauses the process for each sample and keeps every
# thread it finds, waiting or not (its idle detection does not work here).
_IDLE_LEAVES = ("Condition.wait (threading.py", "_worker (concurrent/futures/thread.py", "Queue.get (queue.py",
                "Event.wait (threading.py", "select (selectors.py")
LOOP = "event loop (uvloop, native: epoll, socket I/O, callback dispatch)"


def _is_python(frame: str) -> bool:
    return ".py:" in frame or "(<frozen" in frame


def _attribute(frames: list[str]) -> str | None:
    """The part of the turn a sample is in, or None for a waiting thread."""
    python = [f for f in frames if _is_python(f)]
    if not python or python[-1].startswith(_IDLE_LEAVES) or (
            any(f.startswith("uv__io_poll") for f in frames) and "libc" in frames[-1]):
        return None  # a waiting thread, or the event loop waiting in epoll
    if any(f.startswith("gc_collect_main") for f in frames):
        return GC
    runner = next((i for i, f in enumerate(python) if f.startswith("Runner.run (")), None)
    if runner is not None and runner == len(python) - 1:
        return LOOP
    tail = ";".join(python if runner is None else python[runner + 1:])
    for name, needles in _CATEGORIES:
        if any(needle in tail for needle in needles):
            return name
    return "other"


def _profile_shares(raw_path: Path) -> dict[str, Any]:
    """Shares of busy samples by part of the turn, from py-spy's raw output with --native
    frames (needed to see the collector) and --threads: the Python frames decide the part,
    except that a sample in the garbage collector is its own part (the collector runs inside
    whatever allocation triggered it, so in Python frames alone its pauses show as one
    innocent line holding a large share). The main thread (the event loop: 90%+ of the
    sampler's CPU, and always runnable here) and the worker threads are kept apart: a worker
    blocked in a system call (rmtree's unlinks) counts as busy, so worker samples are no
    measure of CPU."""
    groups: dict[str, Counter[str]] = {"main": Counter(), "workers": Counter()}
    leaves: Counter[str] = Counter()
    idle = 0
    for line in raw_path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        thread, *frames = stack.split(";")
        part = _attribute(frames)
        if part is None:
            idle += n
            continue
        main = thread.endswith(": MainThread")
        groups["main" if main else "workers"][part] += n
        python = [f for f in frames if _is_python(f)]
        if main and part != GC:
            leaves[python[-1]] += n
    out: dict[str, Any] = {"idle_samples_dropped": idle}
    for name, counts in groups.items():
        total = sum(counts.values())
        out[name] = {"samples": total,
                     "shares": {k: round(v / total, 3) for k, v in counts.most_common()} if total else {}}
    main_total = out["main"]["samples"]
    out["main"]["top_python_leaf_frames_outside_gc"] = (
        {k: round(v / main_total, 3) for k, v in leaves.most_common(8)} if main_total else {})
    return out


async def _profiled_window(http: httpx.AsyncClient, sampler: Any, standin: Any, tmp: Path, label: str, turns: int,
                           seconds: float) -> dict[str, Any]:
    exe = Path(sys.executable).with_name("py-spy")
    if not exe.exists():
        return {"skipped": "py-spy is not installed (the dev extra)"}
    out = tmp / f"profile-{label}.txt"
    # py-spy's default mode (the process paused for each sample: consistent stacks), with
    # native frames, which show the garbage collector.
    spy = subprocess.Popen([str(exe), "record", "--pid", str(sampler.pid), "--rate", str(PYSPY_RATE), "--format", "raw",
                            "--native", "--threads", "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    a = await _snapshot(http, sampler, standin)
    await asyncio.sleep(seconds)
    b = await _snapshot(http, sampler, standin)
    spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
    try:
        await asyncio.to_thread(spy.wait, 60)
    except subprocess.TimeoutExpired:
        spy.kill()
    if not out.exists():
        return {"skipped": "py-spy wrote no profile (ptrace not permitted?)"}
    w = _window(a, b, turns)
    return {"window_s": w["wall_s"], "sampler_cpu_s": w["sampler_cpu_s"], "main_thread_share": w["main_thread_share"],
            "sampler_cpu_us_per_turn_while_profiled": w["sampler_cpu_us_per_turn"], **_profile_shares(out)}


# --- one config ---

async def _measure(sampler: Any, standin: Any, tmp: Path, cfg: dict[str, Any], repeats: int) -> dict[str, Any]:
    stop = asyncio.Event()
    records: list[dict[str, Any]] = []
    consumer = asyncio.create_task(_consume(sampler.url, stop, records))
    turns = cfg["turns"]
    native = cfg["path"] == "native"
    warm_batches, warm_turns = (3, 0) if native else (0, TRAJECTORIES_PER_BATCH * turns)
    # A sampler whose event loop is busy with hundreds of episodes can answer /status late.
    async with httpx.AsyncClient(timeout=120.0, headers=AUTH) as http:
        started = time.perf_counter()
        while True:
            if consumer.done():
                consumer.result()  # raises what stopped it
                raise RuntimeError("the trainer stand-in stopped")
            if native and len(records) >= warm_batches:
                break
            if not native and (await http.get(sampler.url + "/status")).json()["throughput"]["completions"] >= warm_turns:
                break
            if time.perf_counter() - started > 120:
                raise TimeoutError(f"{cfg['label']}: no warm-up within 120 s")
            await asyncio.sleep(0.05 if native else 0.5)
        warmup_s = time.perf_counter() - started
        warm_batches = len(records)
        windows = []
        mark = await _snapshot(http, sampler, standin)
        for _ in range(repeats):
            await asyncio.sleep(cfg["window_s"])
            nxt = await _snapshot(http, sampler, standin)
            windows.append(_window(mark, nxt, turns))
            mark = nxt
        measured_until = time.perf_counter()
        prof = (await _profiled_window(http, sampler, standin, tmp, cfg["label"], turns, max(cfg["window_s"], PROFILE_S))
                if cfg.get("profile") else None)
        status = (await http.get(sampler.url + "/status")).json()
    stop.set()
    try:
        await asyncio.wait_for(consumer, 30)
    except asyncio.TimeoutError:
        pass
    sealed = [r for r in records[warm_batches:] if r["got"] <= measured_until]
    # From the last warm-up batch on: the intervals between receipts while the windows ran.
    received = [r for r in records[max(warm_batches - 1, 0):] if r["got"] <= measured_until]
    gaps = [b["got"] - a["got"] for a, b in zip(received, received[1:])]
    env_counts = next(iter(status["environments"].values()), {})
    return {
        "warmup_s": round(warmup_s, 2), "warmup_batches": warm_batches, "warmup_turns": warm_turns, "windows": windows,
        "profile": prof,
        "batches_received_in_windows": len(sealed),
        "generation_seconds_in_windows": [round(r["generation_seconds"], 3) for r in sealed],
        "batch_intervals_in_windows_s": [round(g, 3) for g in gaps],
        "env_counts_at_end": {k: env_counts.get(k) for k in ("trajectories", "turns", "forks", "env_errors",
                                                             "trajectory_retries", "groups_dropped", "last_error")},
    }


def _run_config(tmp: Path, redis_url: str, standin: Any, tokenizer: Path, cfg: dict[str, Any],
                repeats: int) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    pythonpath = [str(REPO)]
    if cfg["path"] == "verifiers":
        settings["vf_tokenizer"] = str(tokenizer)  # the stand-in's byte tokens, the tiny model's chat template
        pythonpath.insert(0, str(PLUGINS))  # verifiers imports the test tasksets by id
    load = round(os.getloadavg()[0], 2)
    t0 = time.perf_counter()
    with sampler_process(tmp / f"run-{cfg['label']}-{uuid.uuid4().hex[:6]}", redis_url=redis_url,
                         namespace="v" + uuid.uuid4().hex[:10], inference_urls=[standin.url], max_staleness=2,
                         max_concurrency=MAX_CONCURRENCY, keep_batches=4, env=cfg["env"], drain_deadline=0,
                         env_args=json.dumps(cfg["env_args"]), max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=0,
                         process_env={"PYTHONPATH": os.pathsep.join(pythonpath)}, **SHAPE, **settings) as sampler:
        ready_s = time.perf_counter() - t0
        out = asyncio.run(_measure(sampler, standin, tmp, cfg, repeats))
    return {"label": cfg["label"], "path": cfg["path"], "env": cfg["env"], "env_args": cfg["env_args"],
            "turns": cfg["turns"], "what": cfg["what"], "window_s": cfg["window_s"],
            "sampler_ready_s": round(ready_s, 2), "loadavg_1m_before": load, **out}


_KEYS = ("trajectories_per_s", "turns_per_s", "seconds_per_batch", "sampler_cpu_us_per_trajectory",
         "sampler_cpu_us_per_turn", "sampler_cores_busy", "main_thread_share", "standin_cpu_us_per_turn",
         "system_share", "machine_busy", "tokens_per_turn", "inference_requests_per_trajectory", "children_cpu_s", "env_errors")


def _mmm(values: list[float]) -> dict[str, float]:
    return {"median": round(median(values), 3), "min": min(values), "max": max(values)}


def _summary(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    return {label: {k: _mmm([w[k] for w in r["windows"]]) for k in _KEYS} for label, r in runs.items()}


def run(results_dir: Path, *, labels: list[str] | None = None, repeats: int = REPEATS) -> dict:
    """Every config, or those in `labels` for a quick look (then nothing is derived or written)."""
    configs = [c for c in CONFIGS if labels is None or c["label"] in labels]
    started = time.perf_counter()
    load_at_start = round(os.getloadavg()[0], 2)
    code_at_start = _code_state()
    before = verifiers_compare.previous(results_dir) if labels is None else None  # the results this run replaces
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-verifiers-") as tmp_name:
        tmp = Path(tmp_name)
        from tests.support.byte_tokenizer import save_byte_tokenizer

        tokenizer = save_byte_tokenizer(tmp / "byte-tokenizer")
        with redis_server(tmp) as redis_url, standin_process(tmp, 0.0) as standin:
            for cfg in configs:
                print(f"   {cfg['label']} ...", flush=True)
                runs[cfg["label"]] = _run_config(tmp, redis_url, standin, tokenizer, cfg, repeats)
    summary = _summary(runs)
    if labels is not None:
        return {"runs": runs, "summary": summary}
    total_s = time.perf_counter() - started
    code_at_end = _code_state()

    def med(label: str, key: str = "sampler_cpu_us_per_trajectory") -> float:
        return summary[label][key]["median"]

    def ratio(a: str, b: str, key: str = "sampler_cpu_us_per_trajectory") -> float:
        return round(med(a, key) / med(b, key), 1)

    def pairs(one: str, three: str) -> tuple[dict[str, float], dict[str, float]]:
        """One more turn = (CPU per trajectory at 3 turns - at 1 turn) / 2 over every pair of
        windows, and what does not grow with the turns = 1 turn's CPU - one more turn."""
        extra, fixed = [], []
        for w1 in runs[one]["windows"]:
            for w3 in runs[three]["windows"]:
                b = (w3["sampler_cpu_us_per_trajectory"] - w1["sampler_cpu_us_per_trajectory"]) / 2
                extra.append(round(b, 1))
                fixed.append(round(w1["sampler_cpu_us_per_trajectory"] - b, 1))
        return _mmm(extra), _mmm(fixed)

    extra_vf, fixed_vf = pairs("vf_dialogue1", "vf_dialogue3")
    extra_native, fixed_native = pairs("native_echo1", "native_echo3")
    derived = {
        "cpu_per_trajectory_ratio": {
            "vf_parity_over_native_toy": ratio("vf_parity", "native_toy"),
            "vf_parity_over_native_echo1": ratio("vf_parity", "native_echo1"),
            "vf_dialogue1_over_native_echo1": ratio("vf_dialogue1", "native_echo1"),
            "vf_dialogue3_over_native_echo3": ratio("vf_dialogue3", "native_echo3"),
        },
        "trajectories_per_s_ratio_native_over_vf": {
            "toy_over_vf_parity": ratio("native_toy", "vf_parity", "trajectories_per_s"),
            "echo1_over_vf_parity": ratio("native_echo1", "vf_parity", "trajectories_per_s"),
            "echo3_over_vf_dialogue3": ratio("native_echo3", "vf_dialogue3", "trajectories_per_s"),
        },
        # Over every pair of windows (1 turn, 3 turns) of the same env: median (min-max).
        "extra_turn_us": {"verifiers_dialogue": extra_vf, "native_echo": extra_native,
                          "ratio_of_medians": round(extra_vf["median"] / extra_native["median"], 1)
                          if extra_native["median"] > 0 else None},
        "per_trajectory_fixed_us": {"verifiers_dialogue": fixed_vf, "native_echo": fixed_native},
    }
    result = {
        "benchmark": "verifiers",
        "setup": {
            "batch": f"{SHAPE['prompts_per_step']} prompts x {SHAPE['num_generations']} generations = "
                     f"{TRAJECTORIES_PER_BATCH} trajectories",
            "max_tokens": MAX_TOKENS, "temperature": TEMPERATURE, "max_staleness": 2, "max_concurrency": MAX_CONCURRENCY,
            "inference": "stand-in (services/inference/standin.py), token_latency 0, one process for every config",
            "trainer": "GET /batch (msgpack arrays) -> POST /weights_version at once (T = 0)",
            "windows_per_config": repeats, "pyspy_rate_hz": PYSPY_RATE,
            "configs": [{k: c[k] for k in ("label", "path", "env", "env_args", "turns", "window_s", "what")}
                        for c in configs],
        },
        "runs": runs,
        "summary": summary,
        "derived": derived,
        "bench_seconds": round(total_s, 1),
        "host": {**host(), "loadavg_1m_at_start": load_at_start},
        "code": {**code_at_start, "changed_during_run": {k: v for k, v in code_at_end.items() if k != "head"}
                 != {k: v for k, v in code_at_start.items() if k != "head"}},
        "command": COMMAND,
        "previous": before,
    }
    write_results(results_dir, "verifiers", result, _markdown(result))
    return result


def _markdown(r: dict[str, Any]) -> str:
    s, d, setup = r["summary"], r["derived"], r["setup"]

    mmm = _median_range
    lines = [
        "# verifiers environments vs the native paths: sampler cost per trajectory and per turn",
        "",
        *_run_header(r, r["bench_seconds"]),
        "",
        f"Batch {setup['batch']}, max_tokens {setup['max_tokens']}, temperature {setup['temperature']:g} (every turn "
        f"exactly {setup['max_tokens']} tokens), {setup['inference']}, trainer stand-in with T = 0, max_staleness "
        f"{setup['max_staleness']}, max_concurrency {setup['max_concurrency']}. Each config is one sampler process; "
        f"after its warm-up, {setup['windows_per_config']} consecutive windows (1.5 s native, 6 s verifiers: each ends when the sampler answers /status, later when its loop is busy); median "
        "(min-max) over the windows. CPU is the sampler process's, every thread: for verifiers that includes the "
        "harness, verifiers' interception server and episode machinery, the TrainClient and its renderer threads, "
        "and the generate route. Counts are the sampler's own over the same window; trajectories = model turns / "
        "turns; seconds per batch = 128 trajectories at the window's rate; machine busy = the share of the machine's "
        "CPUs busy in the window, every process (the bench's and other work's: CPU seconds per trajectory rose by "
        "up to ~1.5x between runs as that changed, so compare configs within a run).",
        "",
        "| config | turns | trajectories/s | s per batch | sampler CPU us/trajectory | sampler CPU us/turn | "
        "sampler cores busy | main thread share | system share | inference requests/trajectory | "
        "stand-in CPU us/turn | machine busy | sampler ready s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in setup["configs"]:
        x, run = s[c["label"]], r["runs"][c["label"]]
        lines.append(f"| {c['label']} | {c['turns']} | {mmm(x['trajectories_per_s'])} | {mmm(x['seconds_per_batch'])} | "
                     f"{mmm(x['sampler_cpu_us_per_trajectory'])} | {mmm(x['sampler_cpu_us_per_turn'])} | "
                     f"{x['sampler_cores_busy']['median']:g} | {x['main_thread_share']['median']:.0%} | "
                     f"{x['system_share']['median']:.0%} | "
                     f"{x['inference_requests_per_trajectory']['median']:g} | {x['standin_cpu_us_per_turn']['median']:g} | "
                     f"{x['machine_busy']['median']:.0%} | {run['sampler_ready_s']:g} |")
    lines += ["", "Configs:", ""]
    lines += [f"* `{c['label']}`: {c['what']} (`--env {c['env']}`, env_args `{json.dumps(c['env_args'])}`)."
              for c in setup["configs"]]
    ratios, tps, ex = d["cpu_per_trajectory_ratio"], d["trajectories_per_s_ratio_native_over_vf"], d["extra_turn_us"]
    lines += [
        "",
        "## What it means",
        "",
        f"* **verifiers' path costs the sampler {ratios['vf_parity_over_native_echo1']:g}x the CPU per trajectory of "
        f"the native multi-turn path for one turn** (vf_parity vs native_echo1; "
        f"{ratios['vf_dialogue1_over_native_echo1']:g}x for vf_dialogue1), {ratios['vf_parity_over_native_toy']:g}x "
        "that of the native single-turn path (toy: one request with n = 16 per group), and "
        f"**{ratios['vf_dialogue3_over_native_echo3']:g}x for a 3-turn conversation** (vf_dialogue3 vs native_echo3). "
        f"With generation free, the native paths make {tps['echo1_over_vf_parity']:g}x (echo1), "
        f"{tps['toy_over_vf_parity']:g}x (toy) the trajectories per second of vf_parity, and "
        f"{tps['echo3_over_vf_dialogue3']:g}x (echo3) those of vf_dialogue3. The sampler had "
        f"{min(x['sampler_cores_busy']['median'] for x in s.values()):g}-"
        f"{max(x['sampler_cores_busy']['median'] for x in s.values()):g} of a core (2 cores shared with the stand-in, "
        "the bench's trainer and other work), so the rates depend on the machine's load; the CPU per trajectory is "
        "the figure to compare.",
        f"* One more model turn (CPU per trajectory at 3 turns minus at 1, / 2, same env, over every pair of windows): "
        f"**verifiers {mmm(ex['verifiers_dialogue'])} us, native {mmm(ex['native_echo'])} us**"
        + (f" ({ex['ratio_of_medians']:g}x the medians; a difference of noisy windows, hence the wide ranges)."
           if ex["ratio_of_medians"] else "."),
        "* Against the time a model takes, this matters only where generation is cheap: at "
        f"{_med_text(s, 'vf_dialogue3')} per 3-turn trajectory, one core serves about "
        f"{1e6 / s['vf_dialogue3']['sampler_cpu_us_per_trajectory']['median']:.0f} verifiers trajectories a second "
        "(a 128-trajectory batch of 3 turns every "
        f"{s['vf_dialogue3']['sampler_cpu_us_per_trajectory']['median'] * 128 / 1e6:.2f} s of sampler CPU).",
    ]
    lines += verifiers_compare.markdown(r)
    lines += _where(r)
    for c in setup["configs"]:
        prof = r["runs"][c["label"]]["profile"]
        if prof is None:
            continue
        lines += ["", f"### Where the sampler's CPU goes: {c['label']} (py-spy)", ""]
        if "skipped" in prof:
            lines.append(f"Skipped: {prof['skipped']}.")
            continue
        main, workers = prof["main"], prof["workers"]
        lines += [f"One more {prof['window_s']} s window of the same process under py-spy at {setup['pyspy_rate_hz']} Hz "
                  "(default mode with --native and --threads: the process is paused for each sample, so stacks are "
                  "consistent, and the garbage collector shows; not in the table above: py-spy slows what it samples, "
                  f"{prof['sampler_cpu_us_per_turn_while_profiled']:g} us/turn while profiled). The main thread (the "
                  f"event loop) ran {prof['main_thread_share']:.0%} of the sampler's CPU in that window; its "
                  f"{main['samples']} busy samples go to the first of these parts its stack holds:", "",
                  "| share of the main thread | where |", "|---|---|"]
        lines += [f"| {v:.1%} | {k} |" for k, v in main["shares"].items()]
        lines += ["", "Top Python leaf frames of the main thread outside the collector: "
                  + "; ".join(f"`{k}` {v:.1%}" for k, v in main["top_python_leaf_frames_outside_gc"].items()) + ".",
                  "", f"Worker threads ({workers['samples']} busy samples; a thread blocked in a system call counts as "
                  "busy, so these are not CPU shares): "
                  + "; ".join(f"{v:.0%} {k}" for k, v in workers["shares"].items()) + "."]
    lines += ["", "## Batches", "",
              "generation_seconds (generation start to sealed; up to 3 batches overlap at max_staleness 2) of the "
              "batches received during the windows, and the intervals between their receipts (the trainer "
              "stand-in takes each at once):", "",
              "| config | batches | generation_seconds | interval s | warm-up s (batches received by its end) |", "|---|---|---|---|---|"]
    for c in setup["configs"]:
        run = r["runs"][c["label"]]
        gens = run["generation_seconds_in_windows"]
        gen = f"median {median(gens):g} ({min(gens):g}-{max(gens):g})" if gens else "none sealed in the windows"
        gaps = run["batch_intervals_in_windows_s"]
        gap = f"median {median(gaps):g} ({min(gaps):g}-{max(gaps):g})" if gaps else "-"
        lines.append(f"| {c['label']} | {run['batches_received_in_windows']} | {gen} | {gap} | "
                     f"{run['warmup_s']} ({run['warmup_batches']}) |")
    return "\n".join(lines)


def _where(r: dict[str, Any]) -> list[str]:
    """Where a verifiers turn goes, grouped from vf_dialogue3's profile (main thread)."""
    prof = r["runs"]["vf_dialogue3"]["profile"]
    native = r["runs"]["native_echo3"]["profile"]
    if not prof or "skipped" in prof:
        return []
    shares = prof["main"]["shares"]

    def share(*prefixes: str, of: dict[str, float] = shares) -> float:
        return sum(v for k, v in of.items() if k.startswith(prefixes))

    http = share("harness:", "TrainClient -> ", "the sampler's HTTP server stack", "interception server:",
                 "aiohttp callbacks", "httpx/httpcore/anyio", "httpcore pool scan", "inference pool requests",
                 "event loop")
    gc_native = share("garbage collection", of=native["main"]["shares"]) if native and "main" in native else None
    workers = 1 - r["summary"]["vf_dialogue3"]["main_thread_share"]["median"]
    server = share("the sampler's HTTP server")
    in_process = share("TrainClient -> the sampler's generate code in-process")
    return [
        "",
        "Where a verifiers turn's CPU goes (vf_dialogue3, py-spy on the main thread, below):",
        "",
        f"* **The calls between the parts of the sampler: {http:.0%}** of the main thread: the harness's calls to "
        f"the interception server ({share('harness: its calls'):.0%}; in-process with vf_client = in_process, "
        "vf/local_interception.py)"
        + (f" and the httpx clients it builds ({share('harness: building httpx clients'):.0%}: an SSL context "
           "each, and new TCP connections; verifiers builds a harness object per episode and relaunches it for "
           "every user turn, so a client cached on the harness lives one episode)"
           if share("harness: building httpx clients") >= 0.01 else "")
        + "; the TrainClient's call of the sampler's own "
        f"/inference/v1/generate ({share('TrainClient -> '):.0%}: renderers' client and, over HTTP, the openai SDK, "
        f"plus {share('httpcore pool scan'):.0%} in httpcore's pool scan; in-process, vf/local_client.py: "
        f"{in_process:.0%} of it); "
        f"the sampler's HTTP server stack ({server:.0%}); "
        f"the interception server's handler ({share('interception server:'):.0%}) and aiohttp's callbacks "
        f"({share('aiohttp callbacks'):.0%}: with every call in-process, the pool's connections to the stand-in); "
        f"the pool's request to the stand-in ({share('inference pool'):.0%}), the only hop a native turn has; "
        f"the event loop ({share('event loop'):.0%}).",
        f"* **verifiers' trace graph: {share('pydantic model_construct'):.0%}** in pydantic's "
        "`FieldInfo.get_default`, which calls `inspect.signature` on a default_factory at every "
        "`model_construct` (PendingTurn.commit -> graph._commit_turn; answered once per builtin factory since "
        "services/sampler/rollouts/vf/pydantic_defaults.py); "
        f"the rest of verifiers' episode machinery {share('verifiers episode'):.0%}, the subprocess runtime's "
        f"scratch directory per rollout {share('verifiers subprocess runtime'):.0%} (its mkdir on the event loop, "
        "its rmtree in worker threads, below: what they cost depends on the filesystem and how busy it is; on this "
        "machine's ext4 a mkdir took from 30 us to 1 ms of CPU as other work's disk traffic changed).",
        f"* **Garbage collection: {share('garbage collection'):.0%}**"
        + (f" (native_echo3: {gc_native:.0%})" if gc_native is not None else "")
        + ": not verifiers' own; the collector runs more often the more objects a turn allocates (once an "
        "environment's first episode has ended, what it loaded is frozen and generation 0 waits for 50,000 "
        "allocations: services/sampler/observability/gc_tuning.py).",
        f"* Worker threads: {workers:.0%} of the sampler's CPU (the TrainClient's rendering, "
        "services/sampler/rollouts/vf/renderer.py with the tokenizer, and verifiers' subprocess runtime removing each "
        "rollout's scratch directory).",
    ]


def _med_text(s: dict[str, Any], label: str) -> str:
    return f"{s[label]['sampler_cpu_us_per_trajectory']['median'] / 1e3:.1f} ms"
