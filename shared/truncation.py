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

Each keeps the logits above a cut, so a position's truncated set is `z >= thresholds(z)`.

A token near a boundary can fall on either side when the two engines' logits differ in the
last bits; that is the only place the two can disagree.

The settings' shape and validation (`Truncation`) live in shared/contract.py, which must not
import torch; this module needs it.
"""

from __future__ import annotations

import torch

# Rows handled at once: the working memory (candidate values, int64 indices, probabilities)
# stays near 20 bytes x this many elements, whatever the vocabulary.
SORT_ELEMENTS = 1 << 24
# top_p looks for its boundary among this many most likely tokens first (a partial sort);
# only a row whose best CANDIDATES tokens hold less than top_p of the mass is sorted whole.
CANDIDATES = 1024


def _per_row(value: float | int | torch.Tensor, rows: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device, dtype=dtype).reshape(rows, 1)
    return torch.full((rows, 1), value, device=like.device, dtype=dtype)


def thresholds(
    z: torch.Tensor,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
    min_p: float | torch.Tensor = 0.0,
) -> torch.Tensor:
    """[N, 1]: for each row of `z` [N, V] (logits already divided by the temperature), the
    smallest logit sampling with these settings keeps; -inf where nothing is dropped.

    Each rule keeps the tokens above a cut in the sorted order, so the kept set is exactly
    `z >= threshold`, and a caller that must apply it twice (a forward and its backward)
    keeps one number per row instead of a mask or a second sort. Tokens tied with the last
    kept one are all kept (vLLM keeps ties at the k-th logit; at the top_p cut its sort order
    decides, which no other engine can reproduce). Each setting is a number for every row or
    an [N] tensor; off is top_k <= 0, top_p 1, min_p 0."""
    rows, vocab = z.shape
    k = _per_row(top_k, rows, z, torch.long)
    p = _per_row(top_p, rows, z, z.dtype)
    m = _per_row(min_p, rows, z, z.dtype)
    # min_p: p_v < min_p * p_max  <=>  z_v < z_max + log(min_p); log(0) = -inf keeps everything.
    cut = z.amax(dim=-1, keepdim=True) + torch.log(m)
    use_k, use_p = k > 0, p < 1.0
    if not (bool(use_k.any()) or bool(use_p.any())):
        return cut
    step = max(1, SORT_ELEMENTS // max(vocab, 1))
    for lo in range(0, rows, step):
        hi = min(lo + step, rows)
        cut[lo:hi] = _top_k_top_p_cut(z[lo:hi], cut[lo:hi], k[lo:hi], p[lo:hi], use_k[lo:hi], use_p[lo:hi])
    return cut


def _top_k_top_p_cut(z: torch.Tensor, cut: torch.Tensor, k: torch.Tensor, p: torch.Tensor,
                     use_k: torch.Tensor, use_p: torch.Tensor) -> torch.Tensor:
    vocab = z.shape[-1]
    candidates = min(vocab, max(CANDIDATES, int(k.max())))
    best = torch.topk(z, candidates, dim=-1, sorted=True).values
    best = best.masked_fill(best < cut, float("-inf"))  # what min_p dropped
    # top_k: the k-th best survivor (-inf when fewer survive: nothing more to drop).
    kth = best.gather(1, (k.clamp(1, candidates) - 1))
    cut = torch.where(use_k, torch.maximum(cut, kth), cut)
    if not bool(use_p.any()):
        return cut
    # top_p over what min_p and top_k left: mass before each candidate, normalised over all of it.
    lse = torch.logsumexp(z.masked_fill(z < cut, float("-inf")), dim=-1, keepdim=True)
    best = best.masked_fill(best < cut, float("-inf"))
    nucleus = _nucleus_cut(best, lse, p)
    # Rows whose candidates hold less than top_p of the mass have their cut further down: sort them whole.
    short = (use_p & (torch.logsumexp(best, dim=-1, keepdim=True) - lse < torch.log(p))).squeeze(1)
    if candidates < vocab and bool(short.any()):
        whole = torch.sort(z[short], dim=-1, descending=True).values
        nucleus[short] = _nucleus_cut(whole.masked_fill(whole < cut[short], float("-inf")), lse[short], p[short])
    return torch.where(use_p, torch.maximum(cut, nucleus), cut)


def _nucleus_cut(descending: torch.Tensor, lse: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The logit of the last token kept by top_p: tokens are kept, best first, while the mass
    of those before them is below p (the best one always)."""
    probs = torch.exp(descending - lse)
    mass_before = torch.cumsum(probs, dim=-1).sub_(probs)
    last = ((mass_before < p).sum(dim=-1, keepdim=True) - 1).clamp(min=0)
    return descending.gather(1, last)


def truncate_(
    z: torch.Tensor,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
    min_p: float | torch.Tensor = 0.0,
) -> torch.Tensor:
    """Set to -inf, in place, the entries of `z` [N, V] (logits already divided by the
    temperature) that sampling with these settings never picks; return that boolean mask.
    See `thresholds`."""
    dropped = z < thresholds(z, top_k, top_p, min_p)
    z.masked_fill_(dropped, float("-inf"))
    return dropped
