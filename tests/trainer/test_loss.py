"""Losses against values worked out by hand on tiny tensors (with masks and padding)."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.loss import (
    importance_weights,
    k3_kl,
    loss_normalizer,
    policy_loss,
    token_logprobs,
)

ln = math.log

# Two sequences, window of 3 tokens; row 0 has 2 loss tokens, row 1 has 1 (the rest is padding).
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
BEHAVIOUR = torch.tensor([[ln(0.4), ln(0.5), -9.0], [ln(0.5), -9.0, -9.0]])
ADV = torch.tensor([1.0, -2.0])


def _logp() -> torch.Tensor:
    # Padding positions hold junk values: they must not matter.
    return torch.tensor([[ln(0.5), ln(0.25), 3.0], [ln(0.5), 7.0, -1.0]], requires_grad=True)


# Ratio against behaviour (tis off): row 0 ratios 1.25 (A>0: clipped to 1.2), 0.5 (A>0:
# min(0.5, 0.8) = 0.5); row 1 ratio 1 with A=-2. Token losses: -1.2, -0.5 | 2.
@pytest.mark.parametrize(
    "loss_type, normalizer, expected",
    [
        ("grpo", 2.0, ((-1.2 - 0.5) / 2 + 2.0) / 2),  # per-sequence means, then mean: 0.575
        ("dapo", 3.0, (-1.2 - 0.5 + 2.0) / 3),  # token mean over the batch: 0.1
        ("dr_grpo", 2 * 4.0, (-1.2 - 0.5 + 2.0) / (2 * 4)),  # sum / (N * L) with L = 4
    ],
)
def test_clipped_loss_by_hand(loss_type: str, normalizer: float, expected: float) -> None:
    logp = _logp()
    out = policy_loss(logp, logp.detach(), BEHAVIOUR, ADV, MASK, loss_type=loss_type,
                      normalizer=normalizer, epsilon_low=0.2, tis_cap=None)
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert out.tokens == 3
    assert out.clipped == 1  # only row 0 token 0 took the clipped branch
    out.loss.backward()
    grad = logp.grad
    # d/dlogp of -r*A is -r*A; the clipped token and the padding get none.
    per_token = torch.tensor([[0.0, -0.5, 0.0], [2.0, 0.0, 0.0]])
    if loss_type == "grpo":
        scale = torch.tensor([[1 / 2, 1 / 2, 0], [1.0, 0, 0]]) / normalizer
    else:
        scale = MASK / normalizer
    torch.testing.assert_close(grad, per_token * scale)


def test_normalizer_matches_hand_values() -> None:
    tokens = MASK.sum(-1)
    assert loss_normalizer("grpo", tokens, None) == 2
    assert loss_normalizer("dapo", tokens, None) == 3
    assert loss_normalizer("dr_grpo", tokens, 4) == 8
    # A sequence without loss tokens does not count for grpo, but does for dr_grpo.
    with_empty = torch.tensor([2.0, 0.0, 1.0])
    assert loss_normalizer("grpo", with_empty, None) == 2
    assert loss_normalizer("dr_grpo", with_empty, 4) == 12
    with pytest.raises(ValueError, match="max_completion_length"):
        loss_normalizer("dr_grpo", tokens, None)


def test_asymmetric_clip_bounds() -> None:
    # ratio 1.25 with A > 0: clipped at 1 + eps_high = 1.3 -> not clipped; 1.28 -> clipped at 1.25.
    logp = torch.tensor([[ln(0.5)]], requires_grad=True)
    behaviour = torch.tensor([[ln(0.4)]])
    one = torch.ones(1, 1)
    out = policy_loss(logp, logp, behaviour, torch.tensor([1.0]), one, loss_type="dapo", normalizer=1,
                      epsilon_low=0.2, epsilon_high=0.3, tis_cap=None)
    assert out.loss.item() == pytest.approx(-1.25)
    out = policy_loss(logp, logp, torch.tensor([[ln(0.5 / 1.28)]]), torch.tensor([1.0]), one, loss_type="dapo",
                      normalizer=1, epsilon_low=0.2, epsilon_high=0.25, tis_cap=None)
    assert out.loss.item() == pytest.approx(-1.25)
    # A < 0 and ratio 0.5: the lower bound 1 - eps_low = 0.8 binds: max(-0.5, -0.8)... loss = 0.8.
    out = policy_loss(logp, logp, torch.tensor([[ln(1.0)]]), torch.tensor([-1.0]), one, loss_type="dapo",
                      normalizer=1, epsilon_low=0.2, epsilon_high=0.3, tis_cap=None)
    assert out.loss.item() == pytest.approx(0.8)


def test_truncated_importance_sampling_by_hand() -> None:
    # pi_old / mu = 0.5/0.1 = 5 -> capped at 2; 0.3/0.2 = 1.5 stays. Ratio vs old is 1.
    old = torch.tensor([[ln(0.5), ln(0.3)]])
    behaviour = torch.tensor([[ln(0.1), ln(0.2)]])
    logp = old.clone().requires_grad_(True)
    out = policy_loss(logp, old, behaviour, torch.tensor([1.0]), torch.ones(1, 2), loss_type="dapo",
                      normalizer=2, tis_cap=2.0)
    assert out.loss.item() == pytest.approx((-2.0 - 1.5) / 2)
    assert out.is_weight_sum == pytest.approx(3.5)
    assert out.is_weight_max == pytest.approx(2.0)
    assert out.is_truncated == 1
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -0.75]]))


def test_importance_weights_truncate_and_disable() -> None:
    old = torch.tensor([0.0, 0.0, 0.0, 0.0])
    behaviour = torch.tensor([-5.0, -0.1, 0.3, -1000.0])
    w = importance_weights(old, behaviour, 2.0)
    torch.testing.assert_close(w, torch.tensor([2.0, math.exp(0.1), math.exp(-0.3), 2.0]))
    assert torch.isfinite(w).all()  # exp(1000) would overflow without clamping first
    assert not w.requires_grad
    torch.testing.assert_close(importance_weights(old, behaviour, None), torch.ones(4))


def test_kl_k3_by_hand() -> None:
    # logp = ln .5, ref = ln .25: delta = ln .5; k3 = .5 - ln .5 - 1 = 0.19315.
    logp = torch.tensor([[ln(0.5), ln(0.5)]], requires_grad=True)
    ref = torch.tensor([[ln(0.25), ln(0.5)]])
    expected = 0.5 - ln(0.5) - 1
    torch.testing.assert_close(k3_kl(logp.detach(), ref), torch.tensor([[expected, 0.0]]))
    # With A = 0 only the KL term is left: dapo mean of beta * k3 over the 2 tokens.
    out = policy_loss(logp, logp.detach(), logp.detach(), torch.tensor([0.0]), torch.ones(1, 2),
                      loss_type="dapo", normalizer=2, tis_cap=2.0, beta=0.1, ref=ref)
    assert out.loss.item() == pytest.approx(0.1 * expected / 2)
    assert out.kl_sum == pytest.approx(expected)
    with pytest.raises(ValueError, match="reference"):
        policy_loss(logp, logp, logp, torch.tensor([0.0]), torch.ones(1, 2), loss_type="dapo",
                    normalizer=2, beta=0.1)


def test_token_logprobs_with_temperature() -> None:
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]]])
    targets = torch.tensor([[0, 2]])
    got = token_logprobs(logits, targets, temperature=0.5)
    scaled = logits / 0.5
    row0 = scaled[0, 0, 0] - torch.log(torch.exp(scaled[0, 0]).sum())
    row1 = scaled[0, 1, 2] - torch.log(torch.exp(scaled[0, 1]).sum())
    torch.testing.assert_close(got, torch.stack([row0, row1]).unsqueeze(0))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, targets, temperature=0.0)


def test_empty_batch_gives_zero_loss() -> None:
    logp = _logp()
    out = policy_loss(logp, logp.detach(), BEHAVIOUR, ADV, torch.zeros_like(MASK), loss_type="grpo",
                      normalizer=0, tis_cap=2.0)
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert torch.count_nonzero(logp.grad) == 0
