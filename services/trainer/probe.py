"""The trainer's half of the weight-sync probe (shared/probe.py explains the whole check).

Why: a 200 from `POST /weights_version` only says the inference servers accepted a
checkpoint, not that they compute with it (vLLM's CPU build once kept serving stale weights
after every in-place reload, and nothing failed). So with every checkpoint it publishes, the
trainer sends a short token sequence (the first sample of the step's batch) and its own
log-probability of each token given the ones before it, computed under exactly the weights it
just saved; the sampler asks each server for the same numbers after loading the checkpoint and
takes a server that disagrees out of rotation. One forward of at most `probe_tokens` tokens.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import torch

from shared import codec
from shared.wire import Sample

# torch dtype -> the probe's dtype name (picks the sampler's tolerance).
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def saved_dtype(model: Any) -> str:
    """The dtype `save_pretrained` writes `model`'s weights in: that of its floating parameters
    (checkpoint.save_checkpoint saves the model as it is, without casting)."""
    for param in model.parameters():
        if param.is_floating_point():
            name = DTYPE_NAMES.get(param.dtype)
            if name is None:
                raise ValueError(f"the model's weights are {param.dtype}; a probe knows float32, bfloat16 "
                                 "and float16")
            return name
    raise ValueError("the model has no floating-point parameters")


def probe_token_ids(sample: Sample, limit: int) -> list[int] | None:
    """The sample's prompt + completion, cut to its first `limit` tokens; None when that leaves
    fewer than 2 (nothing to compare) or `limit` is 0 (probe disabled)."""
    if limit <= 0:
        return None
    ids = [int(t) for t in codec.plain(sample.prompt_token_ids)]
    if len(ids) < limit:
        ids += [int(t) for t in codec.plain(sample.completion_token_ids)[: limit - len(ids)]]
    ids = ids[:limit]
    return ids if len(ids) >= 2 else None


def compute_probe(model: Any, token_ids: list[int], dtype: str | None = None) -> dict[str, Any]:
    """`{"token_ids", "logprobs", "dtype"}` for `shared.probe.Probe`: logprobs[i] = log p(token_ids[i]
    | token_ids[:i]) under `model` at temperature 1 (logprobs[0] is None). The forward runs in the
    model's own dtype, as the inference server's does; the log-softmax in float32. `dtype` names the
    dtype of the published weights (default: the model's, which is what the checkpoint holds)."""
    if len(token_ids) < 2:
        raise ValueError(f"a probe needs at least 2 tokens, got {len(token_ids)}")
    device = next(model.parameters()).device
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()  # no dropout: the server computes the deterministic forward
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    finally:
        model.train(was_training)
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    # log_softmax is <= 0 mathematically; clamp so rounding cannot produce a value the wire refuses.
    values = [min(float(x), 0.0) for x in logprobs.cpu()]
    return {"token_ids": [int(t) for t in token_ids], "logprobs": [None, *values],
            "dtype": dtype or saved_dtype(model)}


def compute_probe_as_published(model: Any, token_ids: list[int], dtype: torch.dtype) -> dict[str, Any]:
    """`compute_probe` with the matmuls in the published `dtype` (autocast, which is per thread:
    call it on the thread that runs the forward), as the inference server computes with the
    weights it loads; float32 needs no autocast."""
    import contextlib

    device = next(model.parameters()).device
    compute = contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)
    with compute:
        return compute_probe(model, token_ids, DTYPE_NAMES.get(dtype))


async def probe_live_weights(ids: list[int] | None, model: Any, dtype: torch.dtype, sharding: Any, *, is_main: bool,
                             in_thread: Callable[..., Awaitable[Any]]) -> dict[str, Any] | None:
    """The probe of the live model in the publish dtype, on the trainer's torch thread
    (`in_thread`): rank 0's (None elsewhere; `ids` are rank 0's). Under fsdp the forward is a
    collective, so every rank runs it on rank 0's ids."""
    collective = sharding.kind == "fsdp"
    if collective:
        ids = await in_thread(sharding.broadcast_object, ids)
    if ids is None or not (collective or is_main):
        return None

    def probe_in_publish_dtype() -> dict[str, Any]:
        try:
            return compute_probe_as_published(model, ids, dtype)
        finally:
            sharding.reshard(model)

    probe = await in_thread(probe_in_publish_dtype)
    return probe if is_main else None
