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
        def state_dict(self):
            return model.state_dict()

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


# -- published weights ---------------------------------------------------------------------


def test_published_weights_are_the_model_in_the_publish_dtype_and_nothing_else(tmp_path, model) -> None:
    from safetensors.torch import load_file

    path = ckpt.publish_weights(tmp_path / "pub", 7, model.state_dict(), model.config, dtype=torch.bfloat16, step=6)
    assert path == tmp_path / "pub" / "version-7"
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors", ckpt.PUBLISHED_FILE]
    meta = json.loads((path / ckpt.PUBLISHED_FILE).read_text())
    assert (meta["version"], meta["step"], meta["dtype"]) == (7, 6, "bfloat16")
    weights = load_file(path / "model.safetensors")
    state = ckpt.untie(model.state_dict(), model.config)
    assert weights.keys() == state.keys()
    for name, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, state[name].to(torch.bfloat16)), name
    # Half the bytes of float32 (the weights are nearly all of the file).
    f32 = ckpt.publish_weights(tmp_path / "pub32", 7, model.state_dict(), model.config, dtype=torch.float32, step=6)
    ratio = (path / "model.safetensors").stat().st_size / (f32 / "model.safetensors").stat().st_size
    assert 0.49 < ratio < 0.52, ratio
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_published_weights_load_into_the_cpu_inference_server(tmp_path, model, tiny_model_dir) -> None:
    """The reader of a published directory: the CPU server's reload (vLLM's reads the same files)."""
    import asyncio

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.inference.engine import Engine

    moved = {name: t + 0.01 if t.is_floating_point() else t for name, t in model.state_dict().items()}
    path = ckpt.publish_weights(tmp_path / "pub", 1, moved, model.config, dtype=torch.bfloat16, step=0)

    async def reload() -> dict[str, torch.Tensor]:
        served_model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16)
        engine = Engine(served_model, AutoTokenizer.from_pretrained(str(tiny_model_dir)), model_path=tiny_model_dir)
        await engine.start()
        try:
            await engine.reload_weights(path)
            return {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        finally:
            await engine.close()

    served = asyncio.run(reload())
    name = "model.embed_tokens.weight"
    torch.testing.assert_close(served[name].float(), moved[name].to(torch.bfloat16).float())


def test_non_finite_weights_are_never_published(tmp_path, model) -> None:
    state = {name: t.clone() for name, t in model.state_dict().items()}
    state["model.norm.weight"][3] = float("nan")
    with pytest.raises(ValueError, match="non-finite values in \\['model.norm.weight'\\]"):
        ckpt.publish_weights(tmp_path / "pub", 1, state, model.config, dtype=torch.float32, step=0)
    assert ckpt.list_published(tmp_path / "pub") == []
    assert not list((tmp_path / "pub").glob(".tmp-*"))


def test_published_versions_are_pruned_newest_kept(tmp_path, model) -> None:
    for version in range(1, 5):
        ckpt.publish_weights(tmp_path, version, model.state_dict(), model.config, dtype=torch.float32,
                             step=version - 1)
    ckpt.prune_published(tmp_path, 2)
    assert [v for v, _ in ckpt.list_published(tmp_path)] == [3, 4]
    with pytest.raises(ValueError, match="keep must be >= 1"):
        ckpt.prune_published(tmp_path, 0)


def test_a_reused_publish_dir_prunes_the_old_runs_versions_first(tmp_path, model) -> None:
    """A new run in a directory holding an older run's version-59/60 keeps what it just wrote:
    newest means written last, not the highest number."""
    for version in (59, 60):
        ckpt.publish_weights(tmp_path, version, model.state_dict(), model.config, dtype=torch.float32, step=version - 1)
    for version in (1, 2):
        ckpt.publish_weights(tmp_path, version, model.state_dict(), model.config, dtype=torch.float32, step=version - 1)
        ckpt.prune_published(tmp_path, 2)
    assert [v for v, _ in ckpt.list_published(tmp_path)] == [1, 2]


def test_pruning_spares_the_version_the_sampler_serves(tmp_path, model) -> None:
    """A resumed run writes versions the sampler already passed (it serves the dead run's
    version-9): those are pruned, the served one is not."""
    for version in (8, 9, 6, 7, 8):
        ckpt.publish_weights(tmp_path, version, model.state_dict(), model.config, dtype=torch.float32, step=version - 1)
        ckpt.prune_published(tmp_path, 2, protect=(tmp_path / "version-9",))
    assert [v for v, _ in ckpt.list_published(tmp_path)] == [7, 8, 9]


def test_a_resume_starts_from_the_checkpoint_written_last(tmp_path, model) -> None:
    ckpt.save_checkpoint(tmp_path, 59, model)
    ckpt.save_checkpoint(tmp_path, 9, model)  # a new run (--no-resume) in the same run_dir
    assert ckpt.latest_checkpoint(tmp_path)[0] == 9
    ckpt.save_checkpoint(tmp_path, 19, model)
    ckpt.prune_checkpoints(tmp_path, 2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [9, 19]
