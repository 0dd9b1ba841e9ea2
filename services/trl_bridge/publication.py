"""Weights out through the sampler: write version V, probe it, `POST /weights_version`, prune.

The native trainer's own pieces do the work (services/trainer/checkpoint.py writes
`publish_dir/version-V` atomically and refuses non-finite weights; services/trainer/probe.py
computes the probe the sampler checks every reloaded inference server against). This module
only strings them together for a model that TRL and accelerate own.

Only the main process calls `publish`; the caller gathers the state dict first (a collective
under sharding) and holds the other ranks at a barrier afterwards, so that no rank asks for
batch N+1 before version N+1 is out.

With a LoRA adapter (`adapter=True`: the model is a `PeftModel`, TRL's `peft_config`) each
version is the adapter alone in PEFT's format (services/trainer/lora.py, shared/adapters.py),
posted with `adapter: true`; the probe is computed by the PeftModel, i.e. base + adapter, which
is what the servers compute once they load it.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch

from services.trainer import checkpoint as ckpt
from services.trainer.probe import DTYPE_NAMES, compute_probe, probe_token_ids
from services.trl_bridge.sampler_link import SamplerLink
from shared.wire import Sample


class Publisher:
    def __init__(self, link: SamplerLink, publish_root: Path | str, *, keep: int = 2, probe_tokens: int = 64,
                 dtype: torch.dtype | None = None, adapter: bool = False):
        if probe_tokens == 1:
            raise ValueError("probe_tokens must be 0 (no probe) or >= 2: a probe compares the logprobs of the "
                             "tokens after the first")
        self.link = link
        self.root = Path(publish_root)
        self.keep = keep
        self.probe_tokens = probe_tokens
        self.dtype = dtype
        self.adapter = adapter

    def publish(self, version: int, step: int, model: Any, state_dict: dict[str, Any],
                probe_sample: Sample | None, metrics: dict[str, float] | None = None,
                resume_step: int | None = None) -> dict[str, Any]:
        """Version `version` (= step + 1) of `model` (unwrapped; `state_dict` its full weights) out to
        the sampler; returns timings and the path for the caller's log."""
        info = self.write(version, step, model, state_dict, probe_sample)
        t0 = time.monotonic()
        path, probe = info.pop("path"), info.pop("probe")
        fresh = self.link.publish(version, str(path), probe=probe, metrics=metrics, resume_step=resume_step,
                                  adapter=self.adapter)
        # Only after publishing, so the previous version stays on disk while servers switch; and
        # never the one the sampler serves (a resumed run's re-announced versions are not served).
        ckpt.prune_published(self.root, self.keep, protect=(self.link.served_path, path))
        return {"path": str(path), "fresh": fresh, **info, "publish_s": time.monotonic() - t0}

    def write(self, version: int, step: int, model: Any, state_dict: dict[str, Any],
              probe_sample: Sample | None) -> dict[str, Any]:
        """Version `version` written to `publish_root/version-V` (full weights, or the adapter alone)
        and its probe computed: `{"path", "probe", "write_s", "probe_s", "probed"}`."""
        dtype = self.dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())
        t0 = time.monotonic()
        if self.adapter:
            from services.trainer import lora

            path = lora.publish_peft(self.root, version, model, state_dict, dtype=dtype, step=step)
        else:
            path = ckpt.publish_weights(self.root, version, state_dict, model.config, dtype=dtype, step=step)
        t_write = time.monotonic()
        probe = None
        ids = probe_token_ids(probe_sample, self.probe_tokens) if probe_sample is not None else None
        if ids is not None:
            # Matmuls in the published dtype, as the inference server computes with what it loads.
            device = next(model.parameters()).device
            compute = (contextlib.nullcontext() if dtype == torch.float32
                       else torch.autocast(device.type, dtype=dtype))
            with compute:
                probe = compute_probe(model, ids, DTYPE_NAMES.get(dtype))
        t_probe = time.monotonic()
        return {"path": path, "probe": probe, "write_s": t_write - t0, "probe_s": t_probe - t_write,
                "probed": probe is not None}
