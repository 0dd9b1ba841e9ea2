"""Mixed precision: float32 master weights under bfloat16 compute keep small updates.

Stepping bfloat16 weights directly rounds every update smaller than half a bf16 ulp of the
weight away (a weight of 0.05 has an ulp of 2^-12 ~ 2.4e-4; AdamW at lr 1e-5 moves it by
~1e-5). The trainer keeps float32 parameters and AdamW state, and runs only the forward and
backward in bfloat16 (autocast). These tests train the same 30 steps at lr 1e-5 three ways.
"""

from __future__ import annotations

import copy

import pytest
import torch

from services.trainer.learner import Learner, LossConfig
from services.trainer.sharding import make_sharding
from tests.trainer.conftest import make_samples

STEPS = 30
LR = 1e-5


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)


def _train(model, compute_dtype) -> dict[str, float]:
    """30 steps on fixed batches; how far the weights moved (in float32)."""
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    sharding = make_sharding("single", distributed=False, device=torch.device("cpu"))
    model, _ = sharding.prepare(model, compute_dtype=compute_dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    learner = Learner(model, opt, LossConfig(max_completion_length=8), max_grad_norm=1.0, sharding=sharding)
    for step in range(STEPS):
        learner.train_on_samples(make_samples(8, seed=step), grad_accum_steps=2, lr=LR)
    moved = changed = total = 0.0
    for n, p in model.named_parameters():
        delta = p.detach().float() - before[n]
        moved += float(delta.norm()) ** 2
        changed += float((delta != 0).sum())
        total += delta.numel()
    return {"delta_norm": moved ** 0.5, "changed_fraction": changed / total}


@pytest.mark.slow
def test_bf16_compute_with_fp32_masters_moves_the_weights_like_fp32(base_model) -> None:
    fp32 = _train(copy.deepcopy(base_model), torch.float32)
    mixed_model = copy.deepcopy(base_model)
    mixed = _train(mixed_model, torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in mixed_model.parameters())
    assert fp32["changed_fraction"] > 0.95
    assert mixed["changed_fraction"] > 0.95, mixed
    assert 0.8 < mixed["delta_norm"] / fp32["delta_norm"] < 1.25, (mixed, fp32)

    # What the trainer did before: bf16 weights stepped directly. Most updates round away.
    naive = _train(copy.deepcopy(base_model).to(torch.bfloat16), torch.float32)
    assert naive["changed_fraction"] < 0.5 * mixed["changed_fraction"], (naive, mixed)
