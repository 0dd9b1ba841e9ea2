"""Delta versions on the trainer's side: writing one.

A published version (services/trainer/checkpoint.py) is either full or a delta on the
version before it (format: shared/weights_delta.py). The caller decides which (a full one
every so often, and whenever a delta cannot be made: `publish_delta` raises DeltaError) and
keeps the publish-dtype snapshot of the version it published last (`snapshot`) as the next
delta's base.

Pruning (`checkpoint.prune_published`) keeps with every kept version the versions it is built
from, down to its full root (`weights_delta.bases_on_disk`): a kept delta is never left
without its base, so a server that joins or restarts can always replay the chain.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from services.trainer import checkpoint as ckpt
from shared.weights_delta import (
    DELTA_FILE, ENCODING, DeltaError, checksums, encode, read_manifest, state_digest,
)

log = logging.getLogger("tandem.trainer.versions")


def snapshot(state_dict: dict[str, Any], config: Any, dtype: Any) -> dict[str, Any]:
    """What a version publishes, as detached tensors in `dtype`, tied duplicates left out: pass
    it to `publish_weights` or `publish_delta`, and keep it as the next delta's base."""
    return ckpt.cast_tensors(ckpt.untie(state_dict, config), dtype)


def publish_delta(publish_root: Path | str, version: int, tensors: dict[str, Any], base_tensors: dict[str, Any],
                  base_manifest: dict[str, Any], config: Any, *, dtype: Any, step: int,
                  max_share: float = 1.0) -> tuple[Path, dict[str, Any]]:
    """Write `publish_root/version-{version}` as the delta from the version `base_manifest`
    describes (whose weights are `base_tensors`) to `tensors`, both publish-dtype snapshots
    (`snapshot`); atomically and refusing non-finite values, like every version
    (`checkpoint.write_version`). Returns its path and manifest. DeltaError when no delta
    can be made (the base has no digest, is no longer on disk, is not `base_tensors`, or the
    tensors differ in names, shapes or dtypes), and when the delta's bytes would exceed
    `max_share` of the full version's: write a full version instead."""
    root = Path(publish_root)
    dtype_name = str(dtype).removeprefix("torch.")
    base_version, base_digest = base_manifest.get("version"), base_manifest.get("digest")
    if base_version is None or not base_digest:
        raise DeltaError(f"version {base_version} has no digest (written before deltas existed): "
                         f"write version {version} in full")
    if base_version == version:
        raise DeltaError(f"version {version} cannot be a delta on itself: write it in full")
    if base_manifest.get("dtype") != dtype_name:
        raise DeltaError(f"version {base_version} is {base_manifest.get('dtype')}, version {version} {dtype_name}: "
                         "write it in full")
    base_dir = ckpt.version_path(root, base_version)
    try:
        on_disk = read_manifest(base_dir).get("digest")
    except DeltaError:
        on_disk = None
    if on_disk != base_digest:
        raise DeltaError(f"{base_dir} is gone or holds other weights: a delta on it could not be loaded; "
                         f"write version {version} in full")
    if state_digest(checksums(base_tensors)) != base_digest:
        raise DeltaError(f"the base snapshot is not version {base_version}'s weights: write version {version} in full")
    delta, changed, total = encode(base_tensors, tensors)
    share = ckpt.tensor_bytes(delta) / max(ckpt.tensor_bytes(tensors), 1)
    if share > max_share:
        raise DeltaError(f"{changed / max(total, 1):.1%} of the values changed, so a delta would be {share:.0%} of the "
                         f"full version: write version {version} in full")
    sums = checksums(tensors)
    full_version = base_manifest.get("full_version", base_version) if base_manifest.get("kind") == "delta" \
        else base_version

    def write(tmp: Path) -> Path:
        from safetensors.torch import save_file

        save_file(delta, str(tmp / DELTA_FILE), metadata={"format": "pt", "encoding": ENCODING})
        ckpt.write_config(tmp, config, dtype)
        return tmp / DELTA_FILE

    marker = {"kind": "delta", "encoding": ENCODING, "base_version": base_version, "base_digest": base_digest,
              "digest": state_digest(sums), "checksums": sums, "full_version": full_version,
              "changed_elements": changed, "total_elements": total}
    path = ckpt.write_version(root, version, tensors, dtype=dtype, step=step, write=write, marker=marker,
                              needed=ckpt.tensor_bytes(delta))
    log.debug("published version-%d as a delta on version-%s: %d of %d elements changed", version, base_version,
              changed, total)
    return path, read_manifest(path)
