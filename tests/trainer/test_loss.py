"""Losses against values worked out by hand on tiny tensors (with masks and padding)."""

from __future__ import annotations

import math

import pytest
import torch

from shared.contract import Truncation
from shared.truncation import truncate_

from services.trainer.logprobs import token_logprobs, truncated_token_logprobs
from services.trainer.loss import (
    importance_weights,
    k3_kl,
    loss_normalizer,
    policy_loss,
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


# -- token_logprobs: chunked forward and backward against float64 autograd ---------------


def _reference_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """The plain float64 computation: log_softmax, then pick the target."""
    scaled = logits.double() / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _logits_case(dtype: torch.dtype = torch.float32, B: int = 3, T: int = 5, V: int = 11) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    # One position more than scored, so the scored logits are the non-contiguous slice
    # `full[:, :-1]` the learner passes.
    full = (torch.randn(B, T + 1, V, generator=gen, dtype=torch.float64) * 3).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=gen)
    grad_out = torch.randn(B, T, generator=gen, dtype=torch.float64)
    return full, targets, grad_out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_float64_reference(temperature: float) -> None:
    full, targets, _ = _logits_case()
    logits = full[:, :-1]
    assert not logits.is_contiguous()
    got = token_logprobs(logits, targets, temperature, chunk_size=4)  # chunks straddle rows (T = 5)
    assert got.dtype == torch.float32 and got.shape == (3, 5)
    torch.testing.assert_close(got.double(), _reference_logprobs(logits, targets, temperature), rtol=1e-6, atol=1e-6)


def test_chunked_logprobs_gradcheck_float64() -> None:
    full, targets, _ = _logits_case(torch.float64, B=2, T=3, V=5)
    full.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x[:, :-1], targets, 0.7, chunk_size=2), (full,))


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 2**-8)])
def test_chunked_logprobs_gradient_equals_reference_autograd(dtype: torch.dtype, tol: float) -> None:
    full, targets, grad_out = _logits_case(dtype)
    ours = full.clone().requires_grad_(True)
    token_logprobs(ours[:, :-1], targets, 0.7, chunk_size=4).backward(grad_out.to(torch.promote_types(dtype, torch.float32)))
    # The reference sees the same (already rounded) logits, upcast to float64.
    ref = full.double().requires_grad_(True)
    _reference_logprobs(ref[:, :-1], targets, 0.7).backward(grad_out)
    assert ours.grad.dtype == dtype  # no float32 gradient of bf16 logits
    # Ours is computed in float32 (float64 for float64 logits) and rounded once to the logits' dtype.
    torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=tol, atol=tol)
    assert torch.count_nonzero(ours.grad[:, -1]) == 0  # the unscored last position


def test_chunk_size_does_not_change_results() -> None:
    full, targets, grad_out = _logits_case(torch.bfloat16)
    n = targets.numel()
    results = []
    for chunk_size in (1, 3, n, 4 * n):
        logits = full.clone().requires_grad_(True)
        value = token_logprobs(logits[:, :-1], targets, 0.7, chunk_size=chunk_size)
        value.backward(grad_out.float())
        results.append((value.detach(), logits.grad))
    for value, grad in results[1:]:
        assert torch.equal(value, results[0][0])
        assert torch.equal(grad, results[0][1])
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(full, torch.zeros(3, 6, dtype=torch.long), chunk_size=0)


def test_chunked_logprobs_without_grad_keep_nothing() -> None:
    # The reference and pi_old passes run under no_grad: no graph, same values.
    full, targets, _ = _logits_case()
    with torch.no_grad():
        got = token_logprobs(full[:, :-1], targets, 1.0, chunk_size=2)
    assert got.grad_fn is None
    torch.testing.assert_close(got.double(), _reference_logprobs(full[:, :-1], targets, 1.0), rtol=1e-6, atol=1e-6)


# -- token_logprobs under the sampler's truncation (shared/truncation.py) ----------------

TRUNCATION = Truncation(top_k=6, top_p=0.8, min_p=0.01)


def _reference_truncated(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                         truncation: Truncation) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 autograd: mask the scaled logits to the truncated set (the target kept in),
    log_softmax, pick the target; and whether the target was outside the set."""
    scaled = logits.double() / temperature
    flat = scaled.reshape(-1, scaled.shape[-1])
    with torch.no_grad():
        dropped = truncate_(flat.detach().clone(), truncation.top_k, truncation.top_p, truncation.min_p)
    t = targets.reshape(-1, 1)
    outside = dropped.gather(1, t).squeeze(1)
    keep = ~dropped.scatter(1, t, False)
    logp = torch.log_softmax(flat.masked_fill(~keep, float("-inf")), dim=-1).gather(1, t).squeeze(1)
    return logp.view(targets.shape), outside.view(targets.shape)


def test_truncated_logprobs_are_the_renormalised_ones() -> None:
    full, targets, _ = _logits_case(B=4, T=6, V=40)
    logits = full[:, :-1]
    # Targets drawn from the truncated distribution itself, as the sampler draws them.
    flat = (logits.double() / 0.7).reshape(-1, 40).clone()
    truncate_(flat, TRUNCATION.top_k, TRUNCATION.top_p, TRUNCATION.min_p)
    targets = torch.multinomial(torch.softmax(flat, -1), 1, generator=torch.Generator().manual_seed(1)).view(4, 6)
    got, outside = truncated_token_logprobs(logits, targets, 0.7, chunk_size=5, truncation=TRUNCATION)
    assert not outside.any()
    want = torch.log_softmax(flat, -1).gather(1, targets.reshape(-1, 1)).view(4, 6)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    # Untruncated scoring of the same tokens is clearly lower (the sampler's logprobs are renormalised).
    untruncated = token_logprobs(logits, targets, 0.7)
    assert float((got - untruncated).mean()) > 0.05


def test_a_target_outside_the_set_is_flagged_and_stays_finite() -> None:
    full, targets, _ = _logits_case(B=3, T=5, V=30)
    logits = full[:, :-1]  # uniform random targets: many outside top_k 6 / top_p 0.8
    got, outside = truncated_token_logprobs(logits, targets, 0.7, chunk_size=4, truncation=TRUNCATION)
    want, want_outside = _reference_truncated(logits, targets, 0.7, TRUNCATION)
    assert torch.equal(outside, want_outside) and 0 < int(outside.sum()) < outside.numel()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    # Inactive settings are the untruncated computation, bit for bit.
    plain = token_logprobs(logits, targets, 0.7, chunk_size=4)
    assert torch.equal(token_logprobs(logits, targets, 0.7, chunk_size=4, truncation=Truncation()), plain)


def test_truncated_logprobs_gradient_equals_reference_autograd() -> None:
    full, targets, grad_out = _logits_case(torch.float64, B=3, T=5, V=30)
    ours = full.clone().requires_grad_(True)
    truncated_token_logprobs(ours[:, :-1], targets, 0.7, chunk_size=4, truncation=TRUNCATION)[0].backward(grad_out)
    ref = full.clone().requires_grad_(True)
    _reference_truncated(ref[:, :-1], targets, 0.7, TRUNCATION)[0].backward(grad_out)
    torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-12, atol=1e-12)
    # Tokens outside the set (other than the target) get no gradient.
    assert int((ours.grad == 0).sum()) > full.shape[0] * full.shape[2]


# -- masked positions cannot leak ---------------------------------------------------------

POISON = [-9999.0, float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("tis_cap", [None, 2.0])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_poisoned_masked_positions_change_nothing(level: str, tis_cap: float | None, loss_type: str) -> None:
    gen = torch.Generator().manual_seed(3)
    B, T = 3, 6
    mask = (torch.rand(B, T, generator=gen) > 0.4).float()
    mask[2] = 0.0  # one sequence without loss tokens at all
    masked = mask == 0
    clean = {name: -2.0 + 0.3 * torch.randn(B, T, generator=gen) for name in ("logp", "old", "behaviour", "ref")}
    advantages = torch.randn(B, generator=gen)

    def run(values: dict[str, torch.Tensor]) -> tuple:
        logp = values["logp"].clone().requires_grad_(True)
        out = policy_loss(logp, values["old"], values["behaviour"], advantages, mask, loss_type=loss_type,
                          normalizer=3.0, tis_cap=tis_cap, beta=0.05, ref=values["ref"],
                          importance_sampling_level=level)
        out.loss.backward()
        metrics = (out.tokens, out.clipped, out.is_weight_sum, out.is_weight_max, out.is_truncated,
                   out.kl_sum, out.ratio_sum)
        return out.loss.detach(), logp.grad, metrics

    want = run(clean)
    assert torch.isfinite(want[0]) and all(math.isfinite(m) for m in want[2])
    for poison in POISON:
        for name in clean:  # one input at a time, then all of them
            dirty = dict(clean, **{name: clean[name].masked_fill(masked, poison)})
            got = run(dirty)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2] == want[2], (poison, name)
        got = run({name: x.masked_fill(masked, poison) for name, x in clean.items()})
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2] == want[2], poison


# -- sequence-level importance sampling (GSPO) --------------------------------------------


def _sequence_level_by_hand(logp, old, behaviour, advantages, mask, *, loss_type, normalizer, eps_low, eps_high,
                            cap):
    """Sequence-level loss, d loss / d logp and metrics, one sample at a time in python floats."""
    B, T = len(logp), len(logp[0])
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    metrics = {"tokens": 0, "clipped": 0, "is_truncated": 0, "is_weight_sum": 0.0, "ratio_sum": 0.0}
    anchor = old if cap is not None else behaviour
    for i in range(B):
        loss_tokens = [t for t in range(T) if mask[i][t]]
        n = len(loss_tokens)
        if not n:
            continue
        s = math.exp(sum(logp[i][t] - anchor[i][t] for t in loss_tokens) / n)
        w, truncated = 1.0, False
        if cap is not None:
            raw = math.exp(sum(old[i][t] - behaviour[i][t] for t in loss_tokens) / n)
            w, truncated = min(raw, cap), raw >= cap
        a = advantages[i]
        c = min(max(s, 1 - eps_low), 1 + eps_high)
        took_clip = c * a < s * a
        per_token = -w * min(s * a, c * a)
        # Each of the n tokens carries per_token: grpo averages them per sequence, dapo sums.
        share = (1.0 if loss_type == "grpo" else n) / normalizer
        loss += share * per_token
        d_per_token_d_s = 0.0 if took_clip else -w * a
        for t in loss_tokens:
            grad[i][t] = share * d_per_token_d_s * s / n  # ds/dlogp_it = s / n
        metrics["tokens"] += n
        metrics["clipped"] += n * took_clip
        metrics["is_truncated"] += n * truncated
        metrics["is_weight_sum"] += n * w
        metrics["ratio_sum"] += n * s
    return loss, grad, metrics


@pytest.mark.parametrize("tis_cap", [None, 1.3])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_sequence_level_matches_per_sample_computation(tis_cap: float | None, loss_type: str) -> None:
    gen = torch.Generator().manual_seed(7)
    B, T = 6, 5
    mask = (torch.rand(B, T, generator=gen) > 0.3).float()
    mask[0] = 0.0
    mask[1] = torch.tensor([0.0, 1, 0, 0, 0])
    # Per-sequence offsets of log(old / behaviour) and log(pi / old), plus token noise, so that
    # some sequences are clipped (rows 4, 5), some truncated (rows 1, 3) and some neither.
    log_w = torch.tensor([0.0, 0.5, 0.0, 0.4, 0.0, -0.2]).unsqueeze(-1)
    log_r = torch.tensor([0.0, 0.1, -0.1, 0.05, 0.4, -0.3]).unsqueeze(-1)
    behaviour = -1.5 + 0.5 * torch.randn(B, T, generator=gen)
    old = behaviour + log_w + 0.05 * torch.randn(B, T, generator=gen)
    logp0 = old + log_r + 0.05 * torch.randn(B, T, generator=gen)
    advantages = torch.tensor([1.0, -1.0, 2.0, -0.5, 1.5, -2.0])
    normalizer = loss_normalizer(loss_type, mask.sum(-1), None)
    logp = logp0.clone().requires_grad_(True)
    out = policy_loss(logp, old, behaviour, advantages, mask, loss_type=loss_type, normalizer=normalizer,
                      epsilon_low=0.2, epsilon_high=0.28, tis_cap=tis_cap, importance_sampling_level="sequence")
    out.loss.backward()
    loss, grad, metrics = _sequence_level_by_hand(
        logp0.tolist(), old.tolist(), behaviour.tolist(), advantages.tolist(), mask.tolist(),
        loss_type=loss_type, normalizer=normalizer, eps_low=0.2, eps_high=0.28, cap=tis_cap)
    assert out.loss.item() == pytest.approx(loss, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(logp.grad, torch.tensor(grad), rtol=1e-5, atol=1e-6)
    assert 0 < metrics["clipped"] < metrics["tokens"]  # the case exercises both branches
    if tis_cap is not None:
        assert 0 < metrics["is_truncated"] < metrics["tokens"]
    for name, value in metrics.items():
        assert getattr(out, name) == pytest.approx(value, rel=1e-5), name


def test_sequence_level_equals_token_level_with_one_token_per_sequence() -> None:
    gen = torch.Generator().manual_seed(11)
    B, T = 5, 4
    mask = torch.zeros(B, T)
    mask[torch.arange(B), torch.randint(0, T, (B,), generator=gen)] = 1.0
    behaviour = -1.0 + 0.5 * torch.randn(B, T, generator=gen)
    old = behaviour + 0.5 * torch.randn(B, T, generator=gen)
    logp0 = old + 0.3 * torch.randn(B, T, generator=gen)
    ref = old + 0.1 * torch.randn(B, T, generator=gen)
    advantages = torch.randn(B, generator=gen)
    outs = {}
    for level in ("token", "sequence"):
        logp = logp0.clone().requires_grad_(True)
        out = policy_loss(logp, old, behaviour, advantages, mask, loss_type="grpo", normalizer=B, tis_cap=1.5,
                          beta=0.1, ref=ref, importance_sampling_level=level)
        out.loss.backward()
        outs[level] = (out, logp.grad)
    (tok, tok_grad), (seq, seq_grad) = outs["token"], outs["sequence"]
    assert torch.equal(tok.loss, seq.loss)
    assert torch.equal(tok_grad, seq_grad)
    assert tok.clipped + tok.is_truncated > 0  # not a case where nothing happens
    for name in ("tokens", "clipped", "is_weight_sum", "is_weight_max", "is_truncated", "kl_sum", "ratio_sum"):
        assert getattr(tok, name) == getattr(seq, name), name
    with pytest.raises(ValueError, match="importance_sampling_level"):
        policy_loss(logp0, old, behaviour, advantages, mask, loss_type="grpo", normalizer=B,
                    importance_sampling_level="sentence")
