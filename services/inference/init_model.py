"""`tandem init-model --preset tiny --out DIR [--seed S]`: a small randomly initialised causal
LM with the local character tokenizer, saved as an ordinary Hugging Face model directory
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json with the chat template,
chat_template.jinja, generation_config.json).

The architecture is plain `LlamaForCausalLM`, so `AutoModelForCausalLM`, the trainer and vLLM
all load it. Head size is 32 because vLLM's attention backends do not support smaller heads.
The same seed gives bit-identical weights. Python callers use `init_model(out_dir, preset, seed)`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# hidden = heads * 32; sized so that a CPU forward+backward of a small batch takes milliseconds.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 2},
    "small": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2},
}
MAX_POSITIONS = 2048


def build_config(preset: str, tokenizer) -> Any:
    from transformers import LlamaConfig

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=0.02,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        head_dim=32,
        dtype="float32",
        **PRESETS[preset],
    )


def init_model(out_dir: str | os.PathLike, preset: str = "tiny", seed: int = 0, overwrite: bool = True) -> Path:
    """Write the model directory and return its path. Written to a sibling temporary directory
    and renamed into place, so a reader never sees half a model."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    from services.inference.tokenizer import CHAT_TEMPLATE, build_tokenizer

    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "config.json").exists())):
        # Replacing a model directory is routine; wiping an unrelated one by a typo is not.
        raise FileExistsError(f"{out} exists and is not a model directory; choose another --out")
    hf_logging.disable_progress_bar()
    tokenizer = build_tokenizer()
    config = build_config(preset, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        do_sample=True, temperature=1.0, top_p=1.0,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # Newer transformers writes the template only to chat_template.jinja; older readers
        # (and some vLLM versions) look in tokenizer_config.json.
        cfg_path = tmp / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] = CHAT_TEMPLATE
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / "tandem_model.json").write_text(json.dumps({"preset": preset, "seed": seed}) + "\n")
        # mkdtemp makes the directory private; a model directory is shared with other
        # processes and containers (the trainer, vLLM).
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--out", required=True, help="model directory to write (replaced if it exists)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        path = init_model(args.out, preset=args.preset, seed=args.seed)
    except FileExistsError as exc:
        print(f"{prog or 'init-model'}: {exc}", file=sys.stderr)
        return 2
    n = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    print(f"wrote {args.preset} model (seed {args.seed}, {n / 1e6:.2f} MB of weights) to {path}")
    return 0
