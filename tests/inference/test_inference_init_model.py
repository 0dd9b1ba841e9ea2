"""init-model writes an ordinary HF directory that transformers loads and whose tokenizer
round-trips the text of the built-in environments exactly."""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.inference import init_model as init_model_cli
from services.inference.init_model import init_model

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
