"""LoRA runs in the trainer (services/trainer/lora.py) on the real tiny model, CPU and gloo.

What is checked here is the trainer's side only: the model and optimizer `set_up_model` builds,
the learner's steps and reference, the published and checkpointed adapter as peft and the
inference servers read it, resume, ddp/fsdp on two forked ranks, and `tandem export --merge`.
No sampler: one that serves adapters is the sampler's and the servers' business (their tests).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from services.cli import main as tandem
from services.trainer import checkpoint as ckpt
from services.trainer.collate import split_micro_batches
from services.trainer.config import TrainerSettings
from services.trainer.learner import Learner, LossConfig, forward_logprobs
from services.trainer.lora import DEFAULT_TARGET_MODULES, LoraSpec
from services.trainer.model_setup import set_up_model
from services.trainer.probe import compute_probe
from services.trainer.sharding import make_sharding
from shared.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_adapter_dir
from shared.settings import SettingsError, build, load
from tests.trainer.conftest import make_samples

pytest.importorskip("peft", reason="LoRA needs peft (the cpu extra pins it)")

LR = 2e-2  # large enough that two steps move the adapter's logprobs by far more than the tolerances
BETA = 0.05  # exercises the reference (the adapter disabled)
WORLD = 2
# Two ranks, or a resume from fsdp's shards, sum gradients in another order. Adam turns that float
# noise into differences of up to a few 1e-5 where a LoRA A entry's gradient is of the order of
# its eps (B has just left zero), how much depending on the base weights (1e-6 to 3e-5 over
# init-model seeds). A sharding or resume bug moves entries by the order of LR per step.
ADAPTER_ATOL = 1e-4
PEFT_KEY = re.compile(r"^base_model\.model\.model\.layers\.\d+\.(self_attn|mlp)\.[a-z]+_proj\.lora_[AB]\.weight$")
IDS = [5, 17, 33, 8, 41, 12, 60, 7]


def _settings(model: Path, run_dir: Path, **overrides) -> TrainerSettings:
    values = {"model": model, "run_dir": run_dir, "lora_rank": 4, "beta": BETA, "learning_rate": LR,
              "progress": False}
    values.update(overrides)
    return build(TrainerSettings, {k: str(v) for k, v in values.items()})


def _batch(step: int, rank: int | None = None) -> list:
    samples = make_samples(8, seed=200 + step)
    return samples if rank is None else samples[rank * 4 : (rank + 1) * 4]


def _start(settings: TrainerSettings, sharding=None):
    """(TrainingModel, Learner) as Trainer.start builds them."""
    sharding = sharding or make_sharding("ddp", distributed=False)
    loaded = set_up_model(settings, torch.device("cpu"), sharding)
    learner = Learner(loaded.model, loaded.optimizer, LossConfig(beta=settings.beta, max_completion_length=8),
                      ref_model=loaded.ref_model, reference=loaded.reference, sharding=sharding,
                      train_mode=settings.gradient_checkpointing or settings.lora_dropout > 0)
    return loaded, learner


def _train(learner: Learner, step: int, rank: int | None = None) -> dict:
    k = 2 if rank is None else 1  # the same 8 samples in 2 micro-batches, or 4 per rank
    return learner.train_on_samples(_batch(step, rank), grad_accum_steps=k, lr=LR, step=step)


def _checkpoint(loaded, sharding, run_dir: Path, step: int) -> None:
    """Checkpoint `step` as Trainer._checkpoint writes one (every rank calls it)."""
    full = sharding.full_state_dict(loaded.model, trainable_only=True)
    tmp = ckpt.begin_checkpoint(run_dir, step) if sharding.is_main else ckpt.checkpoint_dir(run_dir) / f".tmp-step-{step}"
    sharding.barrier()
    sharding.save_optimizer(loaded.model, loaded.optimizer, tmp)
    sharding.barrier()
    if sharding.is_main:
        ckpt.commit_checkpoint(run_dir, step, tmp, model=loaded.model, state_dict=full,
                               write_weights=loaded.lora.checkpoint_writer(full), state=loaded.lora.record())
    sharding.barrier()


def _adapter(loaded, sharding=None) -> dict[str, torch.Tensor] | None:
    sharding = sharding or make_sharding("ddp", distributed=False)
    full = sharding.full_state_dict(loaded.model, trainable_only=True)
    return None if full is None else {n: t.clone() for n, t in full.items()}


def _logprobs(model, samples) -> torch.Tensor:
    mb = split_micro_batches(samples, 1)[0]
    with torch.no_grad():
        return forward_logprobs(model, mb, 1.0) * mb.loss_mask


def _base(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def _peft(model_dir: Path, adapter: Path):
    from peft import PeftModel

    return PeftModel.from_pretrained(_base(model_dir), str(adapter)).eval()


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """One uninterrupted LoRA run of two steps (a checkpoint after the first), then version 2
    published: what most tests below look at."""
    root = tmp_path_factory.mktemp("lora")
    settings = _settings(tiny_model_dir, root / "run", resume=False)
    loaded, learner = _start(settings)
    metrics = [_train(learner, 0)]
    _checkpoint(loaded, learner.sharding, settings.run_dir, 0)
    metrics.append(_train(learner, 1))
    published = loaded.lora.publish(root / "published", 2, learner.sharding.full_state_dict(loaded.model, trainable_only=True),
                                    dtype=torch.float32, step=1)
    optimizer = {i: {k: v.clone() for k, v in s.items()} for i, s in loaded.optimizer.state_dict()["state"].items()}
    return SimpleNamespace(root=root, settings=settings, loaded=loaded, metrics=metrics, published=published,
                           adapter=_adapter(loaded), optimizer=optimizer)


# -- settings ----------------------------------------------------------------------------------


def test_lora_settings_defaults_flags_and_refusals() -> None:
    plain = build(TrainerSettings, {"model": "m"})
    assert plain.lora_rank == 0 and LoraSpec.of(plain) is None
    spec = LoraSpec.of(load(TrainerSettings, ["--model", "m", "--lora-rank", "8",
                                               "--lora-target-modules", "q_proj,v_proj"]))
    assert spec == LoraSpec(rank=8, alpha=16, dropout=0.0, target_modules=("q_proj", "v_proj"))  # alpha: 2 x rank
    assert LoraSpec.of(build(TrainerSettings, {"model": "m", "lora_rank": "8"})).target_modules == DEFAULT_TARGET_MODULES
    assert LoraSpec.of(build(TrainerSettings, {"model": "m", "lora_rank": "8", "lora_alpha": "4"})).alpha == 4
    refused = {
        "lora_alpha set but lora_rank is 0": {"lora_alpha": "16"},
        "not on the output layer or the embeddings": {"lora_rank": "4", "lora_target_modules": "q_proj,lm_head"},
        "lora_target_modules is empty": {"lora_rank": "4", "lora_target_modules": ""},
        "give it alone": {"lora_rank": "4", "lora_target_modules": "all-linear,q_proj"},
        "lora-dropout.*less than 1": {"lora_rank": "4", "lora_dropout": "1.0"},
    }
    for message, values in refused.items():
        with pytest.raises(SettingsError, match=message):
            build(TrainerSettings, {"model": "m", **values})


def test_target_modules_against_the_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"\['c_attn'\].*linear layers are .*q_proj"):
        _start(_settings(tiny_model_dir, tmp_path, lora_target_modules="c_attn"))
    # all-linear: every projection, never the output layer; saved as the names it resolved to.
    loaded, _ = _start(_settings(tiny_model_dir, tmp_path, lora_target_modules="all-linear", beta=0))
    assert sorted(loaded.lora.peft_model.peft_config["default"].target_modules) == sorted(DEFAULT_TARGET_MODULES)
    assert not any("lm_head" in n for n, p in loaded.model.named_parameters() if p.requires_grad)


# -- the model, the steps, the reference ---------------------------------------------------------


def test_only_the_adapter_trains_in_float32_and_the_base_stays(trained, tiny_model_dir: Path) -> None:
    from safetensors.torch import load_file

    model, optimizer = trained.loaded.model, trained.loaded.optimizer
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * len(DEFAULT_TARGET_MODULES) * model.config.num_hidden_layers
    assert {p.dtype for p in trainable.values()} == {torch.float32}
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in trainable.values()]
    # Two steps later the base weights are the file's, bit for bit; the adapter moved.
    base = load_file(tiny_model_dir / "model.safetensors")
    frozen = {n.replace(".base_layer", ""): t for n, t in model.state_dict().items() if "lora_" not in n}
    assert set(base) <= set(frozen)
    assert all(torch.equal(frozen[n], base[n]) for n in base)
    assert all(trained.adapter[n].abs().max() > 0 for n in trained.adapter if ".lora_B." in n)
    # The KL term: nothing at the start (lora_B = 0: the policy is the base), then the adapter
    # moves away from a reference that stays the base.
    first, second = trained.metrics
    assert first["kl"] == pytest.approx(0.0, abs=1e-9) and second["kl"] > 1e-5


def test_the_reference_is_the_base_model_with_the_adapter_disabled(trained, tiny_model_dir: Path) -> None:
    model, reference = trained.loaded.model, trained.loaded.reference
    samples = _batch(5)
    base = _logprobs(_base(tiny_model_dir), samples)
    with reference():
        ref = _logprobs(model, samples)
    torch.testing.assert_close(ref, base, rtol=0.0, atol=1e-6)
    assert (_logprobs(model, samples) - base).abs().max() > 1e-3  # the adapter is back on, and matters
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)


def test_gradient_checkpointing_gives_the_adapter_the_same_gradients(tiny_model_dir: Path, tmp_path: Path) -> None:
    grads = []
    for checkpointing in (False, True):
        loaded, learner = _start(_settings(tiny_model_dir, tmp_path / str(checkpointing), beta=0.0,
                                           gradient_checkpointing=checkpointing))
        learner.model.train(checkpointing)
        mbs = split_micro_batches(_batch(0), 2)
        learner.accumulate(mbs, learner.global_normalizer(mbs))
        grads.append({n: p.grad for n, p in loaded.model.named_parameters() if p.requires_grad})
    assert all(g is not None for g in grads[1].values()), "an adapter parameter got no gradient"
    assert any(g.abs().max() > 0 for g in grads[1].values())
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7)


# -- publication -------------------------------------------------------------------------------


def test_published_version_is_the_adapter_alone_and_peft_computes_the_trainers_logprobs(trained,
                                                                                       tiny_model_dir: Path) -> None:
    from safetensors.torch import load_file

    path = trained.published
    assert is_adapter_dir(path)
    assert sorted(p.name for p in path.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS, ckpt.PUBLISHED_FILE]
    marker = json.loads((path / ckpt.PUBLISHED_FILE).read_text())
    assert marker["adapter"] is True and marker["version"] == 2 and marker["dtype"] == "float32"
    tensors = load_file(path / ADAPTER_WEIGHTS)
    assert len(tensors) == len(trained.adapter) and all(PEFT_KEY.match(k) for k in tensors), sorted(tensors)[:3]
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert config["target_modules"] == sorted(DEFAULT_TARGET_MODULES)
    assert config["base_model_name_or_path"] == str(tiny_model_dir.resolve())
    # What makes LoRA worth it: a version is a fraction of the model.
    assert marker["bytes"] < (tiny_model_dir / "model.safetensors").stat().st_size / 4

    # peft (and so a server loading the adapter) computes what the trainer computes.
    served = _peft(tiny_model_dir, path)
    samples = _batch(6)
    torch.testing.assert_close(_logprobs(served, samples), _logprobs(trained.loaded.model, samples),
                               rtol=0.0, atol=1e-6)
    # The probe sent with the version is base + adapter, which is what peft computes.
    mine, theirs = compute_probe(trained.loaded.model, IDS), compute_probe(served, IDS)
    assert mine["logprobs"][1:] == pytest.approx(theirs["logprobs"][1:], abs=1e-6)
    assert compute_probe(_base(tiny_model_dir), IDS)["logprobs"][1:] != pytest.approx(mine["logprobs"][1:], abs=1e-3)


def test_publish_dtype_applies_to_the_adapter(trained, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    path = trained.loaded.lora.publish(tmp_path, 3, trained.adapter, dtype=torch.bfloat16, step=2)
    assert {t.dtype for t in load_file(path / ADAPTER_WEIGHTS).values()} == {torch.bfloat16}
    assert json.loads((path / ckpt.PUBLISHED_FILE).read_text())["dtype"] == "bfloat16"
    bad = {**trained.adapter}
    name = next(iter(bad))
    bad[name] = torch.full_like(bad[name], float("nan"))
    with pytest.raises(ValueError, match="non-finite"):
        trained.loaded.lora.publish(tmp_path, 4, bad, dtype=torch.float32, step=3)
    assert not (tmp_path / "version-4").exists()


# -- checkpoints and resume ----------------------------------------------------------------------


def test_resume_from_an_adapter_checkpoint_continues_like_the_uninterrupted_run(trained,
                                                                               tiny_model_dir: Path) -> None:
    from safetensors.torch import load_file

    run_dir = trained.settings.run_dir
    step_dir = ckpt.step_path(run_dir, 0)
    assert is_adapter_dir(step_dir) and not (step_dir / "model.safetensors").exists()
    assert (step_dir / "optimizer.pt").is_file()
    assert {t.dtype for t in load_file(step_dir / ADAPTER_WEIGHTS).values()} == {torch.float32}
    state = ckpt.read_state(step_dir)
    assert state["lora"] == {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": list(DEFAULT_TARGET_MODULES)}
    assert state["base_model"] == str(tiny_model_dir.resolve())

    loaded, learner = _start(_settings(tiny_model_dir, run_dir))  # resume: the default
    assert loaded.start_step == 1 and loaded.resumed_from == step_dir
    metrics = _train(learner, 1)
    assert metrics["loss"] == trained.metrics[1]["loss"] and metrics["kl"] == trained.metrics[1]["kl"]
    adapter = _adapter(loaded)
    assert adapter.keys() == trained.adapter.keys()
    assert all(torch.equal(adapter[n], trained.adapter[n]) for n in adapter)
    state = loaded.optimizer.state_dict()["state"]
    assert state.keys() == trained.optimizer.keys()
    for i, moments in trained.optimizer.items():
        assert all(torch.equal(state[i][k], v) for k, v in moments.items()), i


def test_a_resume_that_disagrees_with_the_checkpoint_is_refused_saying_what_differs(trained, tiny_model_dir: Path,
                                                                                    tmp_path: Path) -> None:
    run_dir = trained.settings.run_dir
    refused = {
        "lora_rank 4 in the checkpoint, 8 now": {"lora_rank": 8},
        "lora_alpha 8 in the checkpoint, 4 now": {"lora_alpha": 4},
        "lora_target_modules q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj in the checkpoint, "
        "q_proj,v_proj now": {"lora_target_modules": "q_proj,v_proj"},
    }
    for message, overrides in refused.items():
        with pytest.raises(SettingsError, match=re.escape(message)):
            _start(_settings(tiny_model_dir, run_dir, **overrides))
    with pytest.raises(SettingsError, match="holds a LoRA adapter .*lora_rank 0"):
        _start(build(TrainerSettings, {"model": str(tiny_model_dir), "run_dir": str(run_dir)}))
    other = shutil.copytree(tiny_model_dir, tmp_path / "other-base")
    with pytest.raises(SettingsError, match=re.escape(f"model (the base) {tiny_model_dir.resolve()} in the checkpoint, "
                                                      f"{other} now")):
        _start(_settings(other, run_dir))
    # And a full fine-tuning checkpoint does not resume as a LoRA run.
    full_run = tmp_path / "full"
    ckpt.save_checkpoint(full_run, 0, _base(tiny_model_dir))
    with pytest.raises(SettingsError, match="full fine-tuning run, but this run trains a LoRA adapter"):
        _start(_settings(tiny_model_dir, full_run))


# -- two ranks -----------------------------------------------------------------------------------


def _rank_main(rank: int, model_dir: Path, store: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    out_dir, results = Path(out), {}
    try:
        for kind in ("ddp", "fsdp"):
            sharding = make_sharding(kind, distributed=True, rank=rank, world_size=WORLD)
            loaded, learner = _start(_settings(model_dir, out_dir / kind, sharding=kind, resume=False), sharding)
            results[f"{kind}_kl"] = [_train(learner, 0, rank)["kl"]]
            _checkpoint(loaded, sharding, out_dir / kind, 0)
            results[f"{kind}_kl"].append(_train(learner, 1, rank)["kl"])
            results[kind] = _adapter(loaded, sharding)
        # ddp's optimizer.pt into fsdp shards (matched by parameter name: peft's names).
        sharding = make_sharding("fsdp", distributed=True, rank=rank, world_size=WORLD)
        loaded, learner = _start(_settings(model_dir, out_dir / "ddp", sharding="fsdp"), sharding)
        results["ddp_to_fsdp_start"] = loaded.start_step
        _train(learner, 1, rank)
        results["ddp_to_fsdp"] = _adapter(loaded, sharding)
        torch.save(results, out_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ddp_and_fsdp_on_two_ranks_train_the_adapter_like_one_process(trained, tiny_model_dir: Path,
                                                                      tmp_path: Path) -> None:
    mp.start_processes(_rank_main, args=(tiny_model_dir, str(tmp_path / "store"), str(tmp_path)),
                       nprocs=WORLD, join=True, start_method="fork")
    rank0, rank1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert rank1["ddp"] is None and rank1["fsdp"] is None  # gathered on rank 0 only
    assert rank0["ddp_to_fsdp_start"] == 1
    for kind in ("ddp", "fsdp", "ddp_to_fsdp"):
        got = rank0[kind]
        assert got.keys() == trained.adapter.keys(), kind  # the adapter alone, gathered
        for name, want in trained.adapter.items():
            torch.testing.assert_close(got[name], want, rtol=0.0, atol=ADAPTER_ATOL, msg=lambda m, n=name: f"{kind} {n}: {m}")
    for kind in ("ddp", "fsdp"):
        assert rank0[f"{kind}_kl"] == pytest.approx([m["kl"] for m in trained.metrics], rel=1e-4, abs=1e-9)
    assert (tmp_path / "fsdp" / "checkpoints" / "step-0" / "optimizer" / ".metadata").is_file()

    # fsdp's sharded optimizer state and adapter resume in one process, as the same run.
    loaded, learner = _start(_settings(tiny_model_dir, tmp_path / "fsdp"))
    assert loaded.start_step == 1
    _train(learner, 1)
    resumed = _adapter(loaded)
    for name, want in trained.adapter.items():
        torch.testing.assert_close(resumed[name], want, rtol=0.0, atol=ADAPTER_ATOL)


# -- export --------------------------------------------------------------------------------------


def test_export_merge_writes_a_model_that_computes_base_plus_adapter(trained, tiny_model_dir: Path,
                                                                      tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    assert tandem(["export", str(trained.published), "--merge", "--out", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not names & {ADAPTER_CONFIG, ADAPTER_WEIGHTS} and not any(n.startswith(".tmp") for n in names)
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert not any("lora" in n for n in merged.state_dict())
    samples = _batch(7)
    want = _logprobs(_peft(tiny_model_dir, trained.published), samples)
    torch.testing.assert_close(_logprobs(merged, samples), want, rtol=0.0, atol=1e-5)
    assert (_logprobs(_base(tiny_model_dir), samples) - want).abs().max() > 1e-3  # the merge did something
    # A checkpoint of the run exports too: its trainer_state.json names the base.
    step_out = tmp_path / "from-checkpoint"
    assert tandem(["export", str(ckpt.step_path(trained.settings.run_dir, 0)), "--merge", "--out", str(step_out),
                   "--dtype", "bfloat16"]) == 0
    assert json.loads((step_out / "config.json").read_text())["dtype"] == "bfloat16"


def test_export_refuses_what_it_cannot_export_saying_what_to_do(trained, tiny_model_dir: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    from services.inference.init_model import init_model

    other = init_model(tmp_path / "small", preset="small", seed=0)
    cases = {
        "holds no LoRA adapter": [str(tiny_model_dir), "--merge"],
        "is a LoRA adapter, not a model: add --merge": [str(trained.published)],
        "does not fit base model": [str(trained.published), "--merge", "--base", str(other)],
    }
    for message, args in cases.items():
        out = tmp_path / "out"
        assert tandem(["export", *args, "--out", str(out)]) == 2, message
        assert message in capsys.readouterr().err
        assert not out.exists() and not list(tmp_path.glob(".tmp-*"))
    (tmp_path / "taken").mkdir()
    assert tandem(["export", str(trained.published), "--merge", "--out", str(tmp_path / "taken")]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_export_of_a_full_checkpoint_is_its_model_without_the_trainer_files(tiny_model_dir: Path,
                                                                          tmp_path: Path) -> None:
    model = _base(tiny_model_dir)
    step_dir = ckpt.save_checkpoint(tmp_path / "run", 0, model, model_dir=tiny_model_dir,
                                    optimizer=torch.optim.AdamW(model.parameters()))
    out = tmp_path / "exported"
    assert tandem(["export", str(step_dir), "--out", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not names & {"optimizer.pt", ckpt.STATE_FILE}
    samples = _batch(8)
    torch.testing.assert_close(_logprobs(_base(out), samples), _logprobs(model, samples), rtol=0.0, atol=0.0)
