"""The learner on a real tiny causal LM: logprobs, one step, gradient accumulation, mu > 1."""

from __future__ import annotations

import copy

import pytest
import torch

from services.trainer.collate import collate, split_micro_batches
from services.trainer import learner as learner_module
from services.trainer.learner import Learner, LossConfig, carrying_split, forward_logprobs
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


# -- steps that must leave the weights as they were -----------------------------------------


def _zero_advantages(samples):
    return [s.model_copy(update={"advantage": 0.0}) for s in samples]


def test_a_batch_without_advantage_signal_does_not_move_the_weights(base_model) -> None:
    """All advantages 0 (every group solved, or every group failed): the gradient is zero, but an
    AdamW step would still move the weights with its momentum and weight decay. Skipped, counted."""
    model = copy.deepcopy(base_model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    learner = Learner(model, opt, LossConfig(max_completion_length=8), max_grad_norm=1.0)
    learner.train_on_samples(make_samples(8), grad_accum_steps=2, lr=1e-2)  # momentum now non-zero
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    adam_steps = [s["step"].item() for s in opt.state.values()]

    metrics = learner.train_on_samples(_zero_advantages(make_samples(8, seed=5)), grad_accum_steps=2,
                                       num_iterations=2, lr=1e-2)
    assert metrics["skipped_no_signal"] == 1.0 and metrics["skipped_non_finite"] == 0.0
    assert metrics["grad_norm"] == 0.0 and metrics["loss"] == 0.0
    assert metrics["loss_tokens"] > 0 and metrics["logprob_mean"] < 0  # the forward's metrics are there
    moved = [name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])]
    assert not moved, moved
    assert [s["step"].item() for s in opt.state.values()] == adam_steps

    # A single non-zero advantage is signal again.
    samples = _zero_advantages(make_samples(8, seed=5))
    samples[3] = samples[3].model_copy(update={"advantage": 0.5})
    metrics = learner.train_on_samples(samples, grad_accum_steps=2, lr=1e-2)
    assert metrics["skipped_no_signal"] == 0.0 and metrics["grad_norm"] > 0


def _some_silent(samples):
    """Every other sample without advantage (a group all right, or all wrong)."""
    return [s.model_copy(update={"advantage": 0.0}) if i % 2 else s for i, s in enumerate(samples)]


def test_rows_without_advantage_are_split_off_and_never_backpropagated(base_model) -> None:
    samples = _some_silent(make_samples(8, seed=4))
    parts = carrying_split(split_micro_batches(samples, 2))
    carrying = sorted(i for p in parts if p.carries_gradient for i in p.indices)
    silent = sorted(i for p in parts if not p.carries_gradient for i in p.indices)
    assert carrying == [0, 2, 4, 6] and silent == [1, 3, 5, 7]
    for p in parts:  # each part's rows are its samples' rows, on the same window
        for row, i in enumerate(p.indices):
            assert float(p.advantages[row]) == pytest.approx(samples[i].advantage, rel=1e-6)
            assert p.input_ids[row, 0] == samples[i].prompt_token_ids[0]
    # A micro-batch with nothing to split off stays as it was.
    whole = split_micro_batches(make_samples(4, seed=4), 1)
    assert carrying_split(whole) == whole

    # The silent rows' forward builds no graph: a backward through one would raise.
    model = copy.deepcopy(base_model)
    learner = _learner(model)
    calls = []
    real = learner._logprobs

    def spy(m, mb):
        logp, outside = real(m, mb)
        calls.append((mb.carries_gradient, logp.requires_grad))
        return logp, outside

    learner._logprobs = spy
    learner.train_on_samples(samples, grad_accum_steps=2)
    assert sorted(calls) == [(False, False), (False, False), (True, True), (True, True)]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("extras", [{}, {"seq_reject_low": 0.9, "is_mode": "mask"}, {"importance_sampling_level": "sequence"}],
                         ids=["tis", "rejection", "gspo"])
def test_splitting_off_silent_rows_changes_neither_the_step_nor_the_metrics(base_model, monkeypatch, loss_type: str,
                                                                           extras: dict) -> None:
    """The same weights and the same metrics, two passes included, as forwarding every row with
    a graph: the split only leaves out work whose gradient is exactly zero."""
    samples = _some_silent(make_samples(12, seed=9))
    results = []
    for split in (True, False):
        if not split:
            monkeypatch.setattr(learner_module, "carrying_split", list)
        model = copy.deepcopy(base_model).double()
        metrics = _learner(model, loss_type=loss_type, **extras).train_on_samples(
            samples, grad_accum_steps=3, num_iterations=2, lr=1e-2, step=1)
        results.append((metrics, {name: p.detach().clone() for name, p in model.named_parameters()}))
    (got, got_weights), (want, want_weights) = results
    assert got.keys() == want.keys() and got["grad_norm"] > 0
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key
    for name in want_weights:
        torch.testing.assert_close(got_weights[name], want_weights[name], rtol=1e-9, atol=1e-12)


def test_kl_term_is_signal_without_advantages(base_model) -> None:
    model = copy.deepcopy(base_model)
    learner = _learner(model, beta=0.1)
    with torch.no_grad():
        next(model.parameters()).add_(0.01)  # away from the reference, so the KL term pulls back
    metrics = learner.train_on_samples(_zero_advantages(make_samples(8)), grad_accum_steps=1, lr=1e-3)
    assert metrics["skipped_no_signal"] == 0.0 and metrics["grad_norm"] > 0


@pytest.mark.parametrize("poison", ["reward", "logits"])
def test_a_non_finite_loss_or_gradient_skips_the_step(base_model, poison: str) -> None:
    model = copy.deepcopy(base_model)
    learner = _learner(model, loss_type="grpo")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    samples = make_samples(8)
    if poison == "reward":
        # A NaN advantage (the sampler drops these; defence in depth) makes the loss NaN.
        samples[2] = samples[2].model_copy(update={"advantage": float("nan")})
    else:
        # Weights that overflow in the forward: an infinite gradient norm.
        with torch.no_grad():
            model.lm_head.weight[5].fill_(float("inf"))
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
    metrics = learner.train_on_samples(samples, grad_accum_steps=2, lr=1e-3)
    assert metrics["skipped_non_finite"] == 1.0 and metrics["skipped_no_signal"] == 0.0
    assert not (torch.isfinite(torch.tensor(metrics["loss"])) and torch.isfinite(torch.tensor(metrics["grad_norm"])))
    moved = [name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])]
    assert not moved, moved
    assert all(p.grad is None for p in model.parameters())
    assert not learner.optimizer.state  # AdamW never stepped


def test_mask_truncated_completions_takes_them_out_of_the_loss(base_model) -> None:
    samples = make_samples(8)
    samples = [s.model_copy(update={"finish_reason": "length"}) if i % 2 else s for i, s in enumerate(samples)]
    kept = [s for s in samples if s.finish_reason != "length"]
    masked = _learner(copy.deepcopy(base_model), mask_truncated_completions=True).train_on_samples(
        samples, grad_accum_steps=1, lr=1e-3)
    assert masked["loss_tokens"] == sum(sum(s.loss_mask) for s in kept)
    plain = _learner(copy.deepcopy(base_model)).train_on_samples(samples, grad_accum_steps=1, lr=1e-3)
    assert plain["loss_tokens"] == sum(sum(s.loss_mask) for s in samples)


def test_sequence_level_importance_sampling_is_wired_through(base_model) -> None:
    """The setting reaches the loss: per-sequence truncated IS weights (the geometric mean over a
    completion's tokens) give another loss than per-token ones once completions have several tokens."""
    samples = make_samples(8)
    runs = {level: _learner(copy.deepcopy(base_model), importance_sampling_level=level).train_on_samples(
        samples, grad_accum_steps=2, lr=1e-2) for level in ("token", "sequence")}
    assert runs["token"]["loss"] != pytest.approx(runs["sequence"]["loss"], rel=1e-3)
    assert runs["token"]["loss_tokens"] == runs["sequence"]["loss_tokens"]
    with pytest.raises(ValueError, match="importance_sampling_level"):
        _learner(copy.deepcopy(base_model), importance_sampling_level="group").train_on_samples(
            samples, grad_accum_steps=1)


def test_truncation_reaches_the_logprobs_and_counts_tokens_outside_it(base_model) -> None:
    """The sampler's top_k reaches the learner's logprobs (pi_old, ratios, weights), and sampled
    tokens outside the trainer's truncated set are counted, with a finite loss and an applied step.
    make_samples draws completion tokens at random: under top_k 1 almost all are outside."""
    from shared.contract import Truncation

    samples = make_samples(8, seed=5)
    mb = collate(samples)
    plain = forward_logprobs(base_model, mb, temperature=1.0)
    truncated = forward_logprobs(base_model, mb, temperature=1.0, truncation=Truncation(top_k=1))
    live = mb.loss_mask > 0
    assert bool((truncated[live] > plain[live]).all()), "a softmax over fewer tokens gives every target more"

    model = copy.deepcopy(base_model)
    metrics = _learner(model, truncation=Truncation(top_k=1)).train_on_samples(samples, grad_accum_steps=2, lr=1e-3)
    assert 0.5 < metrics["outside_truncation_fraction"] <= 1.0
    assert metrics["skipped_non_finite"] == 0.0 and metrics["grad_norm"] > 0
    untruncated = _learner(copy.deepcopy(base_model)).train_on_samples(samples, grad_accum_steps=2, lr=1e-3)
    assert "outside_truncation_fraction" not in untruncated
