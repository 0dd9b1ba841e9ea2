"""init-model writes an ordinary HF directory that transformers loads and whose tokenizer
round-trips the text of the built-in environments exactly; without importing torch or
transformers, and with config and tokenizer files byte for byte what transformers'
save_pretrained writes."""

from __future__ import annotations

import json
import string
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from services.inference import init_model as init_model_cli
from services.inference.init_model import EMBED_STD, HEAD_STD, INITIALIZER_RANGE, PRESETS, build_config, init_model
from services.inference.tokenizer import CHAT_TEMPLATE, IM_END, IM_START, PAD, UNK, build_tokenizer

REPO = Path(__file__).resolve().parents[2]

MATH = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.\n"
    "How many clips did Natalia sell altogether in April and May?\t(Answer: #### 72; 3.5% & $10.00 @ 1/2)"
)


def test_directory_is_a_standard_hf_model(tiny_model: Path) -> None:
    names = {p.name for p in tiny_model.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    assert "chat_template" in json.loads((tiny_model / "tokenizer_config.json").read_text())
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert model.config.vocab_size == len(tok)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    ids = torch.tensor([tok.encode("1 + 1 = ")])
    out = model(ids, labels=ids)
    out.loss.backward()  # trainable as loaded
    assert torch.isfinite(out.loss)


def test_tokenizer_round_trips_ascii(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    every = "".join(chr(c) for c in range(0x20, 0x7F)) + "\n\t"
    for text in (every, MATH, string.digits * 3, "  leading and trailing  \n"):
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == len(text)  # one token per character
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.unk_token_id not in tok.encode(every)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None


def test_chat_template_renders_chatml(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = tok.apply_chat_template([{"role": "user", "content": MATH}], tokenize=False, add_generation_prompt=True)
    assert text == f"<|im_start|>user\n{MATH}<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == f"user\n{MATH}\nassistant\n"


def test_same_seed_same_weights_other_seed_differs(tmp_path: Path, tiny_model: Path) -> None:
    again = init_model(tmp_path / "again", seed=0)
    other = init_model(tmp_path / "other", seed=1)
    base = (tiny_model / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == base
    assert (other / "model.safetensors").read_bytes() != base


def test_cli_writes_model(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cli-model"
    assert init_model_cli.main(["--preset", "tiny", "--out", str(out), "--seed", "3"], prog="tandem init-model") == 0
    assert (out / "model.safetensors").is_file()
    assert "wrote tiny model" in capsys.readouterr().out


def test_refuses_to_replace_a_directory_that_is_not_a_model(tmp_path: Path, capsys) -> None:
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "todo.txt").write_text("keep me")
    assert init_model_cli.main(["--out", str(precious)], prog="tandem init-model") == 2
    assert "not a model directory" in capsys.readouterr().err
    assert (precious / "todo.txt").read_text() == "keep me"


def test_init_model_imports_neither_torch_nor_transformers(tmp_path: Path) -> None:
    # A fresh interpreter: this test process has imported both already.
    code = (
        "import json, sys\n"
        "from services.inference.init_model import init_model\n"
        f"init_model({str(tmp_path / 'm')!r}, 'tiny', 0)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []
    assert (tmp_path / "m" / "model.safetensors").is_file()


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_weights_are_drawn_like_hf_llama_init(tmp_path: Path, preset: str) -> None:
    path = init_model(tmp_path / preset, preset=preset, seed=5)
    tensors = load_file(path / "model.safetensors")
    pad_id = build_tokenizer().pad_token_id
    assert all(t.dtype == np.float32 for t in tensors.values())
    # Tied to the embedding, but for a preset with its own head (HEAD_STD, the LoRA demo's).
    assert ("lm_head.weight" in tensors) == (preset in HEAD_STD)
    stds = {"model.embed_tokens.weight": EMBED_STD.get(preset, INITIALIZER_RANGE),
            "lm_head.weight": HEAD_STD.get(preset)}
    norms = [name for name in tensors if name.endswith("norm.weight")]
    assert len(norms) == 2 * PRESETS[preset]["num_hidden_layers"] + 1
    for name in norms:
        assert np.array_equal(tensors[name], np.ones_like(tensors[name])), name
    embed = tensors["model.embed_tokens.weight"]
    assert not embed[pad_id].any()  # nn.Embedding(padding_idx=pad_token_id) zeroes its row
    assert np.all(np.abs(embed[np.arange(len(embed)) != pad_id]).sum(axis=1) > 0)
    for name, t in tensors.items():
        if name in norms:
            continue
        drawn = np.delete(t, pad_id, axis=0) if name == "model.embed_tokens.weight" else t
        # >= 6000 samples each: the std is within 4% of its own and the mean within ~6 sigma of 0.
        std = stds.get(name, INITIALIZER_RANGE)
        assert abs(drawn.std() / std - 1) < 0.04, name
        assert abs(drawn.mean()) < 0.1 * std, name
    # Different tensors are different draws, not one draw reused.
    assert not np.array_equal(tensors["model.layers.0.self_attn.q_proj.weight"],
                              tensors["model.layers.0.self_attn.k_proj.weight"])


def test_the_lora_preset_is_tiny_with_a_larger_embedding_and_its_own_head(tmp_path: Path) -> None:
    # The same draws as `tiny` of the same seed (the head drawn after them), so the LoRA demo's
    # model differs from the full demo's in the two scales docs/lora.md gives, nothing else.
    tiny = load_file(init_model(tmp_path / "tiny", "tiny", seed=3) / "model.safetensors")
    lora = load_file(init_model(tmp_path / "lora", "tiny-lora", seed=3) / "model.safetensors")
    assert set(lora) - set(tiny) == {"lm_head.weight"}
    for name, t in tiny.items():
        if name == "model.embed_tokens.weight":
            np.testing.assert_allclose(lora[name], t * (EMBED_STD["tiny-lora"] / INITIALIZER_RANGE), rtol=1e-6)
        else:
            assert np.array_equal(lora[name], t), name
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "lora", output_loading_info=True)
    assert all(not keys for keys in info.values()), info
    assert not model.config.tie_word_embeddings
    assert torch.equal(model.lm_head.weight.detach(), torch.from_numpy(lora["lm_head.weight"]))


def test_loads_with_no_missing_or_unexpected_keys(tiny_model: Path) -> None:
    model, info = AutoModelForCausalLM.from_pretrained(tiny_model, output_loading_info=True)
    assert all(not keys for keys in info.values()), info
    embed = load_file(tiny_model / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(model.lm_head.weight.detach(), torch.from_numpy(embed))  # tied, as written
    assert model.generation_config.eos_token_id == model.config.eos_token_id == 2


def test_saved_tokenizer_behaves_like_build_tokenizer(tiny_model: Path) -> None:
    saved, built = AutoTokenizer.from_pretrained(tiny_model), build_tokenizer()
    texts = ["\n", "a\nb\tc", f"{IM_START}user\nhi{IM_END}\n{PAD}", UNK + "\u00e9 x", MATH, ""]
    for text in texts:
        for special in (True, False):
            ids = built.encode(text, add_special_tokens=special)
            assert saved.encode(text, add_special_tokens=special) == ids, text
            for skip in (True, False):
                assert saved.decode(ids, skip_special_tokens=skip) == built.decode(ids, skip_special_tokens=skip)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": MATH},
                {"role": "assistant", "content": "72"}, {"role": "user", "content": "and\nnow?"}]
    tools = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {"a": 1}}}]
    for kwargs in ({}, {"add_generation_prompt": True}, {"tools": tools}):
        assert (saved.apply_chat_template(messages, tokenize=False, **kwargs)
                == built.apply_chat_template(messages, tokenize=False, **kwargs))
        assert (saved.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
                == built.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))
    assert (saved.pad_token_id, saved.eos_token_id, saved.unk_token_id, len(saved)) == (
        built.pad_token_id, built.eos_token_id, built.unk_token_id, len(built))


def _reference_with_transformers(out: Path, preset: str) -> None:
    """What init_model wrote when it built the model with transformers (and what it must keep writing)."""
    tokenizer = build_tokenizer()
    model = AutoModelForCausalLM.from_config(build_config(preset, tokenizer), dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        do_sample=True, temperature=1.0, top_p=1.0,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_files_are_what_transformers_save_pretrained_writes(tmp_path: Path, preset: str) -> None:
    ours, ref = init_model(tmp_path / "ours", preset=preset, seed=0), tmp_path / "ref"
    _reference_with_transformers(ref, preset)
    written = {p.name for p in ours.iterdir()}
    assert written == {p.name for p in ref.iterdir()} | {"tandem_model.json"}
    for name in sorted(written - {"model.safetensors", "tandem_model.json"}):
        assert (ours / name).read_bytes() == (ref / name).read_bytes(), name
    # Same tensor names, shapes, dtypes and metadata, so the same safetensors header.
    header = [f.read_bytes()[:8 + int.from_bytes(f.read_bytes()[:8], "little")]
              for f in (ours / "model.safetensors", ref / "model.safetensors")]
    assert header[0] == header[1]
    with safe_open(ours / "model.safetensors", "np") as f:
        assert f.metadata() == {"format": "pt"}
    assert json.loads((ours / "tandem_model.json").read_text()) == {"preset": preset, "seed": 0}
