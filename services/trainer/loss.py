"""Policy-gradient losses for GRPO and relatives: pure functions on tensors.

Notation, per completion token t of sequence i (only tokens with loss mask m_it = 1 count):

* `logp`      log pi_theta(y_t | ...): the policy being trained, with gradient.
* `old`       log pi_old: the same model *before the first update of this step*
              (detached). With one pass per batch it equals `logp` in value, so the
              clipped ratio starts at exactly 1; with `num_iterations` > 1 later passes
              are clipped against it as in PPO.
* `behaviour` log mu: what the inference server sampled with (`completion_logprobs`,
              after temperature and truncation; `logp` and `old` are scored over the
              same truncated set, `logprobs.token_logprobs`). mu differs from pi_old for two reasons: the sample may
              be up to `max_staleness` versions old, and inference kernels (bf16, other
              numerics) never reproduce the trainer's logprobs exactly.
* `A_i`       the sequence's advantage, computed by the sampler.

Per-token objective (a "decoupled" PPO loss: the proximal policy that anchors the trust
region is pi_old, while the data come from mu):

    r_t  = exp(logp - old)
    w_t  = min(exp(old - behaviour), C)                       (detached)
    l_t  = -w_t * min(r_t * A_i, clip(r_t, 1 - eps_low, 1 + eps_high) * A_i)
           + beta * k3_t,    k3_t = exp(ref - logp) - (ref - logp) - 1

w_t is the importance weight that turns an expectation under mu into one under pi_old.
Left untruncated it has unbounded variance when mu assigned a token tiny probability;
capping it at C trades a small bias for bounded variance. This is the truncated
importance-sampling idea of off-policy actor-critic methods (the truncated weights of
IMPALA's V-trace, Espeholt et al. 2018) that recent LLM-RL work applies exactly to the
mismatch between an inference engine's sampling distribution and the trainer's policy.
The split between a proximal policy for clipping and a behaviour policy for importance
weighting follows the decoupled PPO objective (Hilton et al. 2021, "Batch size-invariance
for policy optimization"). The KL term is not importance weighted: it is a regulariser
on the current policy, estimated on the sampled tokens with the k3 estimator (Schulman's
"Approximating KL divergence"), which is unbiased and non-negative.

With truncated IS disabled (`tis_cap` None) there is no separate proximal policy: the
ratio is taken directly against the behaviour logprobs (old := behaviour, w := 1), which
is ordinary PPO clipping with the sampler as the old policy.

Sequence-level importance sampling (`importance_sampling_level="sequence"`, GSPO: Zheng
et al. 2025, "Group Sequence Policy Optimization"; TRL's option of the same name) replaces
the per-token ratio and weight by per-sequence geometric means over the loss tokens,
shared by every token of the sequence:

    s_i  = exp( (1/n_i) sum_t m_it (logp_it - old_it) )          (gradient through logp)
    w_i  = min(exp( (1/n_i) sum_t m_it (old_it - behaviour_it) ), C)          (detached)
    l_it = -w_i * min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i) + beta * k3_it

The advantage is a sequence-level quantity, so a sequence-level ratio matches its unit;
the length normalisation keeps s_i in the same range as a token ratio whatever the length,
which is why the same epsilons apply. A sequence is then clipped as a whole, not token by
token. With one loss token per sequence both levels are the same objective.

Corrections when mu is far from pi_old (`is_mode`, `seq_reject`; docs/corrections.md). With
log w_t = old_t - behaviour_t (or the sequence mean of it, at the sequence level):

* `truncate`       w_t = min(exp(log w_t), C) as above (C = `tis_cap`).
* `mask`           a token whose exp(log w_t) lies outside [is_low, is_high] carries no loss at
                   all (IcePop-style masking); the others keep their untruncated w_t.
* `mask_truncate`  the same band, and the kept weights truncated at C.
* sequence rejection (`seq_reject` = [low, high], either side optional): a sequence whose
                   geometric-mean weight exp((1/n_i) sum_t m_it log w_it) lies outside the band
                   carries no loss at all.

A masked token or a rejected sequence is removed from the loss mask before anything else, so
it drops out of the aggregation exactly as a loss-masked token does: out of n_i, out of N'
when none of its tokens is left (grpo), out of sum n_i (dapo), out of N (dr_grpo, rejected
sequences only: L stays constant). Its gradient is exactly zero, KL term included. The kept
set depends on pi_old, known only after each micro-batch's forward, so the learner then
computes the normaliser as it goes (`LossOutput.normalizer_part`) and scales the gradients
once every micro-batch is done (learner.py), which is the same gradient.

Masked positions (m_it = 0: prompt padding, tool output, a sample whose loss mask was
cleared) may hold anything in `logp`, `old`, `behaviour` or `ref`: junk past the end of a
row, -inf or a -9999 sentinel from an inference engine. Multiplying by the mask is not
enough, because 0 * inf and 0 * NaN are NaN, in the loss and in the gradient. So every
input is replaced by 0 at masked positions (`torch.where`) before any arithmetic, and every
sum selects with the mask again; a masked position then contributes exactly nothing.

Aggregation over a batch of sequences (N = sequences, n_i = loss tokens of sequence i):

* `grpo`    (1/N') sum_i (1/n_i) sum_t l_it         N' = sequences with n_i > 0
* `dapo`    (1/sum_i n_i) sum_i sum_t l_it          token-level mean over the batch
* `dr_grpo` (1/(N * L)) sum_i sum_t l_it            L = a constant max completion length

The normaliser (N', sum n_i or N*L) is always the one of the *whole* optimizer batch
(all micro-batches, all ranks), passed in as `normalizer`. Each micro-batch then
contributes its partial sum divided by the global normaliser, so the accumulated gradient
equals the full-batch gradient whatever the micro-batch split (the same reason
transformers' Trainer normalises by the number of items in the whole batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.trainer.corrections import Correction
from shared.contract import LOSS_NAMES


def importance_weights(old: torch.Tensor, behaviour: torch.Tensor, cap: float | None) -> torch.Tensor:
    """min(exp(old - behaviour), cap), detached; all ones when `cap` is None (disabled)."""
    if cap is None:
        return torch.ones_like(old)
    return _truncated_exp((old - behaviour).detach().float(), cap).to(old.dtype)


def _log_cap(cap: float) -> float:
    # The clamp of the weights and the count of truncated tokens compare the same log-weight
    # with this same number, so they agree exactly.
    return math.log(cap)


def _truncated_exp(log_w: torch.Tensor, cap: float) -> torch.Tensor:
    # Clamp in log space first so a huge mismatch cannot overflow exp to inf.
    return torch.exp(torch.clamp(log_w, max=_log_cap(cap)))


def k3_kl(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    delta = ref - logp
    return torch.exp(delta) - delta - 1


def loss_normalizer(loss_type: str, tokens_per_sequence: torch.Tensor, max_completion_length: int | None) -> float:
    """The normaliser of one (local) batch given its loss-token counts per sequence.

    Sum these over micro-batches and ranks before use: normalisers of `grpo` and `dapo`
    are counts, and `dr_grpo`'s is N * L, so all three add up.
    """
    if loss_type == "grpo":
        return float((tokens_per_sequence > 0).sum())
    if loss_type == "dapo":
        return float(tokens_per_sequence.sum())
    if loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("dr_grpo needs max_completion_length (the constant L)")
        return float(tokens_per_sequence.numel() * max_completion_length)
    raise ValueError(f"unknown loss type {loss_type!r}; expected one of {LOSS_NAMES}")


# Per-sequence sums LossOutput.per_sequence holds (float64, [B]): loss tokens, the k1, k2 and k3
# estimates of KL(mu || pi_old) summed over them, the IS weight before truncation or masking
# (sum and max), tokens masked by the band, whether the sequence was rejected, and whether it
# has loss tokens at all.
PER_SEQUENCE = ("tokens", "k1", "k2", "k3", "w_raw_sum", "w_raw_max", "masked", "rejected", "present")


@dataclass
class LossOutput:
    """The loss to backpropagate plus detached sums for metrics (sums, not means, so
    micro-batches and ranks can be added before dividing by `tokens`)."""

    loss: torch.Tensor
    tokens: float  # tokens that carry loss (the loss mask, less masked tokens and rejected sequences)
    clipped: float  # of those, where the clipped branch was taken (no gradient)
    is_weight_sum: float
    is_weight_max: float
    is_truncated: float  # tokens whose weight hit the cap
    kl_sum: float
    ratio_sum: float
    normalizer_part: float = 0.0  # this micro-batch's share of the normaliser, over what carries loss
    signal: float = 0.0  # tokens that carry loss and can move the weights (advantage != 0, or a KL term)
    per_sequence: dict[str, torch.Tensor] | None = None  # PER_SEQUENCE


IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def _sanitised(logp: torch.Tensor, old: torch.Tensor, behaviour: torch.Tensor, loss_mask: torch.Tensor
               ) -> tuple[torch.Tensor, ...]:
    """(behaviour, old, log(pi_old / mu) per token, its mean per sequence, loss tokens per
    sequence), with every masked position zeroed before any arithmetic: see "Masked
    positions" in the module docstring (`where` passes a zero gradient, never a NaN). The
    weights are detached: the corrections act on them, the gradient does not flow through."""
    behaviour_m = torch.where(loss_mask, behaviour.to(logp.dtype), 0.0)
    old_m = torch.where(loss_mask, old.detach().to(logp.dtype), 0.0)
    log_w_token = (old_m - behaviour_m).detach().to(torch.promote_types(logp.dtype, torch.float32))
    n_all = loss_mask.sum(-1, keepdim=True)
    log_w_seq = log_w_token.sum(-1, keepdim=True) / n_all.clamp(min=1)
    return behaviour_m, old_m, log_w_token, log_w_seq, n_all


def _check_arguments(loss_type: str, importance_sampling_level: str, beta: float, ref: torch.Tensor | None) -> None:
    if loss_type not in LOSS_NAMES:
        raise ValueError(f"unknown loss type {loss_type!r}; expected one of {LOSS_NAMES}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"unknown importance_sampling_level {importance_sampling_level!r}; "
                         f"expected one of {IMPORTANCE_SAMPLING_LEVELS}")
    if beta and ref is None:
        raise ValueError("beta > 0 needs reference logprobs `ref`")


def _live_tokens(loss_mask: torch.Tensor, log_w: torch.Tensor, log_w_seq: torch.Tensor, n_all: torch.Tensor,
                 correction: Correction) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the tokens that carry loss, those masked by the correction's band, the sequences it
    rejects): the loss mask less what the correction leaves out."""
    live = loss_mask
    masked_by_band = torch.zeros_like(loss_mask)
    rejected = torch.zeros_like(n_all, dtype=torch.bool)
    if correction.mode != "truncate":
        low, high = correction.band
        masked_by_band = loss_mask & ((log_w < _log_cap(low)) | (log_w > _log_cap(high)))
        live = live & ~masked_by_band
    if correction.rejects:
        r_low, r_high = correction.reject
        rejected = n_all > 0
        outside = torch.zeros_like(rejected)
        if r_low is not None:
            outside = outside | (log_w_seq < _log_cap(r_low))
        if r_high is not None:
            outside = outside | (log_w_seq > _log_cap(r_high))
        rejected = rejected & outside
        live = live & ~rejected
    return live, masked_by_band, rejected


def _is_weights(log_w: torch.Tensor, cap: float | None) -> torch.Tensor:
    """pi_old / mu per token, truncated at `cap` when there is one."""
    return torch.exp(log_w) if cap is None else _truncated_exp(log_w, cap)


def _reduce(per_token: torch.Tensor, tokens_per_seq: torch.Tensor, loss_type: str, normalizer: float) -> torch.Tensor:
    """The micro-batch's loss from its per-token losses, under the loss type's normaliser."""
    if normalizer <= 0:
        # Nothing in the whole batch carries loss: a zero loss that still touches the graph.
        return per_token.sum() * 0.0
    if loss_type == "grpo":
        per_seq = per_token.sum(-1) / tokens_per_seq.squeeze(-1).clamp(min=1).to(per_token.dtype)
        return per_seq.sum() / normalizer
    return per_token.sum() / normalizer  # dapo and dr_grpo differ only in the normaliser


def _normalizer_part(loss_type: str, tokens_per_seq: torch.Tensor, rejected: torch.Tensor,
                     max_completion_length: int | None) -> float:
    """This micro-batch's share of the whole batch's normaliser (`loss_normalizer`)."""
    if loss_type == "dr_grpo":
        # N counts every sequence not rejected (a sequence without loss tokens included, as
        # loss_normalizer does); L stays the constant it is.
        return float((~rejected).sum()) * float(max_completion_length or 0)
    return loss_normalizer(loss_type, tokens_per_seq.squeeze(-1), None)


def policy_loss(
    logp: torch.Tensor,
    old: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    normalizer: float,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    tis_cap: float | None = None,
    beta: float = 0.0,
    ref: torch.Tensor | None = None,
    importance_sampling_level: str = "token",
    correction: Correction | None = None,
    max_completion_length: int | None = None,
) -> LossOutput:
    """The loss of one micro-batch (see the module docstring for the math).

    logp, old, behaviour, mask: [B, T]; advantages: [B]. Positions where `mask` > 0 carry
    loss; the others are ignored whatever they hold. `old` is pi_old; it anchors the ratio
    unless importance sampling is off (`tis_cap` None in truncate mode: then `behaviour` does).
    `normalizer` is the global normaliser of the whole optimizer batch (`loss_normalizer`,
    summed), or 1 when the caller normalises afterwards (`normalizer_part`).
    `importance_sampling_level` "token" takes one ratio and one IS weight per token,
    "sequence" one per sequence (GSPO). `correction` (default: truncate at `tis_cap`) says how
    the weights are applied; `max_completion_length` is dr_grpo's L, for `normalizer_part`.
    The metrics count tokens at either level: a clipped sequence adds its loss tokens to
    `clipped`, a truncated one to `is_truncated`.
    """
    _check_arguments(loss_type, importance_sampling_level, beta, ref)
    correction = correction or Correction(cap=tis_cap)
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    sequence_level = importance_sampling_level == "sequence"
    loss_mask = mask > 0

    behaviour_m, old_m, log_w_token, log_w_seq, n_all = _sanitised(logp, old, behaviour, loss_mask)
    # What the corrections act on: the token's log weight, or its sequence's mean at the sequence level.
    log_w = log_w_seq.expand_as(log_w_token) if sequence_level else log_w_token
    live, masked_by_band, rejected = _live_tokens(loss_mask, log_w, log_w_seq, n_all, correction)

    def masked(x: torch.Tensor) -> torch.Tensor:
        return torch.where(live, x, 0.0)

    logp_m = masked(logp)
    anchor = masked(old_m) if correction.proximal else masked(behaviour_m)
    log_ratio = logp_m - anchor
    tokens_per_seq = live.sum(-1, keepdim=True)
    if sequence_level:
        # Means over each sequence's loss tokens, broadcast back to its tokens.
        n = tokens_per_seq.clamp(min=1).to(logp.dtype)
        log_ratio = (log_ratio.sum(-1, keepdim=True) / n).expand_as(logp)

    ratio = masked(torch.exp(log_ratio))
    cap = correction.weight_cap
    weights = torch.ones_like(logp) if not correction.proximal else masked(_is_weights(log_w, cap).to(logp.dtype))
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + eps_high) * adv
    per_token = -weights * torch.minimum(unclipped, clipped)
    kl = None
    if beta:
        kl = masked(k3_kl(logp_m, masked(ref.to(logp.dtype))))
        per_token = per_token + beta * kl
    per_token = masked(per_token)

    loss = _reduce(per_token, tokens_per_seq, loss_type, normalizer)

    with torch.no_grad():
        took_clip = (clipped < unclipped) & live
        masked_w = masked(weights)
        truncated = 0.0
        if cap is not None and correction.proximal:
            truncated = float(((log_w >= _log_cap(cap)) & live).sum())
        normalizer_part = _normalizer_part(loss_type, tokens_per_seq, rejected, max_completion_length)
        movers = live if beta else live & (adv != 0)
        return LossOutput(
            loss=loss,
            tokens=float(live.sum()),
            clipped=float(took_clip.sum()),
            is_weight_sum=float(masked_w.sum()),
            is_weight_max=float(masked_w.max()) if masked_w.numel() else 0.0,
            is_truncated=truncated,
            kl_sum=float(kl.sum()) if kl is not None else 0.0,
            ratio_sum=float(ratio.sum()),
            normalizer_part=normalizer_part,
            signal=float(movers.sum()),
            per_sequence=_per_sequence(log_w_token, log_w, loss_mask, masked_by_band, rejected),
        )


def mismatch_estimates(log_r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token k1, k2 and k3 estimates of KL(mu || pi_old) from tokens sampled by mu, with
    log r = log pi_old - log mu: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r (Schulman,
    "Approximating KL divergence"). All three are 0 where log r is 0, as at masked positions
    zeroed by the caller. The native trainer and the TRL bridge both report these."""
    return -log_r, 0.5 * log_r * log_r, torch.expm1(log_r) - log_r


def _per_sequence(log_w_token: torch.Tensor, log_w: torch.Tensor, loss_mask: torch.Tensor,
                  masked_by_band: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """PER_SEQUENCE sums, over each sequence's loss tokens before any correction (the KL
    estimates: `mismatch_estimates`)."""
    k1, k2, k3 = mismatch_estimates(torch.where(loss_mask, log_w_token.double(), 0.0))
    raw = torch.where(loss_mask, torch.exp(log_w.double()), 0.0)
    tokens = loss_mask.sum(-1).double()
    return {
        "tokens": tokens,
        "k1": k1.sum(-1),
        "k2": k2.sum(-1),
        "k3": k3.sum(-1),
        "w_raw_sum": raw.sum(-1),
        "w_raw_max": raw.amax(-1) if raw.shape[-1] else torch.zeros_like(tokens),
        "masked": masked_by_band.sum(-1).double(),
        "rejected": rejected.squeeze(-1).double(),
        "present": (tokens > 0).double(),
    }
