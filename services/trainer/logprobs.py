"""Token logprobs from logits, as the sampler's servers computed them: log_softmax of the
temperature-scaled logits, over the same truncated set when the sampler truncates (min_p /
top_k / top_p, `Truncation`), computed in chunks of rows so that a long batch never holds a
float32 copy of all its logits at once (`_ChunkedTokenLogprobs` recomputes the softmax in its
backward instead of keeping it). The policy loss (loss.py) takes these as `logp`."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.autograd.function import once_differentiable

from shared.contract import Truncation
from shared.truncation import thresholds


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *, chunk_size: int = 1024,
    truncation: Truncation | None = None,
) -> torch.Tensor:
    """log softmax(logits / temperature)[targets], with memory bounded by `chunk_size`.

    logits [B, T, V] (any dtype and strides, e.g. the slice `logits[:, :-1]`), targets
    [B, T] -> [B, T] in float32 (float64 for float64 logits). Dividing by the sampler's
    temperature makes these comparable to its "processed" logprobs (docs/inference-api.md).

    The B * T positions are processed `chunk_size` at a time in float32. Autograd keeps only
    the logits themselves, in their own dtype, and one float32 logsumexp per position; the
    backward recomputes each chunk's softmax. The float32 working memory is therefore one
    chunk_size x V buffer however long the batch, where plain autograd through
    `log_softmax(logits.float())` would keep a float32 copy of all the logits.

    With an active `truncation` (the sampler's min_p / top_k / top_p) the softmax is over the
    tokens the sampler could have drawn at each position (shared/truncation.py), as vLLM's
    processed logprobs are. See `truncated_token_logprobs` for a target outside that set.
    """
    return truncated_token_logprobs(logits, targets, temperature, chunk_size=chunk_size, truncation=truncation)[0]


def truncated_token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *, chunk_size: int = 1024,
    truncation: Truncation | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` and a boolean [B, T]: whether each target lies outside the truncated
    set under these logits (always False without truncation).

    The sampler drew every target from its own truncated set; the trainer's set can differ
    where its weights moved since (staleness) or a token sits on the boundary. Such a target has
    probability 0 under the trainer's truncated policy and log 0 breaks the ratios, so it is
    scored over the truncated set plus itself: a finite, small logprob whose importance weight
    pi_old / pi_behaviour is small too, which is what an excluded token should get."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"expected logits [B, T, V] and targets [B, T], got {tuple(logits.shape)} "
                         f"and {tuple(targets.shape)}")
    if truncation is not None and not truncation.active:
        truncation = None
    return _ChunkedTokenLogprobs.apply(logits, targets, float(temperature), int(chunk_size), truncation)


def _chunks(n: int, size: int) -> Iterator[tuple[int, int]]:
    for lo in range(0, n, size):
        yield lo, min(lo + size, n)


def _load_scaled(buffer: torch.Tensor, logits: torch.Tensor, lo: int, hi: int, temperature: float) -> torch.Tensor:
    """Copy flat positions [lo, hi) of `logits` [B, T, V] into `buffer` (converting the dtype
    on the way) and divide by the temperature in place; returns the filled rows.

    A flat view of `logits` is not available when it is a slice such as `logits[:, :-1]`
    (reshaping would copy all of it), so a chunk is gathered from row segments, each of
    which is a view."""
    T = logits.shape[1]
    at, pos = 0, lo
    while pos < hi:
        b, t = divmod(pos, T)
        take = min(hi - pos, T - t)
        buffer[at : at + take].copy_(logits[b, t : t + take])
        at, pos = at + take, pos + take
    x = buffer[: hi - lo]
    if temperature != 1.0:
        x.div_(temperature)
    return x


def _mask_keeping_targets(x: torch.Tensor, targets: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """Mask `x` (scaled logits of a chunk) to its truncated set `x >= cut` ([rows, 1]), each
    row's target kept in; returns whether each target was outside the set."""
    picked = x.gather(1, targets)
    x.masked_fill_(x < cut, float("-inf"))
    x.scatter_(1, targets, picked)
    return (picked < cut).squeeze(1)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """See `token_logprobs`. d logp_j / d z_jv = (1[v = target_j] - softmax(z_j / tau)_v) / tau,
    the softmax over the truncated set when there is one (masked logits get no gradient)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, chunk_size: int,
                truncation: Truncation | None):
        B, T, V = logits.shape
        n = B * T
        compute = torch.promote_types(logits.dtype, torch.float32)
        flat_targets = targets.reshape(n, 1)
        picked = torch.empty(n, dtype=compute, device=logits.device)
        lse = torch.empty(n, dtype=compute, device=logits.device)
        outside = torch.zeros(n, dtype=torch.bool, device=logits.device)
        # Per position, the smallest logit the truncation keeps: the backward masks with it
        # instead of finding the set again.
        cuts = torch.full((n, 1), float("-inf"), dtype=compute, device=logits.device)
        buffer = torch.empty(min(chunk_size, n), V, dtype=compute, device=logits.device)
        for lo, hi in _chunks(n, chunk_size):
            x = _load_scaled(buffer, logits, lo, hi, temperature)
            if truncation is not None:
                cuts[lo:hi] = thresholds(x, truncation.top_k, truncation.top_p, truncation.min_p)
                outside[lo:hi] = _mask_keeping_targets(x, flat_targets[lo:hi], cuts[lo:hi])
            picked[lo:hi] = x.gather(1, flat_targets[lo:hi]).squeeze(1)
            # logsumexp in place: torch.logsumexp would allocate a second chunk-sized tensor.
            # As there, an infinite row maximum is shifted by 0 instead (inf - inf is NaN).
            row_max = x.amax(1, keepdim=True)
            row_max = torch.where(row_max.isinf(), 0.0, row_max)
            lse[lo:hi] = x.sub_(row_max).exp_().sum(1).log_().add_(row_max.squeeze(1))
        ctx.save_for_backward(logits, targets, lse, cuts if truncation is not None else None)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(outside)
        return (picked - lse).view(B, T), outside.view(B, T)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor, _grad_outside: torch.Tensor | None):
        logits, targets, lse, cuts = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        B, T, V = logits.shape
        n = B * T
        flat_targets = targets.reshape(n, 1)
        # grad_out / tau per position: the scale of both the one-hot and the softmax term.
        scale = (grad_out.reshape(n).to(lse.dtype) / temperature).unsqueeze(1)
        grad_logits = torch.empty((B, T, V), dtype=logits.dtype, device=logits.device)
        flat_grad = grad_logits.view(n, V)
        buffer = torch.empty(min(chunk_size, n), V, dtype=lse.dtype, device=logits.device)
        for lo, hi in _chunks(n, chunk_size):
            x = _load_scaled(buffer, logits, lo, hi, temperature)
            if cuts is not None:
                # The forward's set (the same logits, the same cut): exp(-inf) = 0 outside it.
                _mask_keeping_targets(x, flat_targets[lo:hi], cuts[lo:hi])
            probs = x.sub_(lse[lo:hi].unsqueeze(1)).exp_()
            g = probs.mul_(-scale[lo:hi]).scatter_add_(1, flat_targets[lo:hi], scale[lo:hi])
            flat_grad[lo:hi].copy_(g)
        return grad_logits, None, None, None, None
