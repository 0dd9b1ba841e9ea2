"""LoRA adapters: the rules the trainer, the sampler and the inference servers agree on.

A LoRA run trains a low-rank adapter on a frozen base model. Every version the trainer
publishes is then the adapter alone, in PEFT's format, in a directory of its own:

    version-V/
      adapter_config.json          PEFT's LoraConfig (r, lora_alpha, target_modules, ...)
      adapter_model.safetensors    the adapter's tensors, PEFT's names
                                   (base_model.model.<module>.lora_A.weight / lora_B.weight)
      published.json               {"version", "step", "dtype", "adapter": true}

It is posted as `POST /weights_version {"checkpoint_path": "<dir>", "adapter": true, ...}`.
The sampler loads it into every inference server under one name, `adapter_name` (sampler
setting, default `DEFAULT_ADAPTER_NAME`), with vLLM's runtime adapter API:

    POST /v1/load_lora_adapter    {"lora_name": NAME, "lora_path": DIR, "load_inplace": true}

in place of the full-weights reload (pause, label, cache reset, resume and probe stay as they
are), and from then on sends every request with `"model": NAME`. In place, under one name,
because then a request frozen by the pause continues on the new adapter after resume, as a
full reload does, and the per-token version labels stay true.

The servers keep serving their base model under its own name; version 0 of a LoRA run is the
base model (PEFT starts lora_B at zero, so base + the untrained adapter = base).
"""

from __future__ import annotations

from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
DEFAULT_ADAPTER_NAME = "tandem-lora"

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


def is_adapter_dir(path: str | Path) -> bool:
    """True when `path` holds a PEFT adapter (its config and its safetensors weights)."""
    path = Path(path)
    return (path / ADAPTER_CONFIG).is_file() and (path / ADAPTER_WEIGHTS).is_file()


def load_request(name: str, path: str | Path) -> dict[str, object]:
    """The body of `POST /v1/load_lora_adapter` that (re)loads adapter `name` from `path` in place."""
    return {"lora_name": name, "lora_path": str(path), "load_inplace": True}
