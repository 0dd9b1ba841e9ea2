"""Policy-gradient losses for GRPO and relatives: pure functions on tensors.

Notation, per completion token t of sequence i (only tokens with loss mask m_it = 1 count):

* `logp`      log pi_theta(y_t | ...): the policy being trained, with gradient.
* `old`       log pi_old: the same model *before the first update of this step*
              (detached). With one pass per batch it equals `logp` in value, so the
              clipped ratio starts at exactly 1; with `num_iterations` > 1 later passes
              are clipped against it as in PPO.
* `behaviour` log mu: what the inference server sampled with (`completion_logprobs`,
              after temperature). mu differs from pi_old for two reasons: the sample may
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

from dataclasses import dataclass

import torch

from shared.contract import LOSS_NAMES


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[targets], computed in float32.

    logits [B, T, V], targets [B, T] -> [B, T]. Dividing by the sampler's temperature
    makes these comparable to its "processed" logprobs (docs/inference-api.md). Rows are
    processed one at a time so the float32 copy of the logits stays one row big.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    out = []
    for row_logits, row_targets in zip(logits, targets):
        row = row_logits.float()
        if temperature != 1.0:
            row = row / temperature
        picked = row.gather(-1, row_targets.unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(row, dim=-1))
    return torch.stack(out)


def importance_weights(old: torch.Tensor, behaviour: torch.Tensor, cap: float | None) -> torch.Tensor:
    """min(exp(old - behaviour), cap), detached; all ones when `cap` is None (disabled)."""
    if cap is None:
        return torch.ones_like(old)
    log_w = (old - behaviour).detach().float()
    # Clamp in log space first so a huge mismatch cannot overflow exp to inf.
    return torch.exp(torch.clamp(log_w, max=float(torch.log(torch.tensor(cap))))).to(old.dtype)


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


@dataclass
class LossOutput:
    """The loss to backpropagate plus detached sums for metrics (sums, not means, so
    micro-batches and ranks can be added before dividing by `tokens`)."""

    loss: torch.Tensor
    tokens: float
    clipped: float  # loss tokens where the clipped branch was taken (no gradient)
    is_weight_sum: float
    is_weight_max: float
    is_truncated: float  # loss tokens whose weight hit the cap
    kl_sum: float
    ratio_sum: float


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
) -> LossOutput:
    """The loss of one micro-batch (see the module docstring for the math).

    logp, old, behaviour, mask: [B, T]; advantages: [B]. `old` is ignored when `tis_cap`
    is None (the ratio is then against `behaviour`). `normalizer` is the global
    normaliser of the whole optimizer batch (`loss_normalizer`, summed).
    """
    if loss_type not in LOSS_NAMES:
        raise ValueError(f"unknown loss type {loss_type!r}; expected one of {LOSS_NAMES}")
    if beta and ref is None:
        raise ValueError("beta > 0 needs reference logprobs `ref`")
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = mask.to(logp.dtype)
    behaviour = behaviour.to(logp.dtype)
    anchor = old.detach().to(logp.dtype) if tis_cap is not None else behaviour
    weights = importance_weights(anchor, behaviour, tis_cap)

    ratio = torch.exp(logp - anchor)
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + eps_high) * adv
    per_token = -weights * torch.minimum(unclipped, clipped)
    kl = None
    if beta:
        kl = k3_kl(logp, ref.to(logp.dtype))
        per_token = per_token + beta * kl

    if normalizer <= 0:
        # Nothing in the whole batch carries loss: a zero loss that still touches the graph.
        loss = (per_token * mask).sum() * 0.0
    elif loss_type == "grpo":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        loss = per_seq.sum() / normalizer
    else:  # dapo and dr_grpo differ only in the normaliser
        loss = (per_token * mask).sum() / normalizer

    with torch.no_grad():
        took_clip = (clipped < unclipped).to(mask.dtype) * mask
        masked_w = weights * mask
        truncated = torch.zeros((), device=mask.device)
        if tis_cap is not None:
            truncated = ((anchor - behaviour).float() >= torch.log(torch.tensor(tis_cap)).item()).float()
            truncated = (truncated * mask.float()).sum()
        return LossOutput(
            loss=loss,
            tokens=float(mask.sum()),
            clipped=float(took_clip.sum()),
            is_weight_sum=float(masked_w.sum()),
            is_weight_max=float(masked_w.max()) if masked_w.numel() else 0.0,
            is_truncated=float(truncated),
            kl_sum=float((kl * mask).sum()) if kl is not None else 0.0,
            ratio_sum=float((ratio * mask).sum()),
        )
