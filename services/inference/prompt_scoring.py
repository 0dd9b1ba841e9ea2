"""Prompt logprobs: each prompt token's logprob (and rank, and the top k) given the tokens before it.

One unpadded forward of the prompt with every position's logits. Used for a completion's
`prompt_logprobs` (the sampler's post-sync probe, scoring) and for the probe that
`tandem_reload_weights` answers inline (routes/weights.py): the same numbers either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from services.inference.sequences import PromptLogprobs


def prompt_logprobs(logits_of: Callable[[torch.Tensor], torch.Tensor], prompt_ids: Sequence[int],
                    k: int) -> PromptLogprobs:
    """`logits_of(ids [1, L])` -> the logits [1, L, V]. Entry i is token i + 1: [(token, logprob,
    rank), then up to k others of the top k, best first]."""
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    logits = logits_of(ids)[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = ids[0, 1:]
    chosen = logprobs.gather(1, targets[:, None])
    # vLLM's rank: how many vocabulary entries have a logprob >= the token's (1 = the argmax).
    ranks = (logprobs >= chosen).sum(dim=1)
    top = torch.topk(logprobs, k, dim=1) if k > 0 else None
    out: PromptLogprobs = []
    for i, token in enumerate(targets.tolist()):
        entries = [(token, float(chosen[i, 0]), int(ranks[i]))]
        if top is not None:
            for r, (tid, lp) in enumerate(zip(top.indices[i].tolist(), top.values[i].tolist()), start=1):
                if tid != token:
                    entries.append((tid, float(lp), r))
        out.append(entries)
    return out
