"""Generated tokens/s of the CPU inference server (tiny preset) under concurrency, over real HTTP.

The server runs as its own process (`tandem inference`), as in a deployment, so the client's
event loop does not share a GIL with the engine. Every level sends the same workload
(`REQUESTS` completions of `MAX_TOKENS` tokens, `ignore_eos`, temperature 1) from
`c` concurrent clients; c = 1 is the one-request-at-a-time baseline. Target: at c = 64
batching gives >= 4x the baseline's tokens/s. The server is closed with the run's token
(bench/_common.RUN_TOKEN, in its environment), which every request sends.

Writes bench/results/inference.json and inference.md; `python -m bench inference`.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench._common import AUTH, token_env

LEVELS = (1, 8, 64)
REQUESTS = 64
MAX_TOKENS = 64
PROMPT = "Q: What is 17 + 25? Think step by step.\nA:"
STARTUP_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"inference server exited with code {proc.returncode} before {url}/health answered")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"inference server did not answer {url}/health within {STARTUP_TIMEOUT_S:.0f} s")


async def _level(url: str, concurrency: int) -> dict:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(REQUESTS):
        queue.put_nowait(i)
    latencies: list[float] = []
    tokens = 0
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 1.0,
            "return_token_ids": True}

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            t0 = time.perf_counter()
            r = await client.post("/v1/completions", json={**body, "seed": i})
            r.raise_for_status()
            latencies.append(time.perf_counter() - t0)
            tokens += len(r.json()["choices"][0]["token_ids"])

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits, headers=AUTH) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
        metrics = (await client.get("/metrics")).raise_for_status().text
    peak = re.search(r"^tandem_inference_peak_batch_size\{[^}]*\} ([0-9.e+]+)$", metrics, re.MULTILINE)
    return {
        "concurrency": concurrency,
        "requests": REQUESTS,
        "generated_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "latency_p50_s": round(statistics.median(latencies), 4),
        "latency_max_s": round(max(latencies), 4),
        "peak_batch_size_so_far": int(float(peak.group(1))) if peak else None,
    }


def run(results_dir: Path) -> dict:
    from services.inference.init_model import init_model

    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-inference-") as tmp:
        model = init_model(Path(tmp) / "tiny", preset="tiny", seed=0)
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "services.cli", "inference", "--model", str(model),
               "--port", str(port), "--log-level", "warning"]
        proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parent.parent, env={**os.environ, **token_env()})
        try:
            _wait_healthy(url, proc)
            # Warm-up: first-call allocations and lazy imports are not throughput.
            asyncio.run(_level_warmup(url))
            levels = [asyncio.run(_level(url, c)) for c in LEVELS]
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    base = levels[0]["tokens_per_s"]
    for lv in levels:
        lv["speedup_vs_one_at_a_time"] = round(lv["tokens_per_s"] / base, 2)
    result = {
        "benchmark": "inference",
        "model": "tiny preset (Llama, hidden 64, 2 layers, char vocab 101)",
        "workload": {"requests_per_level": REQUESTS, "max_tokens": MAX_TOKENS, "prompt_chars": len(PROMPT),
                     "ignore_eos": True, "temperature": 1.0},
        "one_at_a_time_tokens_per_s": base,
        "levels": levels,
        "speedup_at_64": levels[-1]["speedup_vs_one_at_a_time"],
        "target_speedup_at_64": 4.0,
        "meets_target": levels[-1]["speedup_vs_one_at_a_time"] >= 4.0,
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()},
        "command": "make bench ARGS=inference  (or .venv/bin/python -m bench inference)",
    }
    (results_dir / "inference.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = "\n".join(
        f"| {lv['concurrency']} | {lv['generated_tokens']} | {lv['wall_s']} | {lv['tokens_per_s']} | "
        f"{lv['speedup_vs_one_at_a_time']}x | {lv['latency_p50_s']} |" for lv in levels
    )
    (results_dir / "inference.md").write_text(
        "# CPU inference server throughput\n\n"
        f"{REQUESTS} completions x {MAX_TOKENS} tokens per level over HTTP, tiny preset, "
        f"{os.cpu_count()} CPUs. Concurrency 1 is the one-request-at-a-time baseline.\n\n"
        "| concurrent requests | tokens | wall s | tokens/s | vs one-at-a-time | p50 latency s |\n"
        "|---|---|---|---|---|---|\n" + rows + "\n\n"
        f"Target >= 4x at 64 concurrent: {'met' if result['meets_target'] else 'NOT met'} "
        f"({result['speedup_at_64']}x).\n\n`{result['command']}`\n"
    )
    return result


async def _level_warmup(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=AUTH) as client:
        for r in await asyncio.gather(*(client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8})
                                        for _ in range(8))):
            r.raise_for_status()
