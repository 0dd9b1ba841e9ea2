"""Sharding strategies (services/trainer/sharding.py) on the tiny model, CPU and gloo.

Two forked gloo ranks, each with half of the batch, run one job that exercises ddp and fsdp
(FSDP2); the tests compare what it wrote against a single process on the whole batch.
Every rank's loss is divided by the global normaliser, so summed gradients make the split
over ranks invisible: the same AdamW step, the same gradient norm, the same weights.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from services.trainer.collate import split_micro_batches
from services.trainer.learner import forward_logprobs
from services.trainer.loss import loss_normalizer, policy_loss
from services.trainer.sharding import KINDS, Sharding, decoder_layers, make_sharding
from tests.trainer.conftest import make_samples

WORLD = 2
N = 8  # samples per batch; rank r gets the contiguous half r
LR = 1e-3
BETA = 0.05  # exercises the (sharded) reference model too
MAX_NORM = 0.05  # below the batch's gradient norm (asserted), so clipping engages
ATOL = 1e-6
SMALL_GRAD = 1e-6  # 100 x AdamW's eps: below it the first step's size is ill-conditioned


def _batch(step: int) -> list:
    return make_samples(N, seed=100 + step)


def _share(samples: list, rank: int) -> list:
    per = len(samples) // WORLD
    return samples[rank * per : (rank + 1) * per]


def _optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def _step(model, ref, optimizer, sharding: Sharding, samples, *, k: int = 1, sync_every: bool = False,
          max_norm: float | None = MAX_NORM, grads: dict | None = None) -> float:
    """One learner-like optimizer step; returns the pre-clip gradient norm and puts the full
    reduced gradients, before clipping, into `grads` (a collective under fsdp)."""
    params = [p for p in model.parameters() if p.requires_grad]
    mbs = split_micro_batches(samples, k)
    local = sum(loss_normalizer("grpo", mb.tokens_per_sequence, None) for mb in mbs)
    normalizer = float(sharding.all_reduce(torch.tensor([local], dtype=torch.float64)).item())
    optimizer.zero_grad(set_to_none=True)
    for i, mb in enumerate(mbs):
        with torch.no_grad(), sharding.autocast():
            ref_logp = forward_logprobs(ref, mb, 1.0)
        sharding.set_gradient_sync(model, sync_every or i == len(mbs) - 1)
        with sharding.autocast():
            logp = forward_logprobs(model, mb, 1.0)
        out = policy_loss(logp, logp.detach(), mb.behaviour_logprobs, mb.advantages, mb.loss_mask,
                          loss_type="grpo", normalizer=normalizer, tis_cap=2.0, beta=BETA, ref=ref_logp)
        assert math.isfinite(float(out.loss.detach()))
        out.loss.backward()
    sharding.reduce_gradients(params)
    if grads is not None:
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[name] = g.detach().clone()
    norm = sharding.clip_grad_norm(params, max_norm)
    optimizer.step()
    return norm


def _build(base, sharding: Sharding, compute_dtype=torch.float32):
    model = copy.deepcopy(base)
    ref = copy.deepcopy(base)
    model, ref = sharding.prepare(model, compute_dtype=compute_dtype, ref_model=ref)
    return model, ref, _optimizer(model)


# -- the two-rank job ------------------------------------------------------------------------


def _rank_main(rank: int, base, store_path: str, out_dir: str) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    out = Path(out_dir)
    results: dict[str, object] = {}
    try:
        b0, b1 = _share(_batch(0), rank), _share(_batch(1), rank)

        ddp = make_sharding("ddp", distributed=True, rank=rank, world_size=WORLD, device="cpu")
        model, ref, opt = _build(base, ddp)
        results["ddp_grads"] = {}
        results["ddp_norm"] = _step(model, ref, opt, ddp, b0, grads=results["ddp_grads"])
        results["ddp"] = ddp.full_state_dict(model)
        ddp_ckpt = out / "ddp-ckpt"
        if rank == 0:
            ddp_ckpt.mkdir()
            # save_pretrained drops tied duplicates from the dict it is given: pass a copy.
            base.save_pretrained(ddp_ckpt, state_dict=dict(results["ddp"]), safe_serialization=True)
        ddp.save_optimizer(model, opt, ddp_ckpt)

        fsdp = make_sharding("fsdp", distributed=True, rank=rank, world_size=WORLD, device="cpu")
        model, ref, opt = _build(base, fsdp)
        results["fsdp_grads"] = {}
        results["fsdp_norm"] = _step(model, ref, opt, fsdp, b0, grads=results["fsdp_grads"])
        results["fsdp"] = fsdp.full_state_dict(model)

        # Save mid-run into a temporary directory that rank 0 renames (as checkpoints are).
        tmp, final = out / "tmp-ckpt", out / "ckpt"
        if rank == 0:
            tmp.mkdir()
        fsdp.barrier()
        assert not fsdp.load_optimizer(model, opt, tmp)  # nothing saved yet
        fsdp.save_optimizer(model, opt, tmp)
        if rank == 0:
            base.save_pretrained(tmp, state_dict=dict(results["fsdp"]), safe_serialization=True)
            os.rename(tmp, final)
        fsdp.barrier()
        results["fsdp_norm_2"] = _step(model, ref, opt, fsdp, b1)
        results["fsdp_2"] = fsdp.full_state_dict(model)

        # Resume sharded from the fsdp checkpoint; and from the ddp one (optimizer.pt).
        for name, ckpt in (("fsdp_resumed_2", final), ("ddp_to_fsdp_2", ddp_ckpt)):
            resumed = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
            resumed, ref = fsdp.prepare(resumed, compute_dtype=torch.float32, ref_model=copy.deepcopy(base))
            opt = _optimizer(resumed)
            results[f"{name}_loaded"] = fsdp.load_optimizer(resumed, opt, ckpt)
            _step(resumed, ref, opt, fsdp, b1)
            results[name] = fsdp.full_state_dict(resumed)

        for name, sync_every in (("accum", False), ("accum_sync_every", True)):
            model, ref, opt = _build(base, fsdp)
            results[f"{name}_grads"] = {}
            _step(model, ref, opt, fsdp, b0, k=2, sync_every=sync_every, grads=results[f"{name}_grads"])
            results[name] = fsdp.full_state_dict(model)

        # Activation (gradient) checkpointing, as `gradient_checkpointing` turns it on.
        model = copy.deepcopy(base)
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        model.train(True)  # transformers only checkpoints in train mode
        model, ref = fsdp.prepare(model, ref_model=copy.deepcopy(base))
        results["checkpointed_grads"] = {}
        _step(model, ref, _optimizer(model), fsdp, b0, k=2, grads=results["checkpointed_grads"])

        # bfloat16 compute: parameters, gradients and optimizer state stay float32.
        model, ref, opt = _build(base, fsdp, compute_dtype=torch.bfloat16)
        before = fsdp.full_state_dict(model)
        results["bf16_norm"] = _step(model, ref, opt, fsdp, b0)
        results["bf16_dtypes"] = sorted({str(p.dtype) for p in model.parameters()}
                                        | {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
                                        | {str(v.dtype) for s in opt.state.values() for v in s.values()
                                           if v.is_floating_point() and v.dim()})
        after = fsdp.full_state_dict(model)
        with torch.no_grad():  # a forward is collective under fsdp: every rank runs it
            results["bf16_logits"] = str(model(input_ids=torch.tensor([[5, 6, 7]])).logits.dtype)
        if rank == 0:
            results["bf16_dtypes_full"] = sorted({str(t.dtype) for t in after.values()})
            results["bf16_moved"] = all(not torch.equal(after[n], before[n]) for n in after)

        # A forward with no backward (the probe's) leaves the root module's parameters gathered,
        # where they are not the optimizer's: without reshard, saving its state fails (KeyError).
        with torch.no_grad():
            model(input_ids=torch.tensor([[5, 6, 7]]))
        results["gathered_after_forward"] = any(not hasattr(p, "to_local") for p in model.parameters())
        fsdp.reshard(model)
        results["sharded_after_reshard"] = all(hasattr(p, "to_local") for p in model.parameters())
        fsdp.save_optimizer(model, opt, out / "after-forward")

        # A non-finite gradient on one rank's shard is the global norm on every rank.
        for bad in (math.inf, math.nan):
            model, ref, opt = _build(base, fsdp)
            params = [p for p in model.parameters() if p.requires_grad]
            for p in params:
                p.grad = torch.zeros_like(p)
            if rank == 1:
                params[1].grad.to_local().view(-1)[0] = bad
            results[f"norm_{bad}"] = fsdp.clip_grad_norm(params, MAX_NORM)

        torch.save(results, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def base(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)


@pytest.fixture(scope="module")
def ranks(base, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path]:
    """The two ranks' results; forked before this process computes anything (fork-safe)."""
    out = tmp_path_factory.mktemp("sharding")
    mp.start_processes(_rank_main, args=(base, str(out / "store"), str(out)),
                       nprocs=WORLD, join=True, start_method="fork")
    return torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt"), out


@pytest.fixture(scope="module")
def single(base) -> dict:
    """The single process on the whole batch: two uninterrupted steps."""
    sharding = make_sharding("fsdp", distributed=False)
    model, ref, opt = _build(base, sharding)
    results: dict = {"grads": {}}
    results["norm"] = _step(model, ref, opt, sharding, _batch(0), grads=results["grads"])
    results["weights"] = sharding.full_state_dict(model)
    results["weights"] = {n: t.clone() for n, t in results["weights"].items()}
    results["norm_2"] = _step(model, ref, opt, sharding, _batch(1))
    results["weights_2"] = sharding.full_state_dict(model)
    return results


def _assert_same(got: dict, want: dict, what: str, rtol: float = 0.0, atol: float = ATOL) -> None:
    assert got is not None and got.keys() == want.keys(), what
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{what} {name}: {m}")


def _assert_same_first_step(got: dict, want: dict, grads: dict, what: str) -> None:
    """Weights after one AdamW step from the same start. That step moves each weight by about
    lr * g / (|g| + eps): where |g| is within a few orders of eps it turns float32 rounding of the
    gradient (another summation order over ranks, another CPU's kernels) into weight differences
    of up to lr: 1 of the 12288 elements of one matrix differed by 1.4e-6 (ATOL 1e-6) on this
    session's machine, on every run, and not on the previous one. Those elements are compared through their gradients
    (`_assert_same_gradients`); every other one must match to ATOL, and they must be almost all."""
    assert got.keys() == want.keys(), what
    for name in want:
        if name not in grads:  # a tied alias (lm_head.weight): compared as the parameter it is
            assert any(torch.equal(want[name], want[owner]) for owner in grads), f"{what} {name}: no gradient"
            continue
        conditioned = grads[name].abs() >= SMALL_GRAD
        assert conditioned.float().mean() > 0.98, f"{what} {name}: too few well-conditioned elements to compare"
        torch.testing.assert_close(got[name][conditioned], want[name][conditioned], rtol=0.0, atol=ATOL,
                                   msg=lambda m, name=name: f"{what} {name}: {m}")


def _assert_same_gradients(got: dict, want: dict, what: str) -> None:
    # Summed over ranks, not averaged: AdamW's first step hardly depends on the gradients'
    # scale, so the weights alone would not tell a sum from a mean.
    _assert_same(got, want, what, rtol=1e-5, atol=1e-6)


# -- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_two_ranks_step_like_one_process(kind: str, ranks, single, base) -> None:
    rank0, rank1, _ = ranks
    for results in (rank0, rank1):
        _assert_same_gradients(results[f"{kind}_grads"], single["grads"], kind)
    _assert_same_first_step(rank0[kind], single["weights"], single["grads"], kind)
    assert rank1[kind] is None  # full weights are gathered on rank 0 only
    assert not any(torch.equal(single["weights"][n], t) for n, t in base.state_dict().items())


def test_clip_grad_norm_is_the_global_norm_on_every_rank(ranks, single) -> None:
    rank0, rank1, _ = ranks
    assert single["norm"] > MAX_NORM  # so the steps above clipped
    for results in (rank0, rank1):
        for key in ("ddp_norm", "fsdp_norm"):
            assert results[key] == pytest.approx(single["norm"], rel=1e-6), key
        assert results["fsdp_norm_2"] == pytest.approx(single["norm_2"], rel=1e-6)
        assert math.isinf(results["norm_inf"])
        assert math.isnan(results["norm_nan"])


@pytest.mark.parametrize("name", ["accum", "accum_sync_every"])
def test_fsdp_gradient_accumulation(name: str, ranks, single) -> None:
    _assert_same_gradients(ranks[1][f"{name}_grads"], single["grads"], name)
    _assert_same_first_step(ranks[0][name], single["weights"], single["grads"], name)


def test_fsdp_with_activation_checkpointing(ranks, single) -> None:
    _assert_same_gradients(ranks[0]["checkpointed_grads"], single["grads"], "checkpointed")


def test_full_state_dict_round_trips_through_save_pretrained(ranks, base) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    rank0, _, out = ranks
    full = rank0["fsdp"]
    want = base.state_dict()
    assert full.keys() == want.keys()
    for name, tensor in want.items():
        assert full[name].shape == tensor.shape and full[name].dtype == torch.float32, name
        assert full[name].device.type == "cpu"
    # Tied weights are one tensor, as in model.state_dict(), and saved once.
    assert full["lm_head.weight"] is full["model.embed_tokens.weight"]
    with safe_open(str(out / "ckpt" / "model.safetensors"), "pt") as saved:
        assert "lm_head.weight" not in saved.keys() and "model.embed_tokens.weight" in saved.keys()
    loaded = AutoModelForCausalLM.from_pretrained(str(out / "ckpt"), dtype=torch.float32).state_dict()
    assert loaded.keys() == full.keys()
    for name in full:
        assert torch.equal(loaded[name], full[name]), name


def test_fsdp_resume_continues_like_an_uninterrupted_run(ranks, single) -> None:
    rank0, rank1, out = ranks
    assert rank0["fsdp_resumed_2_loaded"] and rank1["fsdp_resumed_2_loaded"]
    assert (out / "ckpt" / "optimizer" / ".metadata").is_file()
    assert len(list((out / "ckpt" / "optimizer").glob("*.distcp"))) == WORLD  # one shard per rank
    assert not (out / "ckpt" / "optimizer.pt").exists()
    _assert_same(rank0["fsdp_2"], single["weights_2"], "uninterrupted")
    _assert_same(rank0["fsdp_resumed_2"], single["weights_2"], "resumed")
    # A fresh optimizer's second step would differ: the loaded moments and step count matter.
    assert any(not torch.allclose(rank0["fsdp_2"][n], rank0["fsdp"][n]) for n in rank0["fsdp"])


def test_a_resume_may_change_the_sharding(ranks, single, base) -> None:
    """ddp's optimizer.pt resumes under fsdp; fsdp's sharded optimizer/ in one process."""
    from transformers import AutoModelForCausalLM

    rank0, rank1, out = ranks
    assert (out / "ddp-ckpt" / "optimizer.pt").is_file() and not (out / "ddp-ckpt" / "optimizer").exists()
    assert rank0["ddp_to_fsdp_2_loaded"] and rank1["ddp_to_fsdp_2_loaded"]
    _assert_same(rank0["ddp_to_fsdp_2"], single["weights_2"], "ddp -> fsdp")

    sharding = make_sharding("ddp", distributed=False)
    model = AutoModelForCausalLM.from_pretrained(str(out / "ckpt"), dtype=torch.float32)
    model, ref = sharding.prepare(model, ref_model=copy.deepcopy(base))
    opt = _optimizer(model)
    assert sharding.load_optimizer(model, opt, out / "ckpt")
    _step(model, ref, opt, sharding, _batch(1))
    _assert_same(sharding.full_state_dict(model), single["weights_2"], "fsdp -> single")


def test_fsdp_bf16_compute_keeps_float32_master_weights(ranks) -> None:
    rank0, rank1, _ = ranks
    for results in (rank0, rank1):
        assert results["bf16_dtypes"] == ["torch.float32"]
        assert math.isfinite(results["bf16_norm"]) and results["bf16_norm"] > 0
    assert rank0["bf16_dtypes_full"] == ["torch.float32"]
    assert rank0["bf16_logits"] == "torch.bfloat16"  # the forward did run in bfloat16
    assert rank0["bf16_moved"]


# -- the single process ----------------------------------------------------------------------


def test_make_sharding_without_a_process_group_is_single() -> None:
    for kind in KINDS:
        sharding = make_sharding(kind, distributed=False)
        assert sharding.kind == "single" and not sharding.distributed and sharding.is_main
    with pytest.raises(ValueError):
        make_sharding("zero3", distributed=False)
    with pytest.raises(ValueError):
        make_sharding("single", distributed=True, rank=0, world_size=2)
    with pytest.raises(RuntimeError):  # ddp/fsdp need the process group first
        make_sharding("ddp", distributed=True, rank=0, world_size=2)


def test_single_collectives_and_autocast() -> None:
    sharding = make_sharding("ddp", distributed=False)
    t = torch.tensor([1.0, 2.0])
    assert sharding.all_reduce(t) is t and sharding.all_reduce(t, "max") is t
    with pytest.raises(ValueError):
        sharding.all_reduce(t, "mean")
    assert sharding.broadcast_object({"a": 1}) == {"a": 1}
    sharding.prepare(torch.nn.Linear(2, 2), compute_dtype=torch.bfloat16)
    with sharding.autocast("cpu"):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
    sharding.prepare(torch.nn.Linear(2, 2), compute_dtype=torch.float32)
    with sharding.autocast("cpu"):
        assert not torch.is_autocast_enabled("cpu")


def test_single_clip_grad_norm() -> None:
    sharding = make_sharding("ddp", distributed=False)
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    assert sharding.clip_grad_norm([p], None) == pytest.approx(5.0)
    assert torch.equal(p.grad, torch.tensor([3.0, 4.0, 0.0, 0.0]))
    assert sharding.clip_grad_norm([p], 1.0) == pytest.approx(5.0)
    assert float(p.grad.norm()) == pytest.approx(1.0, rel=1e-5)
    p.grad = torch.tensor([math.inf, 0.0, 0.0, 0.0])
    assert math.isinf(sharding.clip_grad_norm([p], 1.0))
    p.grad = torch.tensor([math.nan, 0.0, 0.0, 0.0])
    assert math.isnan(sharding.clip_grad_norm([p], None))


def test_single_optimizer_round_trip(base, tmp_path: Path) -> None:
    sharding = make_sharding("ddp", distributed=False)
    model, ref, opt = _build(base, sharding)
    assert not sharding.load_optimizer(model, opt, tmp_path)
    _step(model, ref, opt, sharding, make_samples(2))
    sharding.save_optimizer(model, opt, tmp_path)
    fresh = _optimizer(model)
    assert sharding.load_optimizer(model, fresh, tmp_path)
    a, b = opt.state_dict(), fresh.state_dict()
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for key in a["state"]:
        for name, value in a["state"][key].items():
            assert torch.equal(value, b["state"][key][name]), (key, name)


def test_decoder_layers(base) -> None:
    assert decoder_layers(base) == list(base.model.layers)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(2, 2)

    class FooDecoderLayer(Block):
        pass

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([FooDecoderLayer(), FooDecoderLayer()])
            self.head = torch.nn.Linear(2, 2)

    net = Net()
    assert decoder_layers(net) == [net.blocks[1], net.blocks[0]]
    net._no_split_modules = ["Linear"]
    assert set(decoder_layers(net)) == {net.blocks[0].inner, net.blocks[1].inner, net.head}


def test_reshard_after_a_forward_only_pass(ranks) -> None:
    for results in ranks[:2]:
        assert results["gathered_after_forward"]  # what makes reshard necessary
        assert results["sharded_after_reshard"]
    assert (ranks[2] / "after-forward" / "optimizer" / ".metadata").is_file()
