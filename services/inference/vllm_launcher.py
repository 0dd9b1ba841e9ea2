"""`tandem inference --backend vllm`: run `vllm serve` with the flags Tandem relies on.

`build_command(settings)` returns the argv and environment; `run(settings)` starts it as a
child process, waits for its `/health` (up to `startup_timeout` seconds, then says what it
waited for), sets the initial weight-version label from `weight_version` (vLLM starts at
"default"), forwards SIGINT/SIGTERM to the child and exits with its exit code.

Flags (DESIGN section 5, tested against vLLM 0.33.0):
  env VLLM_SERVER_DEV_MODE=1           enables /pause, /resume, /is_paused, /collective_rpc,
                                       /update_weight_version, /weight_info, /reset_prefix_cache
  --logprobs-mode processed_logprobs   logprobs after temperature / top-k / top-p, i.e. of the
                                       distribution actually sampled from (the trainer's
                                       behaviour-policy logprobs)
  --generation-config vllm             ignore the model's generation_config.json defaults, so
                                       sampling is exactly what the request says
  --tensor-parallel-size, --data-parallel-size, --gpu-memory-utilization, --max-model-len,
  --max-num-seqs, --dtype, --seed, --served-model-name, --host, --port, then `extra_args`.

vllm is never imported here (it is the `gpu` extra); the child process imports it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from services.inference.config import InferenceSettings


def build_command(settings: InferenceSettings) -> tuple[list[str], dict[str, str]]:
    exe = shutil.which("vllm")
    argv = [exe] if exe else [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    argv += [
        "serve", str(settings.model),
        "--host", settings.host,
        "--port", str(settings.port),
        "--served-model-name", settings.model_id,
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",
        "--tensor-parallel-size", str(settings.tensor_parallel_size),
        "--data-parallel-size", str(settings.data_parallel_size),
        "--gpu-memory-utilization", str(settings.gpu_memory_utilization),
        "--max-num-seqs", str(settings.max_num_seqs),
        "--dtype", settings.dtype,
        "--seed", str(settings.seed),
    ]
    if settings.max_model_len:
        argv += ["--max-model-len", str(settings.max_model_len)]
    argv += shlex.split(settings.extra_args)
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    return argv, env


def _local_url(settings: InferenceSettings) -> str:
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    return f"http://{host}:{settings.port}"


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _set_version(url: str, version: str) -> None:
    body = json.dumps({"new_version": version}).encode()
    req = urllib.request.Request(url + "/update_weight_version", data=body,
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()


def run(settings: InferenceSettings) -> int:
    if importlib.util.find_spec("vllm") is None:
        print("tandem inference --backend vllm: vllm is not installed; install the GPU extra "
              "(pip install -e '.[gpu]', vllm==0.33.0) or use --backend cpu", file=sys.stderr)
        return 2
    argv, env = build_command(settings)
    print("starting: VLLM_SERVER_DEV_MODE=1 " + shlex.join(argv), file=sys.stderr, flush=True)
    child = subprocess.Popen(argv, env=env)

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)

    url = _local_url(settings)
    deadline = time.monotonic() + settings.startup_timeout
    while not _healthy(url):
        if child.poll() is not None:
            print(f"vllm serve exited with code {child.returncode} before {url}/health answered",
                  file=sys.stderr)
            return child.returncode
        if time.monotonic() > deadline:
            print(f"vllm serve did not answer GET {url}/health within {settings.startup_timeout:.0f} s "
                  "(--startup-timeout); stopping it", file=sys.stderr)
            child.terminate()
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
            return 1
        time.sleep(1.0)
    try:
        _set_version(url, settings.weight_version)
    except (urllib.error.URLError, OSError) as exc:
        print(f"warning: could not set the initial weight version on {url}: {exc}", file=sys.stderr)
    print(f"vllm serve is healthy at {url} (weight version {settings.weight_version!r})", file=sys.stderr, flush=True)
    return child.wait()
