"""Truncated sampling (min_p, top_k, top_p) as vLLM applies it, for both sides that must agree.

The inference server samples from the truncated distribution and, with vLLM's
`processed_logprobs`, reports logprobs renormalised over it; the trainer must score the same
distribution or every importance weight pi_old / pi_behaviour is shifted (by -0.10 nats on
average at top_p 0.9). So the CPU inference server (services/inference/sampling.py) and the
trainer's logprobs (services/trainer/loss.py) both call `truncate_`.

vLLM 0.32's order (vllm/v1/sample/sampler.py), after dividing the logits by the temperature:

1. min_p: drop tokens whose probability is below min_p x the largest probability;
2. top_k: keep the tokens whose logit is at least the k-th largest (ties at the k-th stay);
3. top_p: over what is left, keep the most likely tokens until the mass of those before a
   token reaches top_p (the most likely token always stays).

A token near a boundary can fall on either side when the two engines' logits differ in the
last bits; that is the only place the two can disagree.

The settings' shape and validation (`Truncation`) live in shared/contract.py, which must not
import torch; this module needs it.
"""

from __future__ import annotations

import torch

# Rows sorted at once for top_k / top_p: the sort's working memory (values, int64 indices,
# probabilities, masks) stays near 20 bytes x this many elements, whatever the vocabulary.
SORT_ELEMENTS = 1 << 24


def _per_row(value: float | int | torch.Tensor, rows: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device, dtype=dtype).reshape(rows, 1)
    return torch.full((rows, 1), value, device=like.device, dtype=dtype)


def truncate_(
    z: torch.Tensor,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
    min_p: float | torch.Tensor = 0.0,
) -> torch.Tensor:
    """Set to -inf, in place, the entries of `z` [N, V] (logits already divided by the
    temperature) that sampling with these settings never picks; return that boolean mask.

    Each setting is a number for every row or an [N] tensor (one per row); off is top_k <= 0,
    top_p 1, min_p 0."""
    rows, vocab = z.shape
    k = _per_row(top_k, rows, z, torch.long)
    p = _per_row(top_p, rows, z, z.dtype)
    m = _per_row(min_p, rows, z, z.dtype)
    drop = torch.zeros_like(z, dtype=torch.bool)
    if bool((m > 0).any()):
        # p_v < min_p * p_max  <=>  z_v < z_max + log(min_p); log(0) = -inf drops nothing.
        drop |= z < z.amax(dim=-1, keepdim=True) + torch.log(m)
    use_k, use_p = k > 0, p < 1.0
    if bool(use_k.any()) or bool(use_p.any()):
        step = max(1, SORT_ELEMENTS // max(vocab, 1))
        for lo in range(0, rows, step):
            hi = min(lo + step, rows)
            drop[lo:hi] |= _top_k_top_p_drop(z[lo:hi].masked_fill(drop[lo:hi], float("-inf")),
                                             k[lo:hi], p[lo:hi], use_k[lo:hi], use_p[lo:hi])
    z.masked_fill_(drop, float("-inf"))
    return drop


def _top_k_top_p_drop(z: torch.Tensor, k: torch.Tensor, p: torch.Tensor,
                      use_k: torch.Tensor, use_p: torch.Tensor) -> torch.Tensor:
    vocab = z.shape[-1]
    sorted_z, order = torch.sort(z, dim=-1, descending=True)
    kth = sorted_z.gather(1, (k.clamp(1, vocab) - 1))
    drop_sorted = use_k & (sorted_z < kth)
    if bool(use_p.any()):
        probs = torch.softmax(sorted_z.masked_fill(drop_sorted, float("-inf")), dim=-1)
        mass_before = torch.cumsum(probs, dim=-1).sub_(probs)
        drop_sorted |= use_p & (mass_before >= p)
        drop_sorted[:, 0] = False
    return torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
