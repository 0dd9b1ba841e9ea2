"""Bytes and seconds the trainer writes per step: every step a full checkpoint (before) vs
published weights every step plus a full checkpoint every `checkpoint_every` (after).

Before (until issue 16): each step wrote `checkpoints/step-N` (float32 safetensors, tokenizer,
`optimizer.pt` with AdamW's two float32 moments) and fsynced it, for inference to reload.
After: each step writes `publish_dir/version-V` (weights only, in `publish_dtype`), and a
full checkpoint every `checkpoint_every` steps. The model is a randomly initialised Llama
built here (no hub), trained for one AdamW step so the optimizer state exists; the writes are
the trainer's own functions (services/trainer/checkpoint.py).

    .venv/bin/python -m bench publication
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import host, write_results


def _model(hidden: int, layers: int, vocab: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers,
                         num_attention_heads=max(hidden // 64, 1), num_key_value_heads=max(hidden // 64, 1),
                         vocab_size=vocab, max_position_embeddings=256, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run(results_dir: Path, hidden: int = 1024, layers: int = 8, vocab: int = 32000, checkpoint_every: int = 10,
        repeats: int = 3, roots: tuple[str, ...] = ("/tmp", "/dev/shm")) -> dict[str, Any]:
    import torch

    from services.trainer import checkpoint as ckpt

    model = _model(hidden, layers, vocab)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    state = model.state_dict()
    rows = []
    for root in roots:
        if not Path(root).is_dir():
            continue
        with tempfile.TemporaryDirectory(prefix="tandem-publication-", dir=root) as tmp:
            tmp = Path(tmp)
            full_s, pub_s = [], []
            for i in range(repeats):
                t0 = time.perf_counter()
                full = ckpt.save_checkpoint(tmp / "run", i, model, optimizer=optimizer)
                full_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                published = ckpt.publish_weights(tmp / "pub", i + 1, state, model.config, dtype=torch.bfloat16, step=i)
                pub_s.append(time.perf_counter() - t0)
            full_bytes, pub_bytes = _bytes(full), _bytes(published)
            shutil.rmtree(tmp / "run")
        before = full_bytes
        after = pub_bytes + full_bytes / checkpoint_every
        rows.append({
            "root": root, "params": params,
            "full_checkpoint_bytes": full_bytes, "published_bf16_bytes": pub_bytes,
            "bytes_per_step_before": before, "bytes_per_step_after": round(after),
            "reduction": round(before / after, 2),
            "full_checkpoint_s_median": round(sorted(full_s)[len(full_s) // 2], 3),
            "publish_bf16_s_median": round(sorted(pub_s)[len(pub_s) // 2], 3),
            "seconds_per_step_before": round(sorted(full_s)[len(full_s) // 2], 3),
            "seconds_per_step_after": round(sorted(pub_s)[len(pub_s) // 2]
                                            + sorted(full_s)[len(full_s) // 2] / checkpoint_every, 3),
        })
    result = {"model": {"hidden": hidden, "layers": layers, "vocab": vocab, "params": params},
              "checkpoint_every": checkpoint_every, "repeats": repeats, "rows": rows, "host": host()}
    gib = 1 << 30
    lines = ["# Bytes written per trainer step: before and after publication left checkpointing", "",
             f"`.venv/bin/python -m bench publication`: a random Llama of {params / 1e6:.0f} M parameters "
             f"(hidden {hidden}, {layers} layers, vocabulary {vocab}); median of {repeats} writes each; "
             f"checkpoint_every {checkpoint_every}. Bytes scale with the parameter count: at 8 B parameters "
             "the same ratios give the per-step numbers in the last column.", "",
             "| where | before: full checkpoint every step | after: bf16 weights + full checkpoint / "
             f"{checkpoint_every} | reduction | s/step before | s/step after | 8 B params, before -> after |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        scale = 8e9 / params
        lines.append(f"| {r['root']} | {r['bytes_per_step_before'] / gib:.2f} GiB | {r['bytes_per_step_after'] / gib:.2f} GiB "
                     f"| {r['reduction']}x | {r['seconds_per_step_before']} | {r['seconds_per_step_after']} | "
                     f"{r['bytes_per_step_before'] * scale / gib:.0f} GiB -> {r['bytes_per_step_after'] * scale / gib:.0f} GiB |")
    write_results(results_dir, "publication", result, "\n".join(lines))
    return result
