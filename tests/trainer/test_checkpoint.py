"""Checkpoints: HF format, atomic, keep-last-K, resume discovery."""

from __future__ import annotations

import json

import pytest
import torch

from services.trainer import checkpoint as ckpt


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)


def test_checkpoint_is_a_loadable_hf_directory(tmp_path, model, tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = ckpt.save_checkpoint(tmp_path, 4, model, model_dir=tiny_model_dir, optimizer=opt, state={"lr": 1e-3})
    assert path == tmp_path / "checkpoints" / "step-4"
    state = json.loads((path / ckpt.STATE_FILE).read_text())
    assert state["step"] == 4 and state["version"] == 5 and state["lr"] == 1e-3
    assert (path / "model.safetensors").is_file() and (path / ckpt.OPTIMIZER_FILE).is_file()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (path / name).is_file(), name
    reloaded = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")
    tok = AutoTokenizer.from_pretrained(str(path))
    assert tok.decode(tok.encode("1+2=3"), skip_special_tokens=True) == "1+2=3"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_keep_last_k_and_latest(tmp_path, model) -> None:
    for step in range(5):
        ckpt.save_checkpoint(tmp_path, step, model, keep=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [3, 4]
    assert ckpt.latest_checkpoint(tmp_path) == (4, tmp_path / "checkpoints" / "step-4")
    with pytest.raises(ValueError, match="keep must be >= 1"):
        ckpt.prune_checkpoints(tmp_path, 0)


def test_failed_save_leaves_no_checkpoint(tmp_path, model) -> None:
    class Exploding:
        def save_pretrained(self, path, **kwargs):
            model.save_pretrained(path, **kwargs)
            raise OSError("disk full")

    ckpt.save_checkpoint(tmp_path, 0, model)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(tmp_path, 1, Exploding())
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [0]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_incomplete_and_stale_directories_are_ignored(tmp_path, model) -> None:
    ckpt.save_checkpoint(tmp_path, 1, model)
    # A crash mid-save leaves a temp dir; a step dir without trainer_state.json is incomplete.
    (tmp_path / "checkpoints" / ".tmp-step-2-999").mkdir()
    (tmp_path / "checkpoints" / "step-7").mkdir()
    assert ckpt.latest_checkpoint(tmp_path)[0] == 1
    ckpt.save_checkpoint(tmp_path, 2, model)  # cleans the stale temp dir
    assert not (tmp_path / "checkpoints" / ".tmp-step-2-999").exists()
    assert ckpt.latest_checkpoint(tmp_path)[0] == 2


def test_resaving_a_step_replaces_it(tmp_path, model) -> None:
    ckpt.save_checkpoint(tmp_path, 3, model, state={"attempt": 1})
    ckpt.save_checkpoint(tmp_path, 3, model, state={"attempt": 2})
    assert ckpt.read_state(tmp_path / "checkpoints" / "step-3")["attempt"] == 2
    assert len(ckpt.list_checkpoints(tmp_path)) == 1
