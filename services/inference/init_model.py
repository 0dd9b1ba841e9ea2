"""`tandem init-model --preset tiny --out DIR [--seed S]`: a small randomly initialised causal
LM with the local character tokenizer, saved as an ordinary Hugging Face model directory
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json with the chat template,
chat_template.jinja, generation_config.json, and tandem_model.json with the preset and seed).

The architecture is plain `LlamaForCausalLM`, so `AutoModelForCausalLM`, the trainer and vLLM
all load it. Head size is 32 because vLLM's attention backends do not support smaller heads.
Python callers use `init_model(out_dir, preset, seed)`.

`init_model` imports neither torch nor transformers: `tandem demo` writes a fresh model before it
can start the inference server and the trainer, and importing those two (and building the model
through them) took ~5 s of that start-up on a 2-core machine; numpy, safetensors and tokenizers
write the same directory in a fraction of a second. The JSON files are byte for byte what
`build_config` + `save_pretrained` write with transformers 5.24 (TRANSFORMERS_VERSION);
tests/inference/test_inference_init_model.py compares them with what the installed transformers
writes, so a format change there fails a test rather than going unnoticed. The weights are drawn
as transformers' `_init_weights` draws a Llama's: every Linear and the embedding from
Normal(0, INITIALIZER_RANGE) in float32 (but `tiny-lora`'s embedding and untied head: EMBED_STD,
HEAD_STD), the embedding's pad row zero, every RMSNorm weight 1;
from `numpy.random.default_rng(seed)` in the order `_weights` documents, so the same seed gives
bit-identical weights (under one numpy release: NEP 19 lets Generator streams change between
releases), though not the values torch's generator gave before.
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
# The model a LoRA demo trains (docs/lora.md, "Why the tiny model needs its own head"): `tiny`'s
# layers, drawn alike, with the two parts an adapter cannot train sized for a width of 64 rather
# than left at INITIALIZER_RANGE, which is sized for widths near 1000.
# * An untied LM head of std 0.15: a tied head of std 0.02 lets no hidden state give any token
#   more than ~3.5% (|logit| <= 0.02 * sqrt(64) * sqrt(64) ~ 1.3 nats); at 0.15 the frozen head
#   can give the answer letter ~0.99 (measured by gradient ascent over the final hidden state).
# * Embeddings of std 1/sqrt(64) = 0.125: at 0.02 the last digit's embedding (norm ~0.16) is
#   smaller than what the layers add from the shared prompt text (~0.2), so every prompt's final
#   state points the same way (mean cosine 0.55 against 0.17 at 0.125) and an adapter's first
#   gains say one letter for every number: the sampled policy collapsed onto it and stayed.
#   Untied because a tied head of that size would echo the last digit (~8 nats ahead).
PRESETS["tiny-lora"] = dict(PRESETS["tiny"])
EMBED_STD = {"tiny-lora": 0.125}  # presets whose embedding is not drawn at INITIALIZER_RANGE
HEAD_STD = {"tiny-lora": 0.15}  # presets with an untied LM head, and its std
MAX_POSITIONS = 2048
HEAD_DIM = 32
INITIALIZER_RANGE = 0.02
RMS_NORM_EPS = 1e-5
ROPE_THETA = 10000.0
# The transformers release whose save_pretrained output config.json and generation_config.json copy.
TRANSFORMERS_VERSION = "5.24.0"


def build_config(preset: str, tokenizer) -> Any:
    """The `LlamaConfig` of a preset, for callers that want one; `init_model` writes the same
    config.json without transformers (`config_json`)."""
    from transformers import LlamaConfig

    _check_preset(preset)
    return LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=RMS_NORM_EPS,
        rope_theta=ROPE_THETA,
        tie_word_embeddings=preset not in HEAD_STD,
        initializer_range=INITIALIZER_RANGE,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        head_dim=HEAD_DIM,
        dtype="float32",
        **PRESETS[preset],
    )


def _check_preset(preset: str) -> None:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")


def _token_ids() -> tuple[int, int, int]:
    """(vocab size, pad id, eos id) of the local tokenizer: ids are SPECIAL_TOKENS + CHARACTERS."""
    from services.inference.tokenizer import CHARACTERS, IM_END, PAD, SPECIAL_TOKENS

    vocab = SPECIAL_TOKENS + CHARACTERS
    return len(vocab), vocab.index(PAD), vocab.index(IM_END)


def config_json(preset: str) -> dict[str, Any]:
    """config.json of a preset: the keys and values `build_config(preset, build_tokenizer())`
    gives a `LlamaForCausalLM` saved by transformers 5.24 (which writes them sorted)."""
    _check_preset(preset)
    vocab_size, pad_id, eos_id = _token_ids()
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "dtype": "float32",
        "eos_token_id": eos_id,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "initializer_range": INITIALIZER_RANGE,
        "max_position_embeddings": MAX_POSITIONS,
        "mlp_bias": False,
        "model_type": "llama",
        "pad_token_id": pad_id,
        "pretraining_tp": 1,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
        "tie_word_embeddings": preset not in HEAD_STD,
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": True,
        "vocab_size": vocab_size,
        **PRESETS[preset],
    }


def generation_config_json() -> dict[str, Any]:
    """generation_config.json: sample at temperature 1 and stop at `<|im_end|>`."""
    _, pad_id, eos_id = _token_ids()
    return {"do_sample": True, "eos_token_id": eos_id, "pad_token_id": pad_id, "temperature": 1.0,
            "top_p": 1.0, "transformers_version": TRANSFORMERS_VERSION}


def _weights(preset: str, seed: int) -> dict[str, Any]:
    """The float32 tensors of model.safetensors, named as `LlamaForCausalLM` names them (tied
    embeddings: no lm_head.weight). Drawn from one `numpy.random.default_rng(seed)` stream in
    this order, which is part of what the seed means: the embedding, then for each layer q_proj,
    k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (each a whole [out, in] matrix of
    standard normals, scaled by INITIALIZER_RANGE), then for a preset with an untied head
    (HEAD_STD) lm_head. Norm weights are ones and draw nothing. The embedding is scaled by
    EMBED_STD where a preset has one; so `tiny-lora` seed S is `tiny` seed S with its embedding
    scaled and a head added."""
    import numpy as np

    p = PRESETS[preset]
    vocab_size, pad_id, _ = _token_ids()
    hidden, inter = p["hidden_size"], p["intermediate_size"]
    q_dim, kv_dim = p["num_attention_heads"] * HEAD_DIM, p["num_key_value_heads"] * HEAD_DIM
    rng = np.random.default_rng(seed)
    std = np.float32(INITIALIZER_RANGE)

    def normal(*shape: int) -> Any:
        return rng.standard_normal(shape, dtype=np.float32) * std

    embed = normal(vocab_size, hidden) * np.float32(EMBED_STD.get(preset, INITIALIZER_RANGE) / INITIALIZER_RANGE)
    embed[pad_id] = 0.0  # as nn.Embedding(padding_idx=pad_token_id) is initialised
    tensors = {"model.embed_tokens.weight": embed, "model.norm.weight": np.ones(hidden, np.float32)}
    shapes = {"self_attn.q_proj": (q_dim, hidden), "self_attn.k_proj": (kv_dim, hidden),
              "self_attn.v_proj": (kv_dim, hidden), "self_attn.o_proj": (hidden, q_dim),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
              "mlp.down_proj": (hidden, inter)}
    for i in range(p["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        for name, shape in shapes.items():  # dict order is the documented draw order
            tensors[f"{prefix}{name}.weight"] = normal(*shape)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{prefix}{norm}.weight"] = np.ones(hidden, np.float32)
    if preset in HEAD_STD:
        tensors["lm_head.weight"] = rng.standard_normal((vocab_size, hidden), dtype=np.float32) * np.float32(
            HEAD_STD[preset])
    return tensors


def _write_json(path: Path, value: dict[str, Any]) -> None:
    # transformers' to_json_string: sorted keys, indent 2, a final newline.
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def init_model(out_dir: str | os.PathLike, preset: str = "tiny", seed: int = 0, overwrite: bool = True) -> Path:
    """Write the model directory and return its path. Written to a sibling temporary directory
    and renamed into place, so a reader never sees half a model."""
    from safetensors.numpy import save_file

    from services.inference.tokenizer import write_tokenizer_files

    _check_preset(preset)
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "config.json").exists())):
        # Replacing a model directory is routine; wiping an unrelated one by a typo is not.
        raise FileExistsError(f"{out} exists and is not a model directory; choose another --out")
    tensors = _weights(preset, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_json(tmp / "config.json", config_json(preset))
        _write_json(tmp / "generation_config.json", generation_config_json())
        # format "pt" as transformers writes it; its loader reads the file as a torch checkpoint.
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_tokenizer_files(tmp)
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
