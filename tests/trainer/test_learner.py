"""The learner on a real tiny causal LM: logprobs, one step, gradient accumulation, mu > 1."""

from __future__ import annotations

import copy

import pytest
import torch

from services.trainer.collate import collate, split_micro_batches
from services.trainer.learner import Learner, LossConfig, forward_logprobs
from tests.trainer.conftest import make_samples


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)


def _learner(model, *, lr: float = 1e-3, **cfg) -> Learner:
    cfg.setdefault("max_completion_length", 8)
    loss_cfg = LossConfig(**cfg)
    ref = copy.deepcopy(model).requires_grad_(False) if loss_cfg.beta else None
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    return Learner(model, opt, loss_cfg, ref_model=ref, max_grad_norm=None)


def test_logprobs_match_a_per_sample_forward(base_model) -> None:
    samples = make_samples(5, seed=3)
    mb = collate(samples)
    got = forward_logprobs(base_model, mb, temperature=0.7)
    for row, s in enumerate(samples):
        ids = torch.tensor([s.prompt_token_ids + s.completion_token_ids])
        with torch.no_grad():
            logits = base_model(input_ids=ids).logits[0].float() / 0.7
        logprobs = torch.log_softmax(logits, -1)
        P = len(s.prompt_token_ids)
        expected = torch.stack([logprobs[P + k - 1, t] for k, t in enumerate(s.completion_token_ids)])
        col = P - 1 - mb.start
        torch.testing.assert_close(got[row, col : col + len(expected)].detach(), expected, atol=1e-5, rtol=1e-5)


def test_one_step_changes_every_parameter(base_model) -> None:
    model = copy.deepcopy(base_model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    learner = _learner(model, loss_type="grpo")
    metrics = learner.train_on_samples(make_samples(8), grad_accum_steps=2, lr=1e-3)
    unchanged = [name for name, p in model.named_parameters() if torch.equal(p.detach(), before[name])]
    assert not unchanged, f"parameters not updated by one step: {unchanged}"
    assert metrics["grad_norm"] > 0
    assert metrics["loss_tokens"] == sum(sum(s.loss_mask) for s in make_samples(8))
    assert 0 < metrics["is_weight_mean"] <= 2.0
    assert metrics["clip_fraction"] == 0.0  # ratio is exactly 1 on the first pass
    assert metrics["ratio_mean"] == pytest.approx(1.0)


def _grads(model, samples, k: int, **cfg) -> dict[str, torch.Tensor]:
    learner = _learner(model, **cfg)
    mbs = split_micro_batches(samples, k)
    learner.accumulate(mbs, learner.global_normalizer(mbs))
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("extras", [{"tis_cap": 2.0}, {"tis_cap": None, "beta": 0.05}], ids=["tis", "kl-no-tis"])
def test_grad_accumulation_equals_full_batch(base_model, loss_type: str, extras: dict) -> None:
    model = copy.deepcopy(base_model).double()
    samples = make_samples(8, seed=7)
    full = _grads(model, samples, 1, loss_type=loss_type, **extras)
    split = _grads(model, samples, 4, loss_type=loss_type, **extras)
    assert full.keys() == split.keys() and full
    for name in full:
        torch.testing.assert_close(split[name], full[name], rtol=1e-9, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
    assert any(g.abs().sum() > 0 for g in full.values())


def test_several_iterations_clip_against_the_first_pass(base_model) -> None:
    model = copy.deepcopy(base_model)
    # A large learning rate moves the policy far in one update, so pass 2 must clip.
    learner = _learner(model, lr=5e-2, loss_type="dapo", epsilon_low=0.01, epsilon_high=0.01)
    metrics = learner.train_on_samples(make_samples(8), grad_accum_steps=2, num_iterations=3)
    assert learner.optimizer.state[next(iter(learner.params))]["step"] == 3
    assert metrics["clip_fraction"] > 0
    assert metrics["grad_norm_last"] != metrics["grad_norm"]
