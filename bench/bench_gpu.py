"""The trainer on one CUDA GPU: optimizer-step time, peak memory, publication of the weights.

A randomly initialised ~1.1 B parameter Llama (TinyLlama-1.1B's shape: hidden 2048, 22 layers,
32 heads with 4 KV heads, intermediate 5632, vocabulary 32000, untied head) is built here from
a `LlamaConfig` with transformers, as `tandem init-model` builds its presets: nothing is
downloaded. It is saved as a Hugging Face directory and then everything runs through the
trainer's own code:

* `model_setup.set_up_model` (float32 master weights, compute dtype `auto` = bfloat16 on
  CUDA, AdamW over the float32 parameters) with the single-process `Sharding`;
* `Learner.train_on_samples` on a synthetic GRPO batch shaped like the sampler's (default 64
  samples = 8 prompts x 8 generations, 128 prompt + 512 completion tokens each), one
  optimizer step per batch (num_iterations 1), loss `grpo`, clipping at 1.0; at micro-batches
  8, 16, 32 (grad accumulation 8, 4, 2), then with gradient checkpointing at 16 and 64;
* `Sharding.full_state_dict` (the gather to the CPU) and `checkpoint.publish_weights` (cast
  to bfloat16, NaN/inf check, safetensors, fsync, atomic rename), to local disk and /dev/shm.

With `--lora-rank R` the same runs train a LoRA adapter instead (services/trainer/lora.py: the
base frozen in float32, the adapter's float32 parameters the only ones AdamW holds), and the
publication is the trainer's LoRA path: the gather of the adapter alone
(`full_state_dict(trainable_only=True)`) and `LoraRun.publish` (PEFT files, `publish_dtype`).

Step time is the wall time of `train_on_samples` (median over the measured steps, after
warm-up), with the AdamW `step()` alone timed by optimizer hooks; peak memory is
`torch.cuda.max_memory_allocated` / `max_memory_reserved` over the measured steps.

Needs CUDA: without it, it prints why and skips (so `make bench` on a CPU machine passes over it).
Needs the project's Python dependencies that `shared/` imports (pydantic, pydantic-settings, numpy)
besides torch and transformers: a bare CUDA image may lack them (bench/results/gpu.md says how the
recorded runs got them).

    python -m bench.bench_gpu --out DIR          # writes DIR/gpu.json and DIR/gpu.md
    python -m bench gpu                          # the same into bench/results/
    python -m bench.bench_gpu --out DIR --preset tiny --allow-cpu   # the code path on a CPU
    python -m bench.bench_gpu --out DIR --lora-rank 16  # LoRA: DIR/gpu_lora.json and gpu_lora.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

COMMAND = "python -m bench.bench_gpu --out $OUT"
REPO = Path(__file__).resolve().parents[1]
GIB = 1024**3

# TinyLlama-1.1B's architecture; "tiny" exercises the same code on a CPU in seconds.
PRESETS: dict[str, dict[str, Any]] = {
    "1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
           "num_key_value_heads": 4, "vocab_size": 32000},
    "tiny": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 2, "vocab_size": 1000},
}


def skip_reason() -> str | None:
    """Why this benchmark cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, cuda build {torch.version.cuda})"
    return None


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fs(path: Path) -> dict[str, Any]:
    """Filesystem type (longest mount prefix in /proc/mounts) and free bytes of `path`."""
    path = path.resolve()
    best, kind = "", "?"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            mount = parts[1]
            if (str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                best, kind = mount, parts[2]
    except OSError:
        pass
    st = os.statvfs(path)
    return {"mount": best, "fstype": kind, "free_bytes": st.f_bavail * st.f_frsize}


def make_samples(n: int, group: int, prompt_len: int, completion_len: int, vocab: int, seed: int = 0) -> list[Any]:
    """n samples in groups of `group` generations sharing a prompt, with fixed lengths,
    behaviour logprobs near a uniform policy's (IS weights O(1)) and group-centred advantages."""
    import math

    from shared.wire import Sample

    rng = random.Random(seed)
    out = []
    for g in range(n // group):
        prompt = [rng.randrange(4, vocab) for _ in range(prompt_len)]
        rewards = [rng.random() for _ in range(group)]
        mean = sum(rewards) / group
        for i in range(group):
            out.append(Sample(
                prompt_id=f"p{g}", group_id=f"g{g}", prompt_token_ids=prompt,
                completion_token_ids=[rng.randrange(4, vocab) for _ in range(completion_len)],
                completion_logprobs=[-math.log(vocab) + rng.uniform(-0.5, 0.5) for _ in range(completion_len)],
                loss_mask=[1] * completion_len, reward=rewards[i], advantage=rewards[i] - mean,
                policy_version=0, finish_reason="length",
            ))
    return out


def build_model_dir(out: Path, preset: str, device: Any, seed: int = 0) -> tuple[dict[str, Any], int, float]:
    """A random Llama of `preset` saved (float32) as a Hugging Face directory, initialised on
    `device` (fast on a GPU) the way init-model does it on the CPU. Returns config, params, seconds."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    config = LlamaConfig(max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                         tie_word_embeddings=False, initializer_range=0.02, pad_token_id=0, eos_token_id=2,
                         bos_token_id=1, dtype="float32", **PRESETS[preset])
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out, safe_serialization=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return config.to_dict(), params, time.perf_counter() - t0


def train_variant(learner: Any, samples: list[Any], *, grad_accum: int, warmup: int, steps: int,
                  device: Any) -> dict[str, Any]:
    """`steps` measured optimizer steps (after `warmup`) of `train_on_samples`."""
    import torch

    step_s: list[float] = []
    adam_s: list[float] = []
    started: list[float] = []

    def pre(*_: Any) -> None:
        _sync(device)
        started.append(time.perf_counter())

    def post(*_: Any) -> None:
        _sync(device)
        adam_s.append(time.perf_counter() - started[-1])

    hooks = [learner.optimizer.register_step_pre_hook(pre), learner.optimizer.register_step_post_hook(post)]
    metrics: dict[str, float] = {}
    try:
        for i in range(warmup + steps):
            if i == warmup:
                adam_s.clear()
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            t0 = time.perf_counter()
            metrics = learner.train_on_samples(samples, grad_accum_steps=grad_accum, lr=1e-6)
            _sync(device)
            if i >= warmup:
                step_s.append(time.perf_counter() - t0)
    finally:
        for h in hooks:
            h.remove()
    out: dict[str, Any] = {
        "micro_batch": len(samples) // grad_accum, "grad_accum": grad_accum, "warmup_steps": warmup,
        "measured_steps": steps, "step_s": [round(s, 4) for s in step_s],
        "step_s_median": round(statistics.median(step_s), 4),
        "adamw_step_s_median": round(statistics.median(adam_s), 4) if adam_s else None,
        "forward_tokens_per_step": metrics.get("forward_tokens"),
        "loss_tokens_per_step": metrics.get("loss_tokens"),
        "last_loss": metrics.get("loss"), "last_grad_norm": metrics.get("grad_norm"),
        "skipped": metrics.get("skipped_no_signal", 0) + metrics.get("skipped_non_finite", 0),
    }
    med = out["step_s_median"]
    out["tokens_per_s"] = round(out["forward_tokens_per_step"] / med) if out["forward_tokens_per_step"] else None
    out["loss_tokens_per_s"] = round(out["loss_tokens_per_step"] / med) if out["loss_tokens_per_step"] else None
    if device.type == "cuda":
        out["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / GIB, 2)
        out["max_memory_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / GIB, 2)
        out["memory_allocated_between_steps_gib"] = round(torch.cuda.memory_allocated(device) / GIB, 2)
    return out


def _timings(row: dict[str, Any], gather_s: list[float], publish_s: list[float], digits: int) -> dict[str, Any]:
    """The medians both publication paths report, from their per-repeat gather and write times."""
    med = statistics.median
    return {
        "gather_full_state_dict_s": [round(x, digits) for x in gather_s],
        "gather_full_state_dict_s_median": round(med(gather_s), digits),
        "publish_weights_s": [round(x, digits) for x in publish_s],
        "publish_weights_s_median": round(med(publish_s), digits),
        "publish_bytes_per_s_median": round(row["bytes"] / med(publish_s)),
        "gather_plus_publish_s_median": round(med([g + p for g, p in zip(gather_s, publish_s)]), digits),
    }


def publication(root: Path, model: Any, sharding: Any, dtype: Any, repeats: int, device: Any,
                params: int) -> dict[str, Any]:
    """Gather (`full_state_dict`) + `publish_weights` into `root`, `repeats` times; plus a
    breakdown of publish_weights's CPU work and the variant of casting on the GPU first."""
    import torch

    from services.trainer import checkpoint as ckpt

    fs = _fs(root)
    need = params * torch.empty((), dtype=dtype).element_size() * 1.1
    row: dict[str, Any] = {"root": str(root), **fs}
    if fs["free_bytes"] < need:
        row["skipped"] = f"{fs['free_bytes'] / GIB:.2f} GiB free, {need / GIB:.2f} GiB needed"
        return row
    gather_s, publish_s, variant_s = [], [], []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-gpu-", dir=root) as tmp_name:
        pub = Path(tmp_name) / "published"
        for i in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            full = sharding.full_state_dict(model)
            gather_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            path = ckpt.publish_weights(pub, i + 1, full, model.config, dtype=dtype, step=i)
            publish_s.append(time.perf_counter() - t0)
            row["bytes"] = (path / ckpt.WEIGHTS_FILE).stat().st_size
            ckpt.prune_published(pub, 1)
        # Where publish_weights's time goes (its own steps, called one by one on the last gather).
        t0 = time.perf_counter()
        tensors = {n: t.detach().to(dtype).contiguous() for n, t in ckpt.untie(full, model.config).items()}
        row["breakdown_cast_to_publish_dtype_on_cpu_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        ckpt.non_finite_tensors(tensors)
        row["breakdown_non_finite_check_s"] = round(time.perf_counter() - t0, 3)
        del tensors, full
        # Not the trainer's path: cast to the publish dtype on the GPU, copy that to the CPU.
        for i in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            small = {n: t.detach().to(dtype).cpu() for n, t in model.state_dict().items()}
            t1 = time.perf_counter()
            ckpt.publish_weights(pub, 100 + i, small, model.config, dtype=dtype, step=i)
            variant_s.append((t1 - t0, time.perf_counter() - t1))
            ckpt.prune_published(pub, 1)
            del small
    med = statistics.median
    row.update({
        "repeats": repeats,
        **_timings(row, gather_s, publish_s, 3),
        "variant_gpu_cast_then_copy_s_median": round(med([a for a, _ in variant_s]), 3),
        "variant_publish_weights_s_median": round(med([b for _, b in variant_s]), 3),
        "variant_total_s_median": round(med([a + b for a, b in variant_s]), 3),
    })
    return row


def adapter_publication(root: Path, model: Any, sharding: Any, lora: Any, dtype: Any, repeats: int,
                        device: Any) -> dict[str, Any]:
    """A LoRA run's publication into `root`, `repeats` times, as the trainer does it: the gather
    of the trainable (adapter) tensors alone, then `LoraRun.publish` (PEFT's files)."""
    from services.trainer import checkpoint as ckpt
    from shared.adapters import ADAPTER_WEIGHTS

    row: dict[str, Any] = {"root": str(root), **_fs(root)}
    gather_s, publish_s = [], []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-gpu-", dir=root) as tmp_name:
        pub = Path(tmp_name) / "published"
        for i in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            trained = sharding.full_state_dict(model, trainable_only=True)
            gather_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            path = lora.publish(pub, i + 1, trained, dtype=dtype, step=i)
            publish_s.append(time.perf_counter() - t0)
            row["bytes"] = (path / ADAPTER_WEIGHTS).stat().st_size
            row["tensors"] = len(trained)
            ckpt.prune_published(pub, 1)
    row.update({"repeats": repeats, **_timings(row, gather_s, publish_s, 4)})
    return row


def measure(*, preset: str = "1b", num_samples: int = 64, group: int = 8, prompt_len: int = 128,
            completion_len: int = 512, grad_accums: tuple[int, ...] = (8, 4, 2), gc_grad_accums: tuple[int, ...] = (4, 1),
            warmup: int = 2, steps: int = 5, pub_repeats: int = 3, work_dir: Path | None = None,
            allow_cpu: bool = False, lora_rank: int = 0) -> dict[str, Any]:
    import torch
    import transformers

    from services.trainer import model_setup
    from services.trainer.config import TrainerSettings
    from services.trainer.learner import Learner, LossConfig
    from services.trainer.sharding import make_sharding

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not allow_cpu:
        raise RuntimeError(skip_reason() or "no CUDA")
    result: dict[str, Any] = {
        "benchmark": "gpu",
        "command": COMMAND,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "bf16_supported": device.type == "cuda" and torch.cuda.is_bf16_supported(),
    }
    if device.type == "cuda":
        result["gpu_memory_total_gib"] = round(torch.cuda.get_device_properties(device).total_memory / GIB, 2)
    work_root = Path(work_dir) if work_dir else REPO / "runs"
    work_root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-", dir=work_root))
    try:
        config, params, build_s = build_model_dir(work / "model", preset, device)
        result["model"] = {"preset": preset, "architecture": "LlamaForCausalLM (random init, built locally)",
                           "params": params, "build_and_save_s": round(build_s, 1),
                           **{k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                     "num_attention_heads", "num_key_value_heads", "vocab_size",
                                                     "tie_word_embeddings")}}
        lora = {"lora_rank": lora_rank} if lora_rank else {}
        settings = TrainerSettings(model=str(work / "model"), run_dir=work / "run", resume=False, dtype="auto",
                                   publish_dtype="auto", learning_rate=1e-6, max_grad_norm=1.0,
                                   gradient_checkpointing=False, **lora)
        sharding = make_sharding("single", distributed=False, device=device)
        t0 = time.perf_counter()
        loaded = model_setup.set_up_model(settings, device, sharding)
        result["set_up_model_s"] = round(time.perf_counter() - t0, 1)
        model, optimizer = loaded.model, loaded.optimizer
        result["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if lora_rank:
            result["lora"] = loaded.lora.record()["lora"]
        result["compute_dtype"] = str(loaded.dtype).removeprefix("torch.")
        result["publish_dtype"] = str(loaded.publish_dtype).removeprefix("torch.")
        result["master_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
        if device.type == "cuda":
            result["memory_after_set_up_gib"] = round(torch.cuda.memory_allocated(device) / GIB, 2)
        loss_cfg = LossConfig(loss_type="grpo", temperature=1.0, max_completion_length=completion_len)
        learner = Learner(model, optimizer, loss_cfg, device=device, max_grad_norm=settings.max_grad_norm,
                          sharding=sharding, train_mode=False)
        samples = make_samples(num_samples, group, prompt_len, completion_len, config["vocab_size"])
        result["batch"] = {"samples": num_samples, "prompts": num_samples // group, "generations": group,
                           "prompt_tokens": prompt_len, "completion_tokens": completion_len,
                           "loss": "grpo", "num_iterations": 1, "max_grad_norm": 1.0, "beta": 0.0}
        variants = [("default", g) for g in grad_accums] + [("gradient_checkpointing", g) for g in gc_grad_accums]
        result["steps"] = []
        for kind, grad_accum in variants:
            if kind == "gradient_checkpointing":
                # What set_up_model does with gradient_checkpointing (transformers only checkpoints
                # in train mode, so the learner then trains in train mode).
                enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
                enable()
                learner.train_mode = True
            row: dict[str, Any] = {"variant": kind}
            if device.type == "cuda":
                # So that each variant's reserved peak is its own, not the cache a previous one left.
                torch.cuda.empty_cache()
            try:
                row.update(train_variant(learner, samples, grad_accum=grad_accum, warmup=warmup, steps=steps,
                                         device=device))
                row["model_tflops_per_s"] = round(6 * params * row["forward_tokens_per_step"]
                                                  / row["step_s_median"] / 1e12, 1)
            except Exception as exc:  # a finding to record (CUDA out of memory, or code that fails on CUDA)
                traceback.print_exc()
                row.update({"micro_batch": num_samples // grad_accum, "grad_accum": grad_accum,
                            "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"})
                optimizer.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            result["steps"].append(row)
        if gc_grad_accums:
            disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
            disable()
            learner.train_mode = False
        optimizer.zero_grad(set_to_none=True)
        result["publication"] = []
        roots = [work, Path("/dev/shm")]
        for root in roots:
            if not root.is_dir():
                result["publication"].append({"root": str(root), "skipped": "not present"})
                continue
            try:
                if loaded.lora is not None:
                    row = adapter_publication(root, model, sharding, loaded.lora, loaded.publish_dtype, pub_repeats,
                                              device)
                else:
                    row = publication(root, model, sharding, loaded.publish_dtype, pub_repeats, device, params)
            except Exception as exc:  # a finding to record
                traceback.print_exc()
                row = {"root": str(root), "error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(row), flush=True)
            result["publication"].append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result


def markdown(r: dict[str, Any]) -> str:
    m = r["model"]
    b = r["batch"]
    lines = [
        "# The trainer on one GPU",
        "",
        f"Device: {r['device']} ({r.get('gpu_memory_total_gib')} GiB), torch {r['torch']} (CUDA {r['cuda']}), "
        f"transformers {r['transformers']}, Python {r['python']}, {r['cpus']} CPUs.",
        "",
        f"Model: random `LlamaForCausalLM` built from a config (no download), {m['params'] / 1e9:.3f} B parameters: "
        f"hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, {m['num_attention_heads']} heads "
        f"({m['num_key_value_heads']} KV), intermediate {m['intermediate_size']}, vocabulary {m['vocab_size']}, "
        f"tied embeddings {m['tie_word_embeddings']}. Loaded by `set_up_model`: master weights {r['master_dtype']}, "
        f"compute {r['compute_dtype']} (autocast), AdamW; {r.get('memory_after_set_up_gib')} GiB allocated after set-up.",
        "",
    ]
    if r.get("lora"):
        lines += [f"LoRA: {r['lora']}; {r['trainable_params']:,} trainable parameters (the adapter; the base is "
                  "frozen). 6*N*tokens below still counts all N parameters (a rough proxy).", ""]
    lines += [
        f"Batch: {b['samples']} samples ({b['prompts']} prompts x {b['generations']} generations), "
        f"{b['prompt_tokens']} prompt + {b['completion_tokens']} completion tokens each, loss {b['loss']}, "
        f"one optimizer step per batch (`Learner.train_on_samples`), clipping {b['max_grad_norm']}.",
        "",
        "| variant | micro-batch x accum | step s (median) | AdamW step s | tokens/s | loss tokens/s | "
        "6*N*tokens TFLOP/s | max allocated GiB | max reserved GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in r["steps"]:
        if "error" in s:
            lines.append(f"| {s['variant']} | {s['micro_batch']} x {s['grad_accum']} | {s['error']} | | | | | | |")
            continue
        lines.append(f"| {s['variant']} | {s['micro_batch']} x {s['grad_accum']} | {s['step_s_median']} | "
                     f"{s['adamw_step_s_median']} | {s['tokens_per_s']} | {s['loss_tokens_per_s']} | "
                     f"{s['model_tflops_per_s']} | {s.get('max_memory_allocated_gib')} | "
                     f"{s.get('max_memory_reserved_gib')} |")
    lines += [
        "",
        f"Publication ({r['publish_dtype']}, `Sharding.full_state_dict` then `checkpoint.publish_weights`):",
        "",
        "| root (fs) | bytes | gather s | publish_weights s | MB/s | gather + publish s | "
        "bf16 cast alone s | NaN check alone s | GPU-cast variant total s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in r["publication"]:
        if "skipped" in p or "error" in p:
            lines.append(f"| {p['root']} ({p.get('fstype', '?')}) | {p.get('skipped') or p.get('error')} "
                         "| | | | | | | |")
            continue
        lines.append(f"| {p['root']} ({p['fstype']}) | {p['bytes']} | {p['gather_full_state_dict_s_median']} | "
                     f"{p['publish_weights_s_median']} | {p['publish_bytes_per_s_median'] / 1e6:.0f} | "
                     f"{p['gather_plus_publish_s_median']} | {p.get('breakdown_cast_to_publish_dtype_on_cpu_s', '-')} | "
                     f"{p.get('breakdown_non_finite_check_s', '-')} | {p.get('variant_total_s_median', '-')} |")
    lines += ["", f"`{r['command']}`"]
    return "\n".join(lines)


def run(results_dir: Path) -> dict[str, Any]:
    """`python -m bench gpu`: skips (and writes nothing) without CUDA."""
    reason = skip_reason()
    if reason:
        print(f"bench gpu: skipped: {reason}", flush=True)
        return {"benchmark": "gpu", "skipped": reason}
    result = measure()
    result["command"] = "python -m bench gpu"
    write(Path(results_dir), result)
    return result


def write(out: Path, result: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    name = "gpu_lora" if result.get("lora") else "gpu"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown(result) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for gpu.json and gpu.md")
    parser.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--completion-tokens", type=int, default=512)
    parser.add_argument("--grad-accum", default="8,4,2", help="comma list: one measured variant each")
    parser.add_argument("--gc-grad-accum", default="4,1",
                        help="comma list: gradient-checkpointing variants (after the others); empty: none")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--pub-repeats", type=int, default=3)
    parser.add_argument("--work-dir", default=None, help="local-disk directory for the model and publication "
                        "(default: runs/ in the repository)")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU (to test the code path)")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="train a LoRA adapter of this rank instead of the full model (0: full)")
    args = parser.parse_args(argv)
    reason = skip_reason()
    if reason and not args.allow_cpu:
        print(f"bench_gpu: skipped: {reason}", flush=True)
        return 0
    result = measure(preset=args.preset, num_samples=args.samples, prompt_len=args.prompt_tokens,
                     completion_len=args.completion_tokens,
                     grad_accums=tuple(int(x) for x in args.grad_accum.split(",") if x),
                     gc_grad_accums=tuple(int(x) for x in args.gc_grad_accum.split(",") if x), warmup=args.warmup, steps=args.steps,
                     pub_repeats=args.pub_repeats, work_dir=Path(args.work_dir) if args.work_dir else None,
                     allow_cpu=args.allow_cpu, lora_rank=args.lora_rank)
    result["command"] = "python -m bench.bench_gpu " + " ".join(argv if argv is not None else sys.argv[1:])
    write(Path(args.out), result)
    print(json.dumps(result, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
