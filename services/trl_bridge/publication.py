"""Weights out through the sampler: version V written, probed, `POST /weights_version`, pruned.

The native trainer's own pieces do the work (services/trainer/checkpoint.py writes
`publish_dir/version-V` atomically and refuses non-finite weights, whole or as a delta on the
version before; services/trainer/probe.py computes the probe the sampler checks every
reloaded inference server against; services/trainer/publication.py decides full or delta).
This module strings them together for a model that TRL and accelerate own.

Only the main process calls `publish`; the caller gathers the state dict first (a collective
under sharding). As in the native trainer, only a snapshot stays on the training loop's path:
`publish` casts the weights to the publish dtype into reused host buffers and computes the
probe on the live model (TRL's step has just ended, so it holds exactly this version's weights;
one forward of a few tokens), then hands the write, the POST and the pruning to a thread of
its own and returns. At most one publication is in flight: the next `publish` (and `wait`,
which the trainer calls at the end of training) waits for it, and raises its error. With a
sampler whose max_staleness is 0 the caller waits right away, since the next batch needs this
version.

With a LoRA adapter (`adapter=True`: the model is a `PeftModel`, TRL's `peft_config`) each
version is the adapter alone in PEFT's format (services/trainer/lora.py, shared/adapters.py),
written on the caller's thread (it is small) and posted with `adapter: true`; the probe is
computed by the PeftModel, i.e. base + adapter, which is what the servers compute once they
load it.
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from services.trainer import checkpoint as ckpt
from services.trainer import snapshot as snapshots
from services.trainer.publication import Chain, weights_writer
from services.trainer.probe import compute_probe_as_published, probe_token_ids
from services.trl_bridge.sampler_link import SamplerLink
from shared.wire import Sample


class Publisher:
    def __init__(self, link: SamplerLink, publish_root: Path | str, *, keep: int = 2, probe_tokens: int = 64,
                 dtype: torch.dtype | None = None, adapter: bool = False, full_every: int = 10):
        if probe_tokens == 1:
            raise ValueError("probe_tokens must be 0 (no probe) or >= 2: a probe compares the logprobs of the "
                             "tokens after the first")
        if not 1 <= full_every <= 1000:
            raise ValueError(f"full_every must be 1..1000 (a full version every N, deltas between), got {full_every}")
        self.link = link
        self.root = Path(publish_root)
        self.keep = keep
        self.probe_tokens = probe_tokens
        self.dtype = dtype
        self.adapter = adapter
        self.chain = Chain(full_every)  # the newest version written (the next delta's base), the buffers
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tandem-trl-publish")
        self._in_flight: concurrent.futures.Future | None = None

    def publish(self, version: int, step: int, model: Any, state_dict: dict[str, Any],
                probe_sample: Sample | None, metrics: dict[str, float] | None = None,
                resume_step: int | None = None, done: Callable[[dict[str, Any]], None] | None = None
                ) -> dict[str, Any]:
        """Version `version` (= step + 1) of `model` (unwrapped; `state_dict` its full weights) on its
        way to the sampler. Returns what the caller's loop paid: `{"publish_wait_s", "snapshot_s",
        "probe_s", "probed"}`; `done(info)` gets the rest from the publisher's thread once the
        sampler answered: path, fresh, write_s, publish_s, published_bytes, publish_kind,
        delta_fraction."""
        waited = self.wait()
        dtype = self._dtype(model)
        t0 = time.monotonic()
        if self.adapter:
            tensors, written = None, self.write(version, step, model, state_dict, None)
        else:
            tensors, written = self.chain.free_buffers(), None
            snapshots.copy_into(tensors, ckpt.untie(state_dict, model.config), dtype)
        t_snapshot = time.monotonic()
        probe = self._probe(model, probe_sample, dtype)
        t_probe = time.monotonic()
        info = {"publish_wait_s": waited, "snapshot_s": t_snapshot - t0, "probe_s": t_probe - t_snapshot,
                "probed": probe is not None}
        job = functools.partial(self._background, version, step, model.config, dtype, tensors, written, probe,
                                metrics, resume_step, done)
        self._in_flight = self._pool.submit(job)
        return info

    def wait(self) -> float:
        """Wait for the publication in flight (none: 0.0) and raise its error; the seconds waited."""
        future, t0 = self._in_flight, time.monotonic()
        if future is None:
            return 0.0
        self._in_flight = None
        future.result()
        return time.monotonic() - t0

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def write(self, version: int, step: int, model: Any, state_dict: dict[str, Any],
              probe_sample: Sample | None) -> dict[str, Any]:
        """Version `version` written whole to `publish_root/version-V` (full weights, or the adapter
        alone) and its probe computed, on the caller's thread: `{"path", "probe", "write_s",
        "probe_s", "probed"}`."""
        dtype = self._dtype(model)
        t0 = time.monotonic()
        if self.adapter:
            from services.trainer import lora

            path = lora.publish_peft(self.root, version, model, state_dict, dtype=dtype, step=step)
        else:
            path = ckpt.publish_weights(self.root, version, state_dict, model.config, dtype=dtype, step=step)
        t_write = time.monotonic()
        probe = self._probe(model, probe_sample, dtype)
        return {"path": path, "probe": probe, "write_s": t_write - t0, "probe_s": time.monotonic() - t_write,
                "probed": probe is not None}

    # -- the publisher's thread ---------------------------------------------------------------

    def _background(self, version: int, step: int, config: Any, dtype: torch.dtype, tensors: dict[str, Any] | None,
                    written: dict[str, Any] | None, probe: dict[str, Any] | None, metrics: dict[str, float] | None,
                    resume_step: int | None, done: Callable[[dict[str, Any]], None] | None) -> None:
        info: dict[str, Any] = {}
        if written is not None:
            path = written["path"]
            info.update(write_s=written["write_s"], publish_kind="full", published_bytes=ckpt.dir_bytes(path))
        else:
            t0 = time.monotonic()
            version_out = self.chain.write(weights_writer(self.root, config, dtype), version, step, tensors)
            path = version_out.path
            info.update(write_s=time.monotonic() - t0, **version_out.facts())
        t0 = time.monotonic()
        info["fresh"] = self.link.publish(version, str(path), probe=probe, metrics=metrics, resume_step=resume_step,
                                          adapter=self.adapter)
        info["publish_s"] = time.monotonic() - t0
        # Only after publishing, so the previous version stays on disk while servers switch; and
        # never the one the sampler serves (a resumed run's re-announced versions are not served).
        ckpt.prune_published(self.root, self.keep, protect=(self.link.served_path, path))
        if done is not None:
            done({"path": str(path), **info})

    # -- helpers ------------------------------------------------------------------------------

    def _dtype(self, model: Any) -> torch.dtype:
        return self.dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())

    def _probe(self, model: Any, probe_sample: Sample | None, dtype: torch.dtype) -> dict[str, Any] | None:
        ids = probe_token_ids(probe_sample, self.probe_tokens) if probe_sample is not None else None
        if ids is None:
            return None
        return compute_probe_as_published(model, ids, dtype)
