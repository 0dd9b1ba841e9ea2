"""Per-row sampling for one batched decode step, with vLLM's `processed_logprobs` semantics.

Each row has its own temperature, min-p, top-k, top-p and random generator. The logprobs
reported are those of the distribution actually sampled from: `log_softmax` of the logits
after temperature scaling and min-p/top-k/top-p masking in vLLM's order (masked tokens get
-inf). Greedy rows (temperature 0) take the argmax and report `log_softmax` of the raw
logits, as vLLM does.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1) drawn from the row's
own generator), so a seeded request's tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.truncation import truncate_


@dataclass
class RowParams:
    temperature: float
    top_p: float
    top_k: int  # <= 0: disabled
    generator: torch.Generator
    num_top_logprobs: int | None  # None: the caller wants no top-logprobs
    banned: tuple[int, ...] = ()  # token ids masked for this step (EOS before min_tokens)
    min_p: float = 0.0  # 0: disabled


@dataclass
class StepSample:
    tokens: list[int]
    logprobs: list[float]
    # Per row: [(token_id, logprob), ...] best first, or None when not requested.
    top: list[list[tuple[int, float]] | None]


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
    min_p = torch.tensor([0.0 if r.temperature == 0 else r.min_p for r in rows])
    if bool(((top_k > 0) | (top_p < 1.0) | (min_p > 0.0)).any()):
        truncate_(z, top_k, top_p, min_p)  # the rule the trainer scores with (shared/truncation.py)
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
