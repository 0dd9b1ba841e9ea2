"""Off-policy corrections (token masking, sequence rejection; services/trainer/loss.py) against
an independent float64 computation one sample and one token at a time, and in the learner:
micro-batches and deferred normalisation give the full-batch gradient, the metrics, a batch
whose every token is masked leaves the weights alone."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from services.trainer.collate import collate, split_micro_batches
from services.trainer.corrections import Correction
from services.trainer.learner import Learner, LossConfig, forward_logprobs
from services.trainer.loss import PER_SEQUENCE, policy_loss
from tests.trainer.conftest import make_samples

EPS_LOW, EPS_HIGH = 0.2, 0.28
L = 9  # dr_grpo's constant


def _case(seed: int = 5, B: int = 8, T: int = 7) -> dict[str, torch.Tensor]:
    """Inputs where the band [0.8, 1.25] masks some tokens and keeps others, and rejection on
    [0.9, 1.1] takes some sequences out: log(pi_old / mu) ~ per-sequence offset + token noise."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=gen) > 0.25).double()
    mask[0] = 0.0  # a sequence without loss tokens
    offset = torch.tensor([0.0, 0.0, 0.3, -0.3, 0.02, -0.05, 0.15, 0.0])[:B].unsqueeze(-1).double()
    behaviour = -2.0 + 0.5 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    old = behaviour + offset + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    logp = old + 0.15 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.7, 1.2, -1.5, 0.9])[:B].double()
    return {"logp": logp, "old": old, "behaviour": behaviour, "advantages": advantages, "mask": mask}


def _by_hand(case: dict[str, torch.Tensor], *, loss_type: str, level: str, c: Correction):
    """The loss (float64 autograd over scalars, one token at a time), its normaliser, and the
    metrics, with the rules of docs/corrections.md written out directly."""
    old, behaviour = case["old"].tolist(), case["behaviour"].tolist()
    advantages, mask = case["advantages"].tolist(), case["mask"].tolist()
    leaf = case["logp"].clone().requires_grad_(True)
    B, T = len(mask), len(mask[0])
    seq_losses, kept_total, kept_sequences, rejected_count = [], 0, 0, 0
    stats = {name: [0.0] * B for name in PER_SEQUENCE}
    for i in range(B):
        toks = [t for t in range(T) if mask[i][t]]
        lw_tok = {t: old[i][t] - behaviour[i][t] for t in toks}
        lw_seq = sum(lw_tok.values()) / len(toks) if toks else 0.0
        lo, hi = c.reject
        rejected = bool(toks) and ((lo is not None and math.exp(lw_seq) < lo) or (hi is not None and math.exp(lw_seq) > hi))
        kept, masked = [], 0
        for t in toks:
            lw = lw_seq if level == "sequence" else lw_tok[t]
            if c.mode != "truncate" and not c.band[0] <= math.exp(lw) <= c.band[1]:
                masked += 1
            elif not rejected:
                kept.append(t)
        for t in toks:
            lr = lw_tok[t]
            stats["k1"][i] += -lr
            stats["k2"][i] += lr * lr / 2
            stats["k3"][i] += math.exp(lr) - 1 - lr
            raw = math.exp(lw_seq if level == "sequence" else lr)
            stats["w_raw_sum"][i] += raw
            stats["w_raw_max"][i] = max(stats["w_raw_max"][i], raw)
        stats["tokens"][i], stats["masked"][i] = float(len(toks)), float(masked)
        stats["rejected"][i], stats["present"][i] = float(rejected), float(bool(toks))
        rejected_count += rejected
        if not kept:
            continue
        kept_sequences += 1
        kept_total += len(kept)
        a = advantages[i]

        def weight(lw: float) -> float:
            w = math.exp(lw)
            return w if c.mode == "mask" else min(w, c.cap)

        if level == "sequence":
            s = torch.exp(sum(leaf[i, t] - old[i][t] for t in kept) / len(kept))
            terms = [-weight(lw_seq) * torch.minimum(s * a, torch.clamp(s, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
                     for _ in kept]
        else:
            terms = []
            for t in kept:
                r = torch.exp(leaf[i, t] - old[i][t])
                terms.append(-weight(lw_tok[t]) * torch.minimum(r * a, torch.clamp(r, 1 - EPS_LOW, 1 + EPS_HIGH) * a))
        seq_losses.append(sum(terms) / len(kept) if loss_type == "grpo" else sum(terms))
    normalizer = {"grpo": kept_sequences, "dapo": kept_total, "dr_grpo": (B - rejected_count) * L}[loss_type]
    loss = sum(seq_losses) / normalizer
    loss.backward()
    return float(loss.detach()), leaf.grad, float(normalizer), kept_total, stats


CORRECTIONS = {
    "mask": Correction(mode="mask", band=(0.8, 1.25)),
    "mask_truncate": Correction(mode="mask_truncate", cap=1.1, band=(0.8, 1.25)),
    "reject": Correction(mode="truncate", cap=1.1, reject=(0.9, 1.1)),
    "reject_low_only": Correction(mode="truncate", cap=1.1, reject=(0.9, None)),
    "mask_and_reject": Correction(mode="mask", band=(0.8, 1.25), reject=(0.9, 1.1)),
}


@pytest.mark.parametrize("name", list(CORRECTIONS))
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_corrections_match_a_per_token_float64_computation(name: str, level: str, loss_type: str) -> None:
    c = CORRECTIONS[name]
    case = _case()
    want_loss, want_grad, want_normalizer, want_kept, stats = _by_hand(case, loss_type=loss_type, level=level, c=c)
    logp = case["logp"].clone().requires_grad_(True)
    out = policy_loss(logp, case["old"], case["behaviour"], case["advantages"], case["mask"], loss_type=loss_type,
                      normalizer=want_normalizer, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
                      importance_sampling_level=level, correction=c, max_completion_length=L)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(logp.grad, want_grad, rtol=1e-9, atol=1e-12)
    assert out.normalizer_part == want_normalizer and out.tokens == want_kept
    for key in PER_SEQUENCE:
        torch.testing.assert_close(out.per_sequence[key], torch.tensor(stats[key], dtype=torch.float64),
                                   rtol=1e-6, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
    # The case exercises what it claims: something taken out, something left.
    taken = sum(stats["masked"]) + sum(stats["rejected"])
    assert taken > 0 and 0 < want_kept < case["mask"].sum()
    # Every token taken out has a gradient of exactly zero.
    carried = logp.grad != 0
    assert int(carried.sum()) <= want_kept


def test_a_masked_token_carries_nothing_whatever_its_ratio() -> None:
    # A token far outside the band with a huge policy ratio: no loss, no gradient, no KL.
    old = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    behaviour = torch.tensor([[-1.0, -4.0]], dtype=torch.float64)  # w = e^3 on token 1: masked
    logp = torch.tensor([[-1.0, 5.0]], dtype=torch.float64, requires_grad=True)
    out = policy_loss(logp, old, behaviour, torch.tensor([1.0]), torch.ones(1, 2), loss_type="dapo", normalizer=1.0,
                      beta=0.1, ref=torch.full((1, 2), -1.0), correction=Correction(mode="mask"))
    out.loss.backward()
    assert logp.grad[0, 1] == 0 and logp.grad[0, 0] != 0
    assert out.tokens == 1 and out.per_sequence["masked"].item() == 1 and out.normalizer_part == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"band": (1.0, 2.0)}, "0 < is_low < 1 < is_high"),
    ({"band": (0.5, 0.9)}, "0 < is_low < 1 < is_high"),
    ({"band": (0.0, 2.0)}, "0 < is_low < 1 < is_high"),
    ({"mode": "mask_truncate", "cap": None}, "set tis_cap"),
    ({"reject": (1.2, None)}, "seq_reject_low"),
    ({"reject": (None, 0.9)}, "seq_reject_high"),
    ({"mode": "clamp"}, "unknown is_mode"),
])
def test_bad_correction_settings_say_what_to_fix(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Correction(**{"mode": "mask", **kwargs})


def test_trainer_settings_refuse_a_band_without_one_at_start_up() -> None:
    from pydantic import ValidationError

    from services.trainer.config import TrainerSettings

    with pytest.raises(ValidationError, match="is_low"):
        TrainerSettings(model="m", is_mode="mask", is_low=1.5, is_high=3.0)
    with pytest.raises(ValidationError, match="seq_reject_high"):
        TrainerSettings(model="m", seq_reject_high=0.5)
    ok = TrainerSettings(model="m", is_mode="mask", seq_reject_low=0.5, seq_reject_high=2.0)
    assert ok.correction().depends_on_forward


# -- the learner -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float64)


def _settings(**extra) -> dict:
    # Behaviour logprobs sit near the tiny model's (make_samples): this band and this rejection
    # band each take out part of the batch, not all of it.
    return {"is_mode": "mask", "is_low": 0.8, "is_high": 1.25, "seq_reject_low": 0.85, "seq_reject_high": 1.15,
            "max_completion_length": 8, **extra}


def _learner_grads(model, samples, k: int, step: int | None = None, **cfg) -> tuple[dict, dict]:
    learner = Learner(model, torch.optim.SGD(model.parameters(), lr=0.0), LossConfig(**cfg))
    metrics = learner.train_on_samples(samples, grad_accum_steps=k, step=step)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}, metrics


def _full_batch_grads(model, samples, **cfg) -> dict:
    """The gradient of one policy_loss over the whole batch with the kept normaliser computed
    beforehand (what deferred normalisation must reproduce)."""
    c = LossConfig(**cfg)
    mb = collate(samples)
    with torch.no_grad():
        old = forward_logprobs(model, mb, 1.0)
    kw = dict(loss_type=c.loss_type, epsilon_low=c.epsilon_low, tis_cap=c.tis_cap, correction=c.correction,
              max_completion_length=c.max_completion_length, importance_sampling_level=c.importance_sampling_level)
    probe = policy_loss(old, old, mb.behaviour_logprobs, mb.advantages, mb.loss_mask, normalizer=1.0, **kw)
    model.zero_grad(set_to_none=True)
    logp = forward_logprobs(model, mb, 1.0)
    policy_loss(logp, logp.detach(), mb.behaviour_logprobs, mb.advantages, mb.loss_mask,
                normalizer=probe.normalizer_part, **kw).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_type, level", [("grpo", "token"), ("dapo", "sequence"), ("dr_grpo", "token")])
def test_micro_batches_with_masking_give_the_full_batch_gradient(base_model, loss_type: str, level: str) -> None:
    samples = make_samples(12, seed=21)
    cfg = _settings(loss_type=loss_type, importance_sampling_level=level)
    full = _full_batch_grads(copy.deepcopy(base_model), samples, **cfg)
    split, metrics = _learner_grads(copy.deepcopy(base_model), samples, 4, **cfg)
    assert full.keys() == split.keys() and full
    # Not bit for bit: the loss is scaled after the backward instead of before it, and the
    # model's RMSNorm runs in float32 even in a float64 model, so its gradients round
    # differently at float32's 1e-7 of the tensor's scale (a wrong normaliser is off by percents).
    for name in full:
        scale = float(full[name].abs().max())
        torch.testing.assert_close(split[name], full[name], rtol=1e-6, atol=1e-6 * scale,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert any(g.abs().sum() > 0 for g in full.values())
    taken = metrics["is_masked_fraction"] + metrics["rejected_fraction"]
    assert taken > 0 and 0 < metrics["kept_tokens"] < metrics["loss_tokens"]


def test_the_metrics_are_those_of_the_batch(base_model) -> None:
    model = copy.deepcopy(base_model)
    samples = make_samples(10, seed=4)
    for s in samples[:4]:
        s.policy_version = 5  # staleness 1 at step 6
    for s in samples[4:7]:
        s.policy_version = 2  # staleness 4: the 2+ group
    for s in samples[7:]:
        s.policy_version = 6  # fresh
    _, metrics = _learner_grads(model, samples, 2, step=6, **_settings())
    mb = collate(samples)
    with torch.no_grad():
        old = forward_logprobs(copy.deepcopy(base_model), mb, 1.0)
    live = mb.loss_mask > 0
    lr = (old - mb.behaviour_logprobs)[live]
    assert metrics["mismatch_k1"] == pytest.approx(float((-lr).mean()), rel=1e-6)
    assert metrics["mismatch_k2"] == pytest.approx(float((lr ** 2 / 2).mean()), rel=1e-6)
    assert metrics["mismatch_k3"] == pytest.approx(float((lr.exp() - 1 - lr).mean()), rel=1e-6)
    assert metrics["is_weight_raw_max"] == pytest.approx(float(lr.exp().max()), rel=1e-6)
    assert metrics["is_masked_fraction"] == pytest.approx(float(((lr.exp() < 0.8) | (lr.exp() > 1.25)).float().mean()))
    assert metrics["mismatch_k3"] >= 0 and metrics["behaviour_mismatch"] == pytest.approx(float(lr.abs().mean()))
    # Mixed staleness: each group's numbers, and the batch's are their token-weighted mean.
    groups = {"stale0": samples[7:], "stale1": samples[:4], "stale2plus": samples[4:7]}
    tokens = {g: sum(sum(1 for m in s.loss_mask if m) for s in group) for g, group in groups.items()}
    assert sum(metrics[f"mismatch_k3_{g}"] * n for g, n in tokens.items()) / sum(tokens.values()) \
        == pytest.approx(metrics["mismatch_k3"], rel=1e-9)
    rejected = sum(metrics[f"rejected_fraction_{g}"] * len(group) for g, group in groups.items())
    assert rejected / len(samples) == pytest.approx(metrics["rejected_fraction"], rel=1e-9)
    # One staleness only: no per-staleness keys.
    _, same = _learner_grads(copy.deepcopy(base_model), make_samples(4, seed=4), 1, step=0, **_settings())
    assert not [k for k in same if "_stale" in k]


def test_a_batch_entirely_masked_leaves_the_weights_alone(base_model) -> None:
    model = copy.deepcopy(base_model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    samples = make_samples(6, seed=2)
    for s in samples:
        s.completion_logprobs = [-40.0] * len(s.completion_logprobs)  # w = pi_old/mu is huge everywhere
    learner = Learner(model, torch.optim.AdamW(model.parameters(), lr=1e-2), LossConfig(**_settings()))
    metrics = learner.train_on_samples(samples, grad_accum_steps=2)
    assert metrics["is_masked_fraction"] == 1.0 and metrics["skipped_no_signal"] == 1.0
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    assert not split_micro_batches(samples, 2)[0].loss_mask.sum() == 0  # the tokens were there
