"""A left-padded, batch-major KV cache that sequences join and leave between decode steps.

Continuous batching on top of Hugging Face models: every running sequence is one row of a
per-layer [B, heads, T, head_dim] key/value tensor, left-padded to the longest row, with a
[B, T] attention mask and explicit per-row position ids (so padding never shifts RoPE or
learned positions). Rows leave with `select`, new rows are prefilled separately and
`merge`d in. Only plain full-attention caches (transformers' `DynamicLayer`) qualify; models
with sliding-window or recurrent layers are rejected at start-up by `check_supported`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KV = list[tuple[torch.Tensor, torch.Tensor]]


def to_tensors(cache) -> KV:
    """The per-layer (keys, values) of a transformers cache object."""
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache))  # older transformers


def from_tensors(kv: KV):
    from transformers import DynamicCache

    try:
        return DynamicCache(ddp_cache_data=kv)
    except TypeError:  # older transformers
        return DynamicCache.from_legacy_cache(tuple(kv))


def check_supported(cache) -> None:
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if layers is None:
        return
    odd = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    if odd:
        raise ValueError(
            f"the CPU inference server batches full-attention models only; this model's cache has "
            f"{odd} layers (sliding-window or recurrent attention): serve it with --backend vllm"
        )


@dataclass
class Batch:
    """KV state of the running rows. `pending[i]` is row i's last sampled token, not yet in the cache."""

    kv: KV
    mask: torch.Tensor  # [B, T] long, 1 = real token
    lengths: torch.Tensor  # [B] long, real tokens per row (= next position id)
    pending: torch.Tensor  # [B] long

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    def select(self, rows: list[int]) -> Batch:
        """Keep `rows` (in that order) and drop the padding columns no kept row needs."""
        idx = torch.tensor(rows, dtype=torch.long)
        mask = self.mask.index_select(0, idx)
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else mask.shape[1]
        return Batch(
            kv=[(k.index_select(0, idx)[:, :, start:], v.index_select(0, idx)[:, :, start:]) for k, v in self.kv],
            mask=mask[:, start:],
            lengths=self.lengths.index_select(0, idx),
            pending=self.pending.index_select(0, idx),
        )

    @staticmethod
    def merge(a: Batch | None, b: Batch) -> Batch:
        """Rows of `a` then rows of `b`, left-padded to a common length."""
        if a is None or a.size == 0:
            return b
        t = max(a.mask.shape[1], b.mask.shape[1])

        def pad(x: torch.Tensor, dim_from_end: int) -> torch.Tensor:
            missing = t - x.shape[-dim_from_end]
            if missing == 0:
                return x
            spec = [0, 0] * (dim_from_end - 1) + [missing, 0]
            return F.pad(x, spec)

        kv = [
            (torch.cat([pad(ka, 2), pad(kb, 2)]), torch.cat([pad(va, 2), pad(vb, 2)]))
            for (ka, va), (kb, vb) in zip(a.kv, b.kv)
        ]
        return Batch(
            kv=kv,
            mask=torch.cat([pad(a.mask, 1), pad(b.mask, 1)]),
            lengths=torch.cat([a.lengths, b.lengths]),
            pending=torch.cat([a.pending, b.pending]),
        )


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask and position_ids for left-padded `prompts`."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions
