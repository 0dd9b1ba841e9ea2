"""Per-row sampling for one batched decode step, with vLLM's `processed_logprobs` semantics.

Each row has its own temperature, top-p, top-k and random generator. The logprobs reported
are those of the distribution actually sampled from: `log_softmax` of the logits after
temperature scaling and top-k/top-p masking (masked tokens get -inf). Greedy rows
(temperature 0) take the argmax and report `log_softmax` of the raw logits, as vLLM does.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1) drawn from the row's
own generator), so a seeded request's tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowParams:
    temperature: float
    top_p: float
    top_k: int  # <= 0: disabled
    generator: torch.Generator
    num_top_logprobs: int | None  # None: the caller wants no top-logprobs
    banned: tuple[int, ...] = ()  # token ids masked for this step (EOS before min_tokens)


@dataclass
class StepSample:
    tokens: list[int]
    logprobs: list[float]
    # Per row: [(token_id, logprob), ...] best first, or None when not requested.
    top: list[list[tuple[int, float]] | None]


def _mask_top_k_top_p(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_z, order = torch.sort(z, dim=-1, descending=True)
    vocab = z.shape[-1]
    ranks = torch.arange(vocab, device=z.device).expand_as(sorted_z)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    drop = ranks >= k[:, None]
    probs = torch.softmax(sorted_z.masked_fill(drop, float("-inf")), dim=-1)
    # Drop a token when the tokens strictly before it already reach top_p; the best token stays.
    before = torch.cumsum(probs, dim=-1) - probs
    drop |= before >= top_p[:, None]
    drop[:, 0] = False
    mask = torch.zeros_like(drop).scatter(-1, order, drop)
    return z.masked_fill(mask, float("-inf"))


def sample(logits: torch.Tensor, rows: list[RowParams]) -> StepSample:
    """Sample one token per row of `logits` [B, V] (float32)."""
    logits = logits.float()
    for i, row in enumerate(rows):
        if row.banned:
            logits[i, list(row.banned)] = float("-inf")
    greedy = torch.tensor([r.temperature == 0.0 for r in rows])
    temps = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in rows])
    z = logits / temps[:, None]
    top_k = torch.tensor([0 if r.temperature == 0 else r.top_k for r in rows])
    top_p = torch.tensor([1.0 if r.temperature == 0 else r.top_p for r in rows])
    if bool(((top_k > 0) | (top_p < 1.0)).any()):
        z = _mask_top_k_top_p(z, top_k, top_p)
    logprobs = torch.log_softmax(z, dim=-1)
    if bool((~greedy).any()):
        noise = torch.stack([
            torch.empty(logits.shape[-1]).exponential_(generator=r.generator) for r in rows
        ])
        sampled = torch.argmax(logprobs - noise.log(), dim=-1)
    else:
        sampled = torch.zeros(len(rows), dtype=torch.long)
    tokens = torch.where(greedy, torch.argmax(logits, dim=-1), sampled)
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)

    top: list[list[tuple[int, float]] | None] = [None] * len(rows)
    want = [r.num_top_logprobs for r in rows if r.num_top_logprobs]
    if want:
        k = min(max(want), logprobs.shape[-1])
        values, ids = torch.topk(logprobs, k, dim=-1)
        values_l, ids_l = values.tolist(), ids.tolist()
        for i, r in enumerate(rows):
            if r.num_top_logprobs:
                n = r.num_top_logprobs
                top[i] = list(zip(ids_l[i][:n], values_l[i][:n]))
            elif r.num_top_logprobs == 0:
                top[i] = []
    else:
        for i, r in enumerate(rows):
            if r.num_top_logprobs == 0:
                top[i] = []
    return StepSample(tokens=tokens.tolist(), logprobs=chosen.tolist(), top=top)
