"""What one weight sync costs per trainer step, full fine-tuning against LoRA: the bytes the
trainer publishes, the seconds it takes to write them, and the seconds an inference server
takes to load them (docs/lora.md, "What a sync costs").

For each model (the `tiny` preset the demo trains, and a locally built Llama of ~0.5 B
parameters; no hub), built here with random weights:

* **full**: the trainer's `publish_weights` (services/trainer/checkpoint.py) writes the whole
  model in `dtype`, and Tandem's CPU inference server reloads it in place with the sync the
  sampler runs (pause, `/collective_rpc` reload, label, prefix-cache reset, resume);
* **lora**: a rank-R adapter on the attention and MLP projections (services/trainer/lora.py,
  the trainer's own `LoraRun.publish`) is written, and the same server loads it with
  `/v1/load_lora_adapter` (in place) in the same sync.

Then the server's prompt logprobs are asked once (the probe the sampler sends), so a load that
did not take effect would show. The trainer's other per-step work (the probe's forward, the
POST) is the same for both and not counted. The server is closed with the run's token
(bench/_common.RUN_TOKEN), which the sync and the probe send, as the sampler's client does.

    .venv/bin/python -m bench publication
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench._common import AUTH, host, token_env, write_results
from services.inference.vllm_ext import RELOAD_METHOD
from shared.adapters import DEFAULT_ADAPTER_NAME, LOAD_PATH, load_request
from shared.http_client import HttpClient
from shared.probe import probe_request
from tests.support.servers import ServiceProcess, free_port

# name -> the LlamaConfig fields that differ from the tiny preset's builder; None = the preset.
MODELS: dict[str, dict[str, Any] | None] = {
    "tiny": None,
    # ~0.47 B parameters: 24 layers of hidden 1024 / MLP 4096, a 32 k vocabulary, untied head.
    "0.5b": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
             "num_key_value_heads": 16, "head_dim": 64, "vocab_size": 32000, "tie_word_embeddings": False},
}


def _build(name: str, out: Path, extra: dict[str, Any] | None = None, *, tokenizer_vocab: bool = False) -> Path:
    """The model `name` written as a Hugging Face directory (float32), with the tiny tokenizer;
    `extra` config values on top of `name`'s, `tokenizer_vocab`: the vocabulary the tokenizer's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.inference.init_model import init_model

    init_model(out, preset="tiny", seed=0)
    overrides = MODELS[name]
    if overrides is None:
        return out
    overrides = {**overrides, **(extra or {})}
    if tokenizer_vocab:
        overrides["vocab_size"] = len(AutoTokenizer.from_pretrained(str(out)))
    config = AutoModelForCausalLM.from_pretrained(str(out)).config
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def _sync(url: str, load: tuple[str, dict[str, Any]], version: int, probe_ids: list[int] | None = None,
          inline: bool = False) -> float:
    """The sampler's sync steps against one server, through the sampler's own HTTP client,
    timed from pause to resume (what vLLM gets, and a LoRA adapter on any server); a `load` of
    RELOAD_METHOD is sent alone with the label, the one request the sampler now sends Tandem's
    CPU server for full weights (services/sampler/fleet/weight_sync.py), with the probe's
    `probe_ids` in it (`inline`) or, as before, asked for apart afterwards."""
    path, body = load
    if body.get("method") == RELOAD_METHOD:
        kwargs = {**body["kwargs"], "weight_version": str(version)}
        if probe_ids is not None and inline:
            kwargs["probe_token_ids"] = probe_ids
        steps: tuple = (("POST", path, {"json": {**body, "kwargs": kwargs}}),)
        if probe_ids is not None and not inline:
            steps += (("POST", "/v1/completions", {"json": probe_request(probe_ids)}),)
    else:
        steps = (("POST", "/pause", {"params": {"mode": "keep"}}), ("POST", path, {"json": body}),
                 ("POST", "/update_weight_version", {"json": {"new_version": str(version)}}),
                 ("POST", "/reset_prefix_cache", {}), ("POST", "/resume", {}))

    async def sync() -> float:
        http = HttpClient(max_connections=4, timeout=600, headers=AUTH)
        try:
            await http.request("GET", url + "/health")  # a warm connection, as the sampler's is
            t0 = time.perf_counter()
            for method, where, kwargs in steps:
                answer = await http.request(method, url + where, **kwargs)
                if answer.status_code >= 400:
                    raise RuntimeError(f"{where}: {answer.status_code} {answer.text[:300]}")
            return time.perf_counter() - t0
        finally:
            await http.aclose()

    return asyncio.run(sync())


def _measure(name: str, root: Path, *, rank: int, dtype_name: str, repeats: int) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM

    from services.trainer import checkpoint as ckpt
    from services.trainer.lora import DEFAULT_TARGET_MODULES, LoraSpec, attach

    dtype = getattr(torch, dtype_name)
    base = _build(name, root / f"{name}-base")
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    full_state = {k: v.detach() for k, v in model.state_dict().items()}
    ids = list(range(5, 37))
    rows = []
    # Its own process, as in a run (`tandem inference`), not a thread of this one.
    port = free_port()
    server = ServiceProcess([sys.executable, "-m", "services.cli", "inference", "--model", str(base),
                             "--port", str(port), "--served-model-name", name, "--enable-lora",
                             "--max-lora-rank", str(max(rank, 16)), "--log-level", "warning"],
                            name="inference", log_path=root / f"{name}-inference.log",
                            ready_url=f"http://127.0.0.1:{port}/health", env=token_env())
    try:
        server.wait_ready(600)
        server_url = f"http://127.0.0.1:{port}"
        with httpx.Client(headers=AUTH) as http:
            # -- full weights
            write_s, load_s, swap_s, apart_s, inline_s = [], [], [], [], []
            for i in range(repeats):
                t0 = time.perf_counter()
                path = ckpt.publish_weights(root / f"{name}-full", i + 1, full_state, model.config, dtype=dtype, step=i)
                write_s.append(time.perf_counter() - t0)
                reload = ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
                load_s.append(_sync(server_url, reload, i + 1))
                # The same version again, the way the sampler now syncs this server: one request.
                swap = ("/collective_rpc", {"method": RELOAD_METHOD, "kwargs": {"weights_path": str(path)}})
                swap_s.append(_sync(server_url, swap, i + 1))
                # With the probe: asked for after the swap (before), or carried by it (now).
                apart_s.append(_sync(server_url, swap, i + 1, probe_ids=ids))
                inline_s.append(_sync(server_url, swap, i + 1, probe_ids=ids, inline=True))
            http.post(server_url + "/v1/completions", json=probe_request(ids), timeout=600).raise_for_status()
            rows.append({"model": name, "params": params, "kind": "full", "rank": None, "trained_params": params,
                         "dtype": dtype_name, "bytes": ckpt.dir_bytes(path), "write_s": _median(write_s),
                         "load_s": _median(load_s), "swap_load_s": _median(swap_s),
                         "swap_probe_apart_s": _median(apart_s), "swap_probe_inline_s": _median(inline_s),
                         "step_s": _median([w + s for w, s in zip(write_s, load_s)])})
            shutil.rmtree(root / f"{name}-full")
            # -- the adapter
            run = attach(model, LoraSpec(rank=rank, alpha=2 * rank, dropout=0.0,
                                         target_modules=DEFAULT_TARGET_MODULES), str(base))
            with torch.no_grad():
                for pname, param in run.model.named_parameters():
                    if "lora_B" in pname:
                        param.normal_(0.0, 0.02)
            trained = {k: v.detach() for k, v in run.model.named_parameters() if v.requires_grad}
            write_s, load_s = [], []
            for i in range(repeats):
                t0 = time.perf_counter()
                path = run.publish(root / f"{name}-lora", i + 1, trained, dtype=dtype, step=i)
                write_s.append(time.perf_counter() - t0)
                load = (LOAD_PATH, load_request(DEFAULT_ADAPTER_NAME, path))
                load_s.append(_sync(server_url, load, 100 + i))
            probe = {**probe_request(ids), "model": DEFAULT_ADAPTER_NAME}
            http.post(server_url + "/v1/completions", json=probe, timeout=600).raise_for_status()
            rows.append({"model": name, "params": params, "kind": "lora", "rank": rank,
                         "trained_params": sum(t.numel() for t in trained.values()), "dtype": dtype_name,
                         "bytes": ckpt.dir_bytes(path), "write_s": _median(write_s), "load_s": _median(load_s),
                         "step_s": _median([w + s for w, s in zip(write_s, load_s)])})
    finally:
        server.terminate()
    return rows


def run(results_dir: Path, models: tuple[str, ...] = ("tiny", "0.5b"), rank: int = 8, dtype: str = "bfloat16",
        repeats: int = 3, root: str = "/tmp") -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tandem-publication-", dir=root) as tmp:
        for name in models:
            rows += _measure(name, Path(tmp), rank=rank, dtype_name=dtype, repeats=repeats)
    result = {"rank": rank, "dtype": dtype, "repeats": repeats, "root": root, "rows": rows, "host": host()}
    lines = ["# What a weight sync costs per step: full weights against a LoRA adapter", "",
             f"`.venv/bin/python -m bench publication`: per model, the trainer's own publication functions write "
             f"version after version in {dtype} under {root} (write), and Tandem's CPU inference server loads each "
             "with the sampler's sync steps through the sampler's HTTP client, pause to resume (load: `/collective_rpc` reload for full weights, "
             f"`/v1/load_lora_adapter` in place for the adapter). Rank {rank} on every attention and MLP "
             f"projection; median of {repeats}. Both models are built here with random weights. The "
             "one-request swap column: the same full version loaded again the way the sampler now syncs this server, one "
             "`tandem_reload_weights` request carrying the label (no pause, label, reset or resume). Every full "
             "version here holds the same weights, and the server skips a version whose digest it already holds, "
             "so both full load columns are the sync's protocol cost, not a load of the bytes. The two after it: "
             "that swap with the sampler's probe of a 32-token sequence, asked for apart afterwards (before) or "
             "carried by the swap, `probe_token_ids`, whose answer holds the logprobs (now).", "",
             "| model | params | kind | trained params | bytes published | write s | load s | write + load s "
             "| load s, one-request swap | swap + probe request s | swap carrying the probe s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.1f} M | {r['kind']}"
                     f"{'' if r['rank'] is None else ' r' + str(r['rank'])} | {r['trained_params'] / 1e6:.3f} M "
                     f"| {r['bytes'] / 2**20:.2f} MiB | {r['write_s']} | {r['load_s']} | {r['step_s']} "
                     f"| {r.get('swap_load_s', '—')} | {r.get('swap_probe_apart_s', '—')} "
                     f"| {r.get('swap_probe_inline_s', '—')} |")
    for name in dict.fromkeys(r["model"] for r in rows):
        full = next(r for r in rows if r["model"] == name and r["kind"] == "full")
        lora = next(r for r in rows if r["model"] == name and r["kind"] == "lora")
        lines.append("")
        lines.append(f"{name}: the adapter is {full['bytes'] / lora['bytes']:.0f}x fewer bytes and its sync "
                     f"{full['step_s'] / max(lora['step_s'], 1e-9):.1f}x faster (write + load).")
    write_results(results_dir, "publication", result, "\n".join(lines))
    return result
