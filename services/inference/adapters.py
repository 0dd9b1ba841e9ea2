"""LoRA adapters on the CPU server, loaded at runtime and chosen per request, as vLLM serves them
(`--enable-lora`, on by default here since it costs nothing unused; docs/inference-api.md). The
adapter layout is shared/adapters.py's.

* `load(name, path, inplace)` reads a PEFT adapter directory (adapter_config.json +
  adapter_model.safetensors) and serves it as model `name`. A request naming it is computed
  with base + adapter; the other rows of the same engine step keep their own adapter or none,
  in one forward (peft's mixed batch: `adapter_names`, one per row, "__base__" for the base).
* Nothing is half-loaded: the files are read and checked on a worker thread (the engine keeps
  stepping meanwhile); then, on the engine's model thread between two steps, the weights go into
  a fresh peft adapter ("slot"), are checked against the model's own LoRA layers, and only then
  does the name point at the slot. A failed load removes its slot; the old weights keep serving.
* In place (same name): sequences hold the name's `Adapter` record, not the slot, so every
  sequence in flight (running, waiting, or frozen by `pause keep`) computes its next token with
  the new weights, exactly as after a full reload; the old slot is dropped at once.
* `unload(name)` removes the name (a new request naming it is a 404, as in vLLM) and frees its
  slot, unless sequences hold it: they finish with it, and the next load or unload frees it.
* peft wraps the model's target Linear layers in place when the first adapter loads and unwraps
  them when the last slot goes, so a server that never loads one runs the bare model.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.inference.engine import Engine
from services.inference.request_error import RequestError
from shared.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS

log = logging.getLogger("tandem.inference.adapters")

BASE = "__base__"  # peft's adapter_names entry for a row computed with the base model alone
DISABLED = ("LoRA adapters are not enabled on this server (started with --no-enable-lora): start it with "
            "--enable-lora, or leave the flag out (on by default on the CPU server; vLLM needs --enable-lora and "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)")


@dataclass(frozen=True)
class Limits:
    max_rank: int = 16  # vLLM's --max-lora-rank
    max_loras: int = 4  # adapters loaded at once (vLLM: adapters in one batch)


@dataclass(eq=False)
class Adapter:
    """A served adapter name. `slot` is the peft adapter that holds its weights now; None once
    unloaded and freed."""

    name: str
    path: str
    slot: str | None
    created: int


@dataclass
class _Files:
    config: Any  # peft.LoraConfig
    tensors: dict[str, Any]  # PEFT's tensor names -> tensors in the model's dtype


class Adapters:
    def __init__(self, engine: Engine, limits: Limits):
        self.engine = engine
        self.model = engine.model
        self.limits = limits
        self.loaded: dict[str, Adapter] = {}
        self._peft: Any = None  # peft.PeftModel around self.model while any slot exists
        self._retired: list[Adapter] = []  # unloaded, maybe still used by sequences in flight
        self._slots = itertools.count()

    def get(self, name: str) -> Adapter | None:
        return self.loaded.get(name)

    @property
    def slots(self) -> int:
        """Adapters whose weights are in the model: the loaded ones, and unloaded ones still in use."""
        return len(self._peft.peft_config) if self._peft is not None else 0

    # ----------------------------------------------------------------- event loop

    async def load(self, name: str, path: str, inplace: bool) -> None:
        self._check_new(name, inplace)  # answered before any file is read
        files = await asyncio.to_thread(self._read, name, path)

        def claim() -> list[str]:
            self._check_new(name, inplace)  # again: another load of this name may have finished meanwhile
            return self._unused()

        await self.engine.exclusive(self._install, name, path, files, before=claim)
        log.info("loaded LoRA adapter %r from %s%s", name, path, " in place" if inplace else "")

    async def unload(self, name: str) -> None:
        if not name:
            raise RequestError("'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")

        def retire() -> list[str]:
            adapter = self.loaded.pop(name, None)
            if adapter is None:
                raise RequestError(f"The lora adapter '{name}' cannot be found.", status=404, param="lora_name")
            self._retired.append(adapter)
            return self._unused()

        await self.engine.exclusive(self._drop_all, before=retire)
        log.info("unloaded LoRA adapter %r", name)

    def _unused(self) -> list[str]:
        """The slots of unloaded adapters that no sequence holds, taken from their records (on the
        event loop, between two steps): a request that named one but has not reached the engine
        yet is then a 404 there, never a step on freed weights."""
        in_use = self.engine.adapters_in_use()
        free = [a for a in self._retired if a not in in_use]
        self._retired = [a for a in self._retired if a in in_use]
        slots = [a.slot for a in free if a.slot is not None]
        for adapter in free:
            adapter.slot = None
        return slots

    def _check_new(self, name: str, inplace: bool) -> None:
        if name in self.loaded and not inplace:
            raise RequestError(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                               "adapter in place, set 'load_inplace' to True.", param="lora_name")
        if name not in self.loaded and len(self.loaded) >= self.limits.max_loras:
            raise RequestError(
                f"{len(self.loaded)} LoRA adapters are loaded, max_loras is {self.limits.max_loras}: unload one "
                "(POST /v1/unload_lora_adapter) or start the server with a larger --max-loras", param="lora_name")

    # ----------------------------------------------------------------- a worker thread

    def _read(self, name: str, path: str) -> _Files:
        """The adapter's config and tensors, checked against what this server serves."""
        from peft import LoraConfig
        from safetensors.torch import load_file

        where = Path(path)
        if not (where / ADAPTER_CONFIG).is_file():
            raise RequestError(f"Loading lora {name} failed: No adapter found for {path} (a PEFT adapter "
                               f"directory holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})", status=404,
                               param="lora_path")
        if not (where / ADAPTER_WEIGHTS).is_file():
            raise RequestError(f"Loading lora {name} failed: {path} has no {ADAPTER_WEIGHTS} (save the adapter "
                               "with save_pretrained(..., safe_serialization=True))", status=404, param="lora_path")
        try:
            raw = json.loads((where / ADAPTER_CONFIG).read_text())
            kind = raw.get("peft_type")
            if kind != "LORA":
                raise ValueError(f"peft_type is {kind!r}; only LoRA adapters are served")
            config = LoraConfig.from_pretrained(str(where))
        except Exception as exc:  # noqa: BLE001 - a broken file is the request's fault
            raise RequestError(f"{path}/{ADAPTER_CONFIG} is not a PEFT LoRA config: {exc}", param="lora_path") from None
        rank = max([config.r, *(config.rank_pattern or {}).values()])
        problems = []
        if rank > self.limits.max_rank:
            problems.append(f"LoRA rank {rank} is greater than max_lora_rank {self.limits.max_rank} (start the "
                            f"server with --max-lora-rank {rank} or more).")
        # What vLLM refuses too, so an adapter the CPU server takes is one vLLM takes.
        if config.bias != "none":
            problems.append("Adapter bias is not supported.")
        if config.modules_to_save:
            problems.append(f"modules_to_save ({sorted(config.modules_to_save)}) is not supported.")
        if config.use_dora:
            problems.append("DoRA adapters are not supported.")
        if problems:
            raise RequestError(f"Loading lora {name} from {path} failed: " + " ".join(problems), param="lora_path")
        config.inference_mode = True
        try:
            tensors = load_file(str(where / ADAPTER_WEIGHTS))
        except Exception as exc:  # noqa: BLE001
            raise RequestError(f"{path}/{ADAPTER_WEIGHTS} could not be read: {exc}", param="lora_path") from None
        dtype = next(self.model.parameters()).dtype
        return _Files(config, {k: v.to(dtype) for k, v in tensors.items()})

    # ----------------------------------------------------------------- the model thread, between steps

    def _install(self, name: str, path: str, files: _Files, free: list[str]) -> None:
        self._drop_all(free)
        current = self.loaded.get(name)
        if current is not None and current.slot is not None and self._same_shape(current.slot, files.config):
            # A new version of the same adapter (what the sampler loads every step): its tensors are
            # copied into the slot it already has, a few MB, instead of building LoRA layers again
            # (0.9 s for a 0.5 B model). Sequences hold the record, so they see the copy at once.
            self._check_fit(current.slot, path, files)
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self._peft, files.tensors, adapter_name=current.slot)
            current.path = path
            return
        slot = f"lora{next(self._slots)}"  # peft names become module keys: no dots
        try:
            self._fill(slot, path, files)
        except Exception as exc:
            if self._peft is not None and slot in self._peft.peft_config:
                self._drop(slot)
            if isinstance(exc, RequestError):
                raise
            raise RequestError(f"Loading lora {name} from {path} failed: the adapter does not fit the served "
                               f"model: {exc}", param="lora_path") from None
        if current is None:
            self.loaded[name] = Adapter(name, path, slot, int(time.time()))
            return
        old, current.slot, current.path = current.slot, slot, path
        self._drop(old)

    def _same_shape(self, slot: str, config: Any) -> bool:
        """Whether an adapter of `config` fits `slot`'s LoRA layers as they are: same targets,
        ranks and scaling (the tensors may differ)."""
        have = self._peft.peft_config[slot]

        def shape(c: Any) -> tuple:
            targets = c.target_modules if isinstance(c.target_modules, str) else sorted(c.target_modules)
            return (targets, c.r, c.lora_alpha, c.use_rslora, dict(c.rank_pattern or {}), dict(c.alpha_pattern or {}))

        return shape(have) == shape(config)

    def _fill(self, slot: str, path: str, files: _Files) -> None:
        from peft import PeftModel, set_peft_model_state_dict

        if self._peft is None:
            self._peft = PeftModel(self.model, files.config, adapter_name=slot)
        else:
            self._peft.add_adapter(slot, files.config)
        self._peft.eval()  # new LoRA modules start in training mode (live dropout)
        self._check_fit(slot, path, files)
        set_peft_model_state_dict(self._peft, files.tensors, adapter_name=slot)

    def _check_fit(self, slot: str, path: str, files: _Files) -> None:
        """RequestError unless `files` has exactly the tensors of `slot`'s LoRA layers, in their shapes."""
        from peft import get_peft_model_state_dict

        expected = get_peft_model_state_dict(self._peft, adapter_name=slot)
        unexpected = sorted(set(files.tensors) - set(expected))
        missing = sorted(set(expected) - set(files.tensors))
        if unexpected or missing:
            what = (f"weights for modules the served model lacks, or its config does not target: {unexpected[:3]}"
                    if unexpected else f"no weights for {missing[:3]}")
            raise RequestError(f"{path}/{ADAPTER_WEIGHTS} has {what} ({len(unexpected or missing)} in all); is it an "
                               "adapter of the served model?", param="lora_path")
        for key, tensor in files.tensors.items():
            if tuple(tensor.shape) != tuple(expected[key].shape):
                raise RequestError(f"{path}/{ADAPTER_WEIGHTS}: {key} has shape {tuple(tensor.shape)}, the served "
                                   f"model needs {tuple(expected[key].shape)}: is it an adapter of another model?",
                                   param="lora_path")

    def _drop_all(self, slots: list[str]) -> None:
        for slot in slots:
            self._drop(slot)

    def _drop(self, slot: str) -> None:
        others = [s for s in self._peft.peft_config if s != slot]
        if not others:
            self._peft.unload()  # the bare model again: its Linear layers back in place
            self._peft = None
            return
        if self._peft.active_adapter == slot:
            # peft keeps one adapter "active"; rows always name theirs, so any live one will do.
            self._peft.set_adapter(others[0])
        self._peft.delete_adapter(slot)

    def forward(self, adapters: list[Adapter | None], **kwargs: Any) -> Any:
        """The model's forward with each row's adapter (None: the base model)."""
        if self._peft is None:
            return self.model(**kwargs)
        # Always named: without adapter_names, peft would apply its active adapter to every row.
        names = [a.slot if a is not None else BASE for a in adapters]
        return self._peft(**kwargs, adapter_names=names)

    def base_parameters(self) -> dict[str, Any]:
        """The model's own parameters under their checkpoint names (a full-weights reload), with
        or without LoRA layers around them."""
        params = self.model.named_parameters()
        if self._peft is None:
            return dict(params)
        return {n.replace(".base_layer.", "."): p for n, p in params if ".lora_" not in n}
