"""Helpers shared by the sampler benchmarks: processes on loopback ports, CPU accounting,
a protocol-level trainer stand-in, result files.

Every server a benchmark starts is a real process (Redis, the vLLM-protocol stand-in, the
sampler), so the sampler's CPU time can be read from /proc and no two services share a GIL.

Every stack is closed as a real run is (docs/operations.md, Security): `RUN_TOKEN`, made fresh
for each benchmark process (secrets.token_urlsafe), goes to the stand-in, the inference servers
and the sampler in their environment (TANDEM_API_TOKEN, never on a command line), and every
read and write sends it (`AUTH`, `token_env()`, `trainer_loop`, `SamplerClient(api_token=RUN_TOKEN)`).
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from shared.token_guard import TOKEN_ENV, bearer_headers
from tests.support.servers import ServiceProcess, free_port, start_redis, start_sampler_process

REPO = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")

# The token of every stack this benchmark process starts, and the header that carries it.
RUN_TOKEN = secrets.token_urlsafe(16)
AUTH = bearer_headers(RUN_TOKEN)


def token_env(api_token: str | None = RUN_TOKEN) -> dict[str, str]:
    """The environment that hands a server (`tandem sampler`, `tandem inference`, the stand-in)
    the run's token; {} for an open one."""
    return {TOKEN_ENV: api_token} if api_token else {}


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of one process (from /proc/PID/stat), threads included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # After the command name: state is fields[0]; utime, stime are stat fields 14, 15.
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def host() -> dict[str, Any]:
    load = os.getloadavg()
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine(),
            "loadavg_1m_at_end": round(load[0], 2)}


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; the value itself for one sample."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: list[float]) -> float:
    return statistics.median(values)


@contextmanager
def redis_server(tmp: Path, appendfsync: str = "everysec") -> Iterator[str]:
    proc, url = start_redis(tmp / f"redis-{appendfsync}", appendfsync=appendfsync)
    try:
        yield url
    finally:
        proc.terminate()


@contextmanager
def standin_process(tmp: Path, token_latency: float, api_token: str | None = RUN_TOKEN) -> Iterator[ServiceProcess]:
    """The stand-in as its own process, closed with `api_token` (all but /health)."""
    port = free_port()
    proc = ServiceProcess(
        [sys.executable, "-m", "services.inference.standin", "--port", str(port),
         "--token-latency", repr(token_latency)],
        name="standin", log_path=tmp / f"standin-{port}.log", ready_url=f"http://127.0.0.1:{port}/health",
        env=token_env(api_token),
    )
    proc.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    try:
        yield proc.wait_ready(60)
    finally:
        proc.terminate()


@contextmanager
def sampler_process(run_dir: Path, *, api_token: str | None = RUN_TOKEN, process_env: dict[str, str] | None = None,
                    **settings: Any) -> Iterator[ServiceProcess]:
    """The sampler as its own process, closed with `api_token` (every route but /health and
    /metrics), which it also sends to its inference servers. With BENCH_PYSPY=<file.svg|file.txt> set, py-spy
    samples it for its whole life (flame graph, or collapsed stacks for .txt); with
    BENCH_PYSPY_GIL=1 too, only the thread holding the GIL is sampled (a thread waiting for
    the GIL otherwise counts as busy, which overstates the rollout log's worker thread)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = start_sampler_process(run_dir, log_level="warning", process_env={**(process_env or {}), **token_env(api_token)},
                                 **settings)
    spy = _start_pyspy(proc.pid)
    try:
        yield proc
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            try:
                spy.wait(60)
            except subprocess.TimeoutExpired:
                spy.kill()
        proc.terminate()


def _start_pyspy(pid: int) -> subprocess.Popen | None:
    out = os.environ.get("BENCH_PYSPY")
    if not out:
        return None
    exe = Path(sys.executable).with_name("py-spy")
    fmt = "raw" if out.endswith(".txt") else "flamegraph"
    # Each sampler gets its own file: <out stem>-<pid><suffix>.
    path = Path(out).with_name(f"{Path(out).stem}-{pid}{Path(out).suffix}")
    gil = ["--gil"] if os.environ.get("BENCH_PYSPY_GIL") else []
    return subprocess.Popen([str(exe), "record", "--pid", str(pid), "--rate", "200", "--format", fmt,
                             "--output", str(path), "--nonblocking", *gil],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def trainer_loop(url: str, steps: int, train_seconds: float, *, accept: str | None = None,
                       deadline_s: float = 600.0, on_step: Any = None,
                       api_token: str | None = RUN_TOKEN) -> list[dict[str, Any]]:
    """A trainer stand-in over the real protocol: GET /batch?step=N (long-poll through 204s),
    sleep `train_seconds`, POST /weights_version {version: N+1}, each with the run's token.
    Returns one record per step: the time the batch arrived, its stats and sample count."""
    import asyncio

    from shared import codec

    from shared.chunks import FRAMES, decode_frame, is_frames

    records: list[dict[str, Any]] = []
    # By default FRAMES, the stored chunks as they are, as SamplerClient asks; another form
    # (codec.ARRAYS, msgpack, JSON) is transcoded by the sampler, which costs it CPU.
    headers = {"Accept": accept or FRAMES}
    give_up = time.monotonic() + deadline_s
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(30.0, read=60.0),
                                 headers=bearer_headers(api_token)) as http:
        for step in range(steps):
            asked = time.perf_counter()
            while True:
                if time.monotonic() > give_up:
                    raise TimeoutError(f"trainer stand-in: batch {step} not received within the {deadline_s:.0f}s budget")
                response = await http.get("/batch", params={"step": step, "timeout": 10}, headers=headers)
                if response.status_code == 200:
                    break
                if response.status_code != 204:
                    raise RuntimeError(f"GET /batch step={step}: HTTP {response.status_code}: {response.text[:300]}")
            content_type = response.headers.get("content-type") or ""
            if is_frames(content_type):
                arrays = decode_frame(response.content)
                stats, samples = arrays.stats, arrays.num_samples
            else:
                batch = codec.decode(content_type, response.content)
                stats, samples = batch["stats"], len(batch["samples"])
            got = time.perf_counter()
            records.append({"step": step, "asked": asked, "got": got, "wall": time.time(),
                            "stats": stats, "samples": samples, "bytes": len(response.content)})
            if on_step is not None:
                await on_step(step)
            if train_seconds:
                await asyncio.sleep(train_seconds)
            posted = time.perf_counter()
            published = await http.post("/weights_version", json={"version": step + 1, "checkpoint_path": None})
            records[-1]["post_s"] = time.perf_counter() - posted
            if published.status_code != 200:
                raise RuntimeError(f"POST /weights_version {step + 1}: HTTP {published.status_code}: {published.text[:300]}")
    return records


def write_results(results_dir: Path, name: str, result: dict[str, Any], markdown: str) -> None:
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (results_dir / f"{name}.md").write_text(markdown.rstrip() + "\n")

