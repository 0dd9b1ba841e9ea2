"""The one part of a publication on the trainer's critical path: the weights copied aside.

`take(sharding, model, dtype, into)` casts every published tensor to the publish dtype where
it lives (on the GPU, before it crosses to the host: half of float32's bytes for bf16) and
copies it into `into`, rank 0's host buffers, allocated on first use and reused after (pinned
when the model is on a GPU, so the copy is a DMA). Under fsdp each shard is cast first and then
all-gathered, one tensor at a time, every rank in the same order (a collective). What is
published: the state dict with a tied LM head left out (loaders tie it back) and each shared
tensor once, keyed like the published file.

The trainer keeps two such buffer sets (services/trainer/publication.py): one holds the version
being (or last) published, the other takes the next snapshot, so the optimizer may move the
live weights the moment `take` returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def publishable(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of what a published version holds."""
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if id(tensor) in seen or (tied and name == "lm_head.weight"):
            continue
        seen.add(id(tensor))
        yield name, tensor.detach()


def take(sharding: Any, model: torch.nn.Module, dtype: torch.dtype, into: dict[str, torch.Tensor],
         *, trainable_only: bool = False) -> None:
    """COLLECTIVE under fsdp: the published weights into rank 0's buffers `into` (see the module
    docstring); `trainable_only`: the parameters that train alone (a LoRA run's adapter)."""
    from torch.distributed.tensor import DTensor

    if trainable_only:
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        items: Any = ((n, p.detach()) for n, p in model.named_parameters() if n in trained)
    else:
        items = publishable(model)
    for name, tensor in items:
        tensor = _cast(tensor, dtype)  # on the tensor's own device (a DTensor casts its shard)
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()  # every rank, same order
        if sharding.is_main:
            _copy_into(into, name, tensor)
    if sharding.is_main:
        _settle(into)


def copy_into(into: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """`tensors` (a gathered state dict, untied) cast to `dtype` where they are and copied into
    the reusable buffers `into` (the TRL bridge's snapshot: accelerate did the gathering)."""
    for name, tensor in tensors.items():
        _copy_into(into, name, _cast(tensor.detach(), dtype))
    _settle(into)


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor


def _settle(into: dict[str, torch.Tensor]) -> None:
    if torch.cuda.is_available() and any(t.is_pinned() for t in into.values()):
        torch.cuda.synchronize()  # the non-blocking copies into pinned buffers have landed


def _copy_into(into: dict[str, torch.Tensor], name: str, tensor: torch.Tensor) -> None:
    buffer = into.get(name)
    if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
        pin = tensor.is_cuda and torch.cuda.is_available()
        buffer = into[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
    buffer.copy_(tensor, non_blocking=tensor.is_cuda)

