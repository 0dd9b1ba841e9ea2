"""Delta weight versions: version V+1 published as what changed since V, in the publish dtype.

At RL learning rates only ~1% of the bfloat16 values of a model change in a step, so the
trainer may write a version as a sparse difference from the one before it instead of all
its weights (issue 40). This module is the format, shared by the trainer
(services/trainer/versions.py), Tandem's CPU server (services/inference/weights_load.py)
and the vLLM worker extension: it is imported inside vLLM's own virtualenv, so it imports
only the standard library at module level (torch, safetensors and numpy inside functions).

Format (encoding "sparse-v1"). A published version directory `version-V` holds
`published.json` (the manifest) and `config.json`, and either

* a full version: `model.safetensors`, every tensor in the publish dtype; manifest
  `"kind": "full"`, `"checksums"` (name -> checksum of each tensor's raw bytes), `"digest"`
  (`state_digest` of those). Versions written before deltas existed have no "kind" and no
  checksums: they are full, and only names and shapes can be checked; or
* a delta version: `delta.safetensors` holding, for each tensor whose raw bits changed,
  `NAME/idx` (flat indices of the changed elements, int32, int64 past 2**31-1 elements) and
  `NAME/val` (their NEW values, in the tensor's dtype: not differences, so applying is
  exact); manifest `"kind": "delta"`, `"encoding"`, `"base_version"` (the sibling
  `version-{base}` it applies to), `"base_digest"` (that version's digest), `"digest"` and
  `"checksums"` of EVERY tensor of the resulting version (so a reader verifies what it
  holds after applying), `"full_version"` (the root of its chain), `"changed_elements"`,
  `"total_elements"`.

Invariants. Changes are found by comparing raw bit patterns (each tensor viewed as an
integer type of its width), so NaN payloads and -0.0 round-trip exactly and applying a delta
to its base gives the new version bit for bit. A reader applies a delta only to weights whose
digest equals the delta's `base_digest`; anything else replays the chain (`load_state`):
the newest full version, then each delta, each link's digest equal to the next one's
base_digest. `apply` validates before it writes and undoes what it wrote when the
checksums do not match: on DeltaError the held weights are as they were.

Checksum: zlib.crc32 of a tensor's raw bytes (contiguous, CPU), 8 hex digits; tensors are
hashed in parallel threads (crc32 releases the GIL). It guards against corrupt or
mismatched files, not against tampering (the publish directory is trusted). Measured on
100 MB of bfloat16 (one AMD EPYC core, Python 3.12): crc32 13.8 ms (7.3 GB/s), adler32
23.4 ms, sha1 45.1 ms (2.2 GB/s), sha256 49.0 ms, blake2b 69.7 ms (1.4 GB/s), md5 112 ms.
The state digest is sha256 over the sorted (name, checksum) pairs."""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DELTA_FILE = "delta.safetensors"
FULL_FILE = "model.safetensors"
MANIFEST_FILE = "published.json"  # the file services/trainer/checkpoint.py writes (PUBLISHED_FILE)
ENCODING = "sparse-v1"
_PUBLISH_AGAIN = "publish a full version (trainer full_every) or restore it"
_THREADS = max(1, min(8, os.cpu_count() or 1))
_POOL_MIN_BYTES = 16 << 20  # below this many bytes in all, CRCs on the calling thread


class DeltaError(ValueError):
    """A delta that cannot be made, read, applied or verified; the message says what happened
    and what to do. The trainer writes a full version instead; a server replays the chain,
    and refuses the version when that fails too."""


def _int_dtype(t: torch.Tensor) -> torch.dtype:
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def _flat(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of `t`, flat, as an integer tensor of the same width."""
    return _flat(t).view(_int_dtype(t))


def _checksum(t: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    import torch

    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        t = t.detach().to(dtype)  # float32 params holding bf16-exact values: exact
    raw = _flat(t).view(torch.uint8).numpy()
    return f"{zlib.crc32(memoryview(raw)):08x}"


def checksums(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, str]:
    """Name -> checksum of each tensor's raw bytes (floating tensors cast to `dtype` first when
    given). Deterministic across processes and machines of the same byte order."""
    names = list(tensors)
    if len(names) < 2 or sum(t.numel() * t.element_size() for t in tensors.values()) < _POOL_MIN_BYTES:
        # Starting the pool's threads costs more than a small state's CRCs (a 0.45 MB model: 6 ms
        # against 0.2 ms), on both sides of every weight sync's critical path.
        return {n: _checksum(tensors[n], dtype) for n in names}
    with ThreadPoolExecutor(min(_THREADS, len(names))) as pool:
        return dict(zip(names, pool.map(lambda n: _checksum(tensors[n], dtype), names)))


def state_digest(sums: dict[str, str]) -> str:
    """One digest of a whole version: sha256 over its sorted (name, checksum) pairs."""
    h = hashlib.sha256()
    for name in sorted(sums):
        h.update(f"{name}\0{sums[name]}\n".encode())
    return h.hexdigest()


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a manifest names ("bfloat16")."""
    import torch

    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise DeltaError(f"unknown dtype {name!r} in a published manifest: republish the version")
    return dtype


def encode(prev: dict[str, torch.Tensor], new: dict[str, torch.Tensor]
           ) -> tuple[dict[str, torch.Tensor], int, int]:
    """The delta from `prev` to `new`: (tensors to save, changed elements, total elements).
    Only tensors whose raw bits changed appear. Same names, shapes and dtypes required."""
    import torch

    if set(prev) != set(new):
        gone, added = sorted(set(prev) - set(new)), sorted(set(new) - set(prev))
        raise DeltaError(f"cannot encode a delta: tensor names differ (only in base: {gone[:5]}, only in new: "
                         f"{added[:5]}); write a full version")
    delta: dict[str, torch.Tensor] = {}
    changed = total = 0
    for name in sorted(new):
        a, b = prev[name], new[name]
        if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            raise DeltaError(f"cannot encode a delta: {name} is {a.dtype} {tuple(a.shape)} in the base and "
                             f"{b.dtype} {tuple(b.shape)} in the new version; write a full version")
        total += b.numel()
        idx = torch.nonzero(_bits(a) != _bits(b)).reshape(-1)
        if not idx.numel():
            continue
        changed += idx.numel()
        delta[f"{name}/idx"] = idx.to(torch.int32) if b.numel() <= 2**31 - 1 else idx
        delta[f"{name}/val"] = _flat(b)[idx]
    return delta, changed, total


def _pairs(delta: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    names = {key.rsplit("/", 1)[0] for key in delta}
    stray = sorted(k for k in delta if "/" not in k or k.rsplit("/", 1)[1] not in ("idx", "val"))
    missing = sorted(f"{n}/{part}" for n in names for part in ("idx", "val") if f"{n}/{part}" not in delta)
    if stray or missing:
        raise DeltaError(f"malformed delta: unexpected keys {stray[:5]}, missing {missing[:5]}; {_PUBLISH_AGAIN}")
    return {n: (delta[f"{n}/idx"], delta[f"{n}/val"]) for n in sorted(names)}


def apply(held: dict[str, torch.Tensor], delta: dict[str, torch.Tensor], manifest: dict[str, Any], *,
          verify: bool = True) -> list[str]:
    """Apply `delta` to `held` in place (its tensors may be wider than the publish dtype: float32
    params holding bf16-exact values); returns the changed names. Everything is validated
    before anything is written; with `verify`, each changed tensor's checksum (in the
    manifest's dtype) must equal manifest["checksums"], else what was written is undone and
    DeltaError raised: on DeltaError `held` is unchanged."""
    import torch

    pairs = _pairs(delta)
    dtype = dtype_of(manifest.get("dtype", "bfloat16"))
    expected = manifest.get("checksums") if verify else None
    if verify and not isinstance(expected, dict):
        raise DeltaError(f"delta version {manifest.get('version')} has no checksums to verify: {_PUBLISH_AGAIN}")
    for name, (idx, val) in pairs.items():
        t = held.get(name)
        if t is None:
            raise DeltaError(f"the delta changes {name}, which these weights do not have: {_PUBLISH_AGAIN}")
        if idx.dtype not in (torch.int32, torch.int64) or idx.dim() != 1 or val.dim() != 1 \
                or idx.numel() != val.numel():
            raise DeltaError(f"malformed delta for {name}: idx {idx.dtype} {tuple(idx.shape)}, val {tuple(val.shape)}"
                             f"; {_PUBLISH_AGAIN}")
        if val.dtype != t.dtype and not (t.is_floating_point() and val.dtype == dtype):
            raise DeltaError(f"the delta's values for {name} are {val.dtype}, the weights {t.dtype}: {_PUBLISH_AGAIN}")
        if idx.numel():
            lo, hi = torch.aminmax(idx)
            if int(lo) < 0 or int(hi) >= t.numel():
                raise DeltaError(f"the delta indexes {name} out of range [{int(lo)}, {int(hi)}] (it has {t.numel()} "
                                 f"elements): the file is corrupt or for another model; {_PUBLISH_AGAIN}")
        if not t.is_contiguous():
            raise DeltaError(f"cannot apply a delta in place to the non-contiguous tensor {name}")
        if expected is not None and name not in expected:
            raise DeltaError(f"the delta changes {name}, for which its manifest has no checksum: {_PUBLISH_AGAIN}")
    undo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for name, (idx, val) in pairs.items():
            flat = held[name].view(-1)
            where = idx.to(flat.device, torch.long)  # the held tensor may live on a GPU
            undo.append((flat, where, flat[where].clone()))
            flat[where] = val.to(flat.device, flat.dtype)
        if expected is not None:
            got = checksums({n: held[n] for n in pairs}, dtype)
            bad = [n for n in pairs if got[n] != expected[n]]
            if bad:
                for flat, where, old in reversed(undo):
                    flat[where] = old
                raise DeltaError(f"version {manifest.get('version')}: after applying the delta {len(bad)} tensors do "
                                 f"not match their checksums ({bad[:3]}): the weights were not at its base or a file "
                                 f"is corrupt; undone. Load its chain in full, or {_PUBLISH_AGAIN}")
    return list(pairs)


def verify(tensors: dict[str, torch.Tensor], manifest: dict[str, Any], where: str = "") -> None:
    """Every tensor of a version against its manifest's checksums (names included); DeltaError
    on any difference. A manifest without checksums (an old full version) passes."""
    expected = manifest.get("checksums")
    if not isinstance(expected, dict):
        return
    if set(expected) != set(tensors):
        raise DeltaError(f"{where or 'the weights'}: tensor names differ from the manifest's (missing "
                         f"{sorted(set(expected) - set(tensors))[:5]}, extra {sorted(set(tensors) - set(expected))[:5]})"
                         f"; {_PUBLISH_AGAIN}")
    got = checksums(tensors, dtype_of(manifest.get("dtype", "bfloat16")))
    bad = sorted(n for n in expected if got[n] != expected[n])
    if bad:
        raise DeltaError(f"{where or 'the weights'}: {len(bad)} tensors do not match their checksums ({bad[:3]}): "
                         f"a file is corrupt or was rewritten; {_PUBLISH_AGAIN}")


def read_manifest(version_dir: str | os.PathLike) -> dict[str, Any]:
    """The version's published.json; DeltaError when it is missing or unreadable."""
    path = Path(version_dir) / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise DeltaError(f"{path} does not exist: {Path(version_dir)} is not a complete published version; "
                         f"{_PUBLISH_AGAIN}") from None
    except (OSError, ValueError) as exc:
        raise DeltaError(f"cannot read {path} ({exc}); {_PUBLISH_AGAIN}") from exc
    if not isinstance(manifest, dict):
        raise DeltaError(f"{path} is not a JSON object; {_PUBLISH_AGAIN}")
    return manifest


def is_delta(version_dir: str | os.PathLike) -> bool:
    """Whether the directory is a delta version (False for a model directory with no manifest)."""
    if not (Path(version_dir) / MANIFEST_FILE).is_file():
        return False
    return read_manifest(version_dir).get("kind") == "delta"


def chain(version_dir: str | os.PathLike) -> list[Path]:
    """[full_dir, delta_1, ..., version_dir]: the bases, found as sibling `version-{base}`
    directories, each link's digest checked against the next one's base_digest."""
    path = Path(version_dir)
    links, manifest, seen = [path], read_manifest(path), {path.resolve()}
    while manifest.get("kind") == "delta":
        base_version, base_digest = manifest.get("base_version"), manifest.get("base_digest")
        if base_version is None or not base_digest:
            raise DeltaError(f"{path.name} is a delta without base_version/base_digest in its manifest; {_PUBLISH_AGAIN}")
        base = path.parent / f"version-{base_version}"
        if not (base / MANIFEST_FILE).is_file():
            raise DeltaError(f"{path.name} is a delta on version-{base_version}, which is not in {path.parent}: "
                             f"{_PUBLISH_AGAIN}")
        base_manifest = read_manifest(base)
        if base_manifest.get("digest") != base_digest:
            raise DeltaError(f"{path.name} is a delta on version-{base_version}, but {base} holds other weights (digest "
                             f"{str(base_manifest.get('digest'))[:12]}, expected {str(base_digest)[:12]}): it was "
                             f"rewritten, e.g. by another run in the same directory; {_PUBLISH_AGAIN}")
        if base.resolve() in seen:
            raise DeltaError(f"the chain of {Path(version_dir).name} loops at {base.name}; {_PUBLISH_AGAIN}")
        seen.add(base.resolve())
        links.insert(0, base)
        path, manifest = base, base_manifest
    return links


def bases_on_disk(version_dir: str | os.PathLike) -> list[Path]:
    """`version_dir` and the versions it is built from that are on disk, newest first, as far
    as the chain goes (a broken one yields what is left of it, never an error): what pruning
    must keep with a kept version."""
    path = Path(version_dir)
    out, seen = [path], {path.resolve()}
    while True:
        try:
            manifest = read_manifest(path)
        except DeltaError:
            return out
        if manifest.get("kind") != "delta" or manifest.get("base_version") is None:
            return out
        base = path.parent / f"version-{manifest['base_version']}"
        if not base.is_dir() or base.resolve() in seen:
            return out
        out.append(base)
        seen.add(base.resolve())
        path = base


def load_file(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file; DeltaError when it is missing, truncated or corrupt."""
    from safetensors.torch import load_file as _load

    try:
        return _load(str(path))
    except Exception as exc:  # safetensors' own error type, OSError, ...
        raise DeltaError(f"cannot read {path} ({exc}): it is missing or corrupt; {_PUBLISH_AGAIN}") from exc


def load_state(version_dir: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The full tensors (publish dtype) of a version, replaying its chain, and its manifest.
    The root and the result are verified against their checksums (when they have them)."""
    links = chain(version_dir)
    root_manifest = read_manifest(links[0])
    state = load_file(links[0] / FULL_FILE)
    verify(state, root_manifest, str(links[0]))
    manifest = root_manifest
    for link in links[1:]:
        manifest = read_manifest(link)
        apply(state, load_file(link / DELTA_FILE), manifest, verify=False)
    if len(links) > 1:
        verify(state, manifest, f"{links[-1]} rebuilt from {' + '.join(p.name for p in links)}")
    return state, manifest
