"""The CPU engine's weight reload: a checkpoint, a full published version, or a delta version.

`load(model, adapters, path, held)` runs on the engine's model thread between two steps
(engine.py, `reload_weights`). `held` is the digest of the published version the model holds
(None: the starting model, another checkpoint, or a version written before deltas existed).

* A model or checkpoint directory, or a full version: its `*.safetensors` are read, checked
  against the version's checksums when its manifest has them (shared/weights_delta.py),
  then names and shapes against the model's, and only then copied in: a bad or corrupt
  directory is a WeightsError (the engine answers it 400) and changes nothing.
* A delta version whose `base_digest` is `held`: applied in place to the live parameters
  (under their checkpoint names, LoRA-wrapped base layers included; a tied `lm_head` follows
  the embedding it is), each changed tensor verified against the manifest's checksums;
  a mismatch undoes it (`weights_delta.apply`) and falls through to:
* Any other delta (this server joined, restarted, or missed a version): logged, and its chain
  (the newest full version, then each delta) replayed and verified off to the side
  (`weights_delta.load_state`), then copied in as a full load. A chain that cannot be read
  or verified is a 400 saying what to do; the model keeps what it served.

What happened comes back as a `Reload` (the `tandem_reload_weights` answer carries its
`applied` and `delta`) and a log line.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared import weights_delta as wd

log = logging.getLogger("tandem.inference.weights")


@dataclass
class Reload:
    path: str
    applied: str  # "delta" (in place), "full" (a directory's weights), "chain" (a delta's chain replayed),
    # "held" (the version's digest is the one held already: nothing done)
    tensors: int  # tensors written
    digest: str | None  # the version now held (None: not a published version with checksums)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"applied": self.applied, "delta": self.applied == "delta", "tensors": self.tensors,
                "digest": self.digest, "seconds": round(self.seconds, 4)}


class WeightsError(ValueError):
    """A directory that cannot be loaded: the engine answers it as a 400 on `weights_path`."""


def _error(message: str) -> Exception:
    return WeightsError(message)


def load(model: Any, adapters: Any, path: Path, held: str | None) -> Reload:
    started = time.perf_counter()
    if not path.is_dir():
        raise _error(f"weights_path {str(path)!r} is not a directory")
    manifest = None
    if (path / wd.MANIFEST_FILE).is_file():
        try:
            manifest = wd.read_manifest(path)
        except wd.DeltaError as exc:
            raise _error(str(exc)) from exc
    if manifest is not None and held is not None and manifest.get("digest") == held:
        # The very weights this server holds (a version announced again after a step that left
        # them as they were, or a repeated sync): nothing to read or copy.
        return Reload(str(path), "held", 0, held, time.perf_counter() - started)
    # Under their checkpoint names even while LoRA layers wrap them (adapters.py).
    own = adapters.base_parameters() if adapters else dict(model.named_parameters())
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if manifest is not None and manifest.get("kind") == "delta":
        result = _delta(model, own, tied, path, manifest, held)
        if result is not None:
            result.seconds = time.perf_counter() - started
            return result
        try:
            incoming, manifest = wd.load_state(path)
        except wd.DeltaError as exc:
            raise _error(f"cannot load {path}: {exc}") from exc
        applied = "chain"
    else:
        incoming = _read_full(path, manifest)
        applied = "full"
    params = _targets(model, own, incoming)
    _check(path, incoming, params, own, tied)
    # Validated in full above, so a bad checkpoint never leaves the model half-updated.
    with torch.no_grad():
        for name, tensor in incoming.items():
            params[name].copy_(tensor)
    digest = manifest.get("digest") if manifest is not None and manifest.get("checksums") else None
    result = Reload(str(path), applied, len(incoming), digest, time.perf_counter() - started)
    log.info("reloaded %d tensors from %s (%s) in %.3f s", len(incoming), path, applied, result.seconds)
    return result


def _targets(model: Any, own: dict[str, Any], names: Any) -> dict[str, Any]:
    params = dict(own)
    params.update({k: v for k, v in model.named_buffers() if k in names})
    return params


def _read_full(path: Path, manifest: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise _error(f"no *.safetensors files in {str(path)!r}")
    incoming: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            incoming.update(wd.load_file(f))  # a truncated or corrupt file: DeltaError saying so
        if manifest is not None:
            wd.verify(incoming, manifest, str(path))
    except wd.DeltaError as exc:
        raise _error(str(exc)) from exc
    return incoming


def _check(path: Path, incoming: dict[str, torch.Tensor], params: dict[str, Any], own: dict[str, Any],
           tied: set[str]) -> None:
    unexpected = sorted(set(incoming) - set(params))
    if unexpected:
        raise _error(f"checkpoint {str(path)!r} has weights this model lacks: {unexpected[:5]}")
    missing = sorted(set(own) - set(incoming) - tied)
    if missing:
        raise _error(f"checkpoint {str(path)!r} lacks weights: {missing[:5]}")
    for name, tensor in incoming.items():
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise _error(f"checkpoint {str(path)!r}: {name} has shape {tuple(tensor.shape)}, "
                         f"the model expects {tuple(params[name].shape)}")


def _delta(model: Any, own: dict[str, Any], tied: set[str], path: Path, manifest: dict[str, Any],
           held: str | None) -> Reload | None:
    """The delta applied in place, or None (logged) when it has to be loaded through its chain."""
    base = manifest.get("base_version")
    if held is None or held != manifest.get("base_digest"):
        log.warning("%s is a delta on version-%s, and this server does not hold that version (digest %s, holds "
                    "%s): loading its chain in full", path, base, str(manifest.get("base_digest"))[:12],
                    (held or "weights that are no published version")[:12])
        return None
    names = set(manifest.get("checksums") or ())
    params = _targets(model, own, names)
    if names - set(params) or set(own) - names - tied:
        raise _error(f"version {path} does not fit this model: it has {sorted(names - set(params))[:5]} "
                     f"the model lacks, lacks {sorted(set(own) - names - tied)[:5]}")
    try:
        changed = wd.apply(params, wd.load_file(path / wd.DELTA_FILE), manifest, verify=True)
    except wd.DeltaError as exc:
        log.warning("the delta %s could not be applied to version-%s (%s): loading its chain in full", path, base, exc)
        return None
    log.info("applied the delta %s to version-%s in place: %d tensors, %d elements changed", path, base,
             len(changed), int(manifest.get("changed_elements") or 0))
    return Reload(str(path), "delta", len(changed), manifest.get("digest"))
