"""Two gloo ranks, each with half the batch, produce the single-process full-batch gradient.

Each rank's loss is divided by the *global* normaliser (all-reduced) and gradients are
summed over ranks, so the split over ranks is as invisible as the split into micro-batches.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.trainer.collate import split_micro_batches
from services.trainer.learner import Learner, LossConfig
from services.trainer.sharding import make_sharding
from tests.trainer.conftest import make_samples

LOSSES = ("grpo", "dapo", "dr_grpo")
WORLD = 2


def _gradients(model, samples, k: int, loss_type: str, distributed: bool) -> dict[str, torch.Tensor]:
    cfg = LossConfig(loss_type=loss_type, tis_cap=2.0, max_completion_length=8)
    rank = dist.get_rank() if distributed else 0
    sharding = make_sharding("ddp", distributed=distributed, rank=rank, world_size=WORLD if distributed else 1)
    learner = Learner(model, torch.optim.SGD(model.parameters(), lr=0.0), cfg, sharding=sharding)
    mbs = split_micro_batches(samples, k)
    learner.accumulate(mbs, learner.global_normalizer(mbs))
    learner.sharding.reduce_gradients(learner.params)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# Token masking and sequence rejection decide what carries loss from each rank's forward: the
# normaliser is summed over ranks after the forwards and the gradients divided by it.
MASKING = {"is_mode": "mask", "is_low": 0.8, "is_high": 1.25, "seq_reject_low": 0.85, "seq_reject_high": 1.15}


def _masked_gradients(model, samples, k: int, loss_type: str, distributed: bool) -> dict[str, torch.Tensor]:
    cfg = LossConfig(loss_type=loss_type, max_completion_length=8, **MASKING)
    rank = dist.get_rank() if distributed else 0
    sharding = make_sharding("ddp", distributed=distributed, rank=rank, world_size=WORLD if distributed else 1)
    learner = Learner(model, torch.optim.SGD(model.parameters(), lr=0.0), cfg, sharding=sharding)
    metrics = learner.train_on_samples(samples, grad_accum_steps=k)
    assert 0 < metrics["kept_tokens"] < metrics["loss_tokens"]  # some taken out, some kept
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rank_main(rank: int, base, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        model = copy.deepcopy(base)
        samples = make_samples(8, seed=11)
        share = samples[rank * 4 : (rank + 1) * 4]  # the sampler's contiguous rank share
        for loss_type in LOSSES:
            grads = _gradients(model, share, 2, loss_type, distributed=True)
            masked = _masked_gradients(model, share, 2, loss_type, distributed=True)
            if rank == 0:
                torch.save(grads, Path(out_dir) / f"{loss_type}.pt")
                torch.save(masked, Path(out_dir) / f"{loss_type}-masked.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_equal_the_full_batch_gradient(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float64)
    # fork: the ranks inherit the imported modules and the loaded model (spawn would spend
    # most of the test re-importing transformers); no process group exists in the parent.
    mp.start_processes(_rank_main, args=(base, str(tmp_path / "store"), str(tmp_path)),
                       nprocs=WORLD, join=True, start_method="fork")
    samples = make_samples(8, seed=11)
    for loss_type in LOSSES:
        for kind, gradients in (("", _gradients), ("-masked", _masked_gradients)):
            full = gradients(copy.deepcopy(base), samples, 1, loss_type, distributed=False)
            split = torch.load(tmp_path / f"{loss_type}{kind}.pt")
            assert split.keys() == full.keys()
            for name in full:
                torch.testing.assert_close(split[name], full[name], rtol=1e-9, atol=1e-12,
                                           msg=lambda m, loss_type=loss_type, name=name: f"{loss_type}{kind} {name}: {m}")
