"""What the trainer writes: published weights every step, full checkpoints every few.

Two kinds of directory, because they serve two readers:

* **Published weights** `publish_dir/version-V` (`publish_weights`): the weights of version V
  in the dtype inference wants (`publish_dtype`, bfloat16 for a bf16 server), as
  `model.safetensors`, with `config.json` and `published.json` (`{"version", "step",
  "dtype"}`). Nothing else: no optimizer state, no tokenizer. Written every step, read once
  by each inference server's reload, then pruned to the newest `keep_published`. A RAM disk
  (`/dev/shm`) is a good home: a lost one is re-published from the model. The manifest also
  records `"kind": "full"`, per-tensor `"checksums"` and a `"digest"`; a version may instead be
  a delta on the one before (services/trainer/versions.py, `publish_delta`: `delta.safetensors`,
  format and invariants in shared/weights_delta.py), and pruning then keeps every version a kept
  one is built from.
* **Full checkpoints** `run_dir/checkpoints/step-N` (`save_checkpoint`, or the collective
  `begin_checkpoint` / `commit_checkpoint` pair the trainer uses): the float32 master weights
  after optimizer step N, i.e. version N+1 (docs/staleness.md, Steps and versions), as an
  ordinary Hugging Face directory (config, safetensors, tokenizer files copied from the
  starting model), plus the optimizer state (`optimizer.pt`, or `optimizer/` written shard by
  shard under FSDP) and `trainer_state.json` (`{"step": N, "version": N+1, ...}`), whose
  presence marks a complete checkpoint. Written every `checkpoint_every` steps; a resume
  starts from the newest.

A LoRA run (services/trainer/lora.py) writes its adapter alone, in PEFT's format, in place of
the weights in both: in `publish_dtype` for a version, in float32 for a checkpoint.

"Newest" means most recently written, not the highest number, for both: a run directory
reused by a new run (`--no-resume`) holds the old run's higher numbers, and a resumed run
writes numbers again that its predecessor already wrote. Pruning keeps the newest by write
time (and whatever the caller protects: the version the sampler serves), and a resume starts
from the checkpoint written last.

Atomicity, for both: everything is written into a temporary sibling directory (`.tmp-...`),
files are fsynced, then the directory is renamed into place in one `os.rename`. A reader
sees either nothing or a complete directory; a crash leaves only a `.tmp-*` directory,
which the next write removes.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shared.weights_delta import bases_on_disk, checksums, state_digest

log = logging.getLogger("tandem.trainer.checkpoint")

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
PUBLISHED_FILE = "published.json"
WEIGHTS_FILE = "model.safetensors"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_VERSION_DIR = re.compile(r"^version-(\d+)$")
# Files that save_pretrained writes itself or that are weights of the starting model:
# never copied from the model directory into a checkpoint.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_SKIP_NAMES = {"config.json", "generation_config.json", "model.safetensors.index.json",
               "pytorch_model.bin.index.json", STATE_FILE, OPTIMIZER_FILE}


# -- disk space ------------------------------------------------------------------------------

# Left free beyond the estimate: file-system metadata, config and tokenizer files.
_SPACE_MARGIN = 2**20


class DiskFullError(OSError):
    """Not enough disk space for a checkpoint or a published version; the message names the
    directory, the space needed and the space free. Nothing half-written is left behind."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def tensor_bytes(state_dict: dict[str, Any] | None) -> int:
    return sum(t.numel() * t.element_size() for t in (state_dict or {}).values())


def dir_bytes(path: Path | str) -> int:
    """The bytes of the files under a written directory (a version, a checkpoint)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def checkpoint_bytes(state_dict: dict[str, Any] | None, *, optimizer: bool) -> int:
    """About what checkpoint needs on disk: the float32 weights, and with the optimizer state
    AdamW's two float32 moments per weight."""
    weights = sum(t.numel() * 4 for t in (state_dict or {}).values())
    return weights * (3 if optimizer else 1)


def _free_bytes(root: Path) -> int:
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def _no_space(root: Path, needed: int, what: str) -> DiskFullError:
    return DiskFullError(errno.ENOSPC, f"not enough disk space for {what} in {root}: it needs about "
                         f"{_gib(needed)}, {_gib(_free_bytes(root))} is free. Free some space there (or point the "
                         "directory elsewhere) and rerun the same command; what was committed before is intact")


def ensure_space(root: Path | str, needed: int, what: str) -> None:
    """Refuse (DiskFullError) before writing `what` into `root` when the disk cannot hold it."""
    root = Path(root)
    if _free_bytes(root) < needed + _SPACE_MARGIN:
        raise _no_space(root, needed, what)


@contextmanager
def disk_errors(root: Path | str, needed: int, what: str) -> Iterator[None]:
    """Turn a disk filling up during the write into a DiskFullError that says so: an ENOSPC
    OSError, or torch.save's opaque `basic_ios::clear: iostream error` on a disk found full."""
    root = Path(root)
    try:
        yield
    except DiskFullError:
        raise
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _no_space(root, needed, what) from exc
        raise
    except RuntimeError as exc:
        if _free_bytes(root) < max(needed, 1) + _SPACE_MARGIN:
            raise _no_space(root, needed, what) from exc
        raise


def checkpoint_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / "checkpoints"


def step_path(run_dir: Path | str, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step-{step}"


def _complete_dirs(root: Path, pattern: re.Pattern[str], marker: str) -> list[tuple[int, Path]]:
    """(number, path) of the directories in `root` named by `pattern` that hold `marker` (the
    file written last, so only complete ones count), oldest first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = pattern.match(entry.name)
        if match and entry.is_dir() and (entry / marker).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _written_at(path: Path, marker: str) -> float:
    """When the directory was completed: the `saved_at` its marker file records (the marker's
    mtime for one without)."""
    try:
        saved = json.loads((path / marker).read_text()).get("saved_at")
        if isinstance(saved, (int, float)):
            return float(saved)
    except (OSError, ValueError, AttributeError):
        pass
    try:
        return (path / marker).stat().st_mtime
    except OSError:
        return 0.0


def _newest_first(found: list[tuple[int, Path]], marker: str) -> list[tuple[int, Path]]:
    return sorted(found, key=lambda item: (_written_at(item[1], marker), item[0]), reverse=True)


def _prune(found: list[tuple[int, Path]], keep: int, what: str, marker: str,
           protect: tuple[Path | str | None, ...] = (),
           needs: Callable[[Path], list[Path]] = lambda path: [path]) -> list[Path]:
    """Delete all but the `keep` most recently written directories of `found`, and never one
    named in `protect`, nor one that a kept or protected directory `needs` (itself and, for a
    delta version, the versions it is built from)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1: the newest {what}")
    newest = _newest_first(found, marker)
    kept = [path for _, path in newest[:keep]] + [Path(p) for p in protect if p]
    spared = {link.resolve() for path in kept for link in needs(path)}
    doomed = [path for _, path in newest[keep:] if path.resolve() not in spared]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
        log.debug("deleted %s", path)
    return doomed


def list_checkpoints(run_dir: Path | str) -> list[tuple[int, Path]]:
    """Complete checkpoints as (step, path), oldest first."""
    return _complete_dirs(checkpoint_dir(run_dir), _STEP_DIR, STATE_FILE)


def latest_checkpoint(run_dir: Path | str) -> tuple[int, Path] | None:
    """The checkpoint written last (see the module docstring), as (step, path)."""
    found = _newest_first(list_checkpoints(run_dir), STATE_FILE)
    return found[0] if found else None


def read_state(path: Path | str) -> dict[str, Any]:
    return json.loads((Path(path) / STATE_FILE).read_text())


def copy_tokenizer_files(model_dir: Path | str, dest: Path | str) -> list[str]:
    """Copy every non-weight file of the starting model that `save_pretrained` did not
    write (tokenizer, vocab, chat template, custom code), so the checkpoint is self-contained."""
    model_dir, dest = Path(model_dir), Path(dest)
    copied = []
    if not model_dir.is_dir():
        return copied
    for entry in sorted(model_dir.iterdir()):
        if not entry.is_file() or entry.name in _SKIP_NAMES or entry.name.endswith(_WEIGHT_SUFFIXES):
            continue
        if (dest / entry.name).exists():
            continue
        shutil.copy2(entry, dest / entry.name)
        copied.append(entry.name)
    return copied


def fsync_dir(path: Path) -> None:
    """fsync a directory: what makes a rename in it survive a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for entry in path.iterdir():
        if entry.is_file():
            with open(entry, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(path)


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final` (replacing an existing one) and fsync the parent."""
    if final.exists():
        # The same step or version written again (a resume re-running it): rename cannot
        # replace a non-empty directory, so move the old one aside first.
        trash = final.parent / f".tmp-old-{final.name}-{os.getpid()}"
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(final.parent)


@contextmanager
def _staging(tmp: Path) -> Iterator[Path]:
    """Write into the staging directory `tmp`; on any failure remove it, so nothing but a
    complete, renamed directory is ever left behind."""
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _seal(tmp: Path, final: Path) -> Path:
    """fsync everything in `tmp`, then rename it to `final`."""
    _fsync_tree(tmp)
    _replace_dir(tmp, final)
    return final


def write_dir(final: Path | str, write: Any) -> Path:
    """Any directory written atomically (`tandem export`): `write(tmp)` fills a sibling staging
    directory, which is fsynced and renamed to `final` (replacing one that is there)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    # Named after this process: the parent is the user's directory, so nothing else in it is touched.
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with _staging(tmp):
        write(tmp)
        return _seal(tmp, final)


def begin_checkpoint(run_dir: Path | str, step: int) -> Path:
    """Rank 0: an empty staging directory for checkpoint `step` (stale ones removed). Its name
    does not depend on the process, so every rank can write its optimizer shard into it
    (the run directory must then be on storage every rank sees)."""
    return _new_staging_dir(checkpoint_dir(run_dir), f".tmp-step-{step}")


def _new_staging_dir(root: Path, name: str) -> Path:
    """An empty `root/name` (a `.tmp-` name), after removing what failed writes left behind."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / name
    tmp.mkdir()
    return tmp


def commit_checkpoint(run_dir: Path | str, step: int, tmp: Path, *, model: Any,
                      state_dict: dict[str, Any] | None = None, model_dir: Path | str | None = None,
                      state: dict[str, Any] | None = None, write_weights: Any = None) -> Path:
    """Rank 0: write the weights (`state_dict`, else the model's own) and the state file into
    the staging directory `tmp`, fsync, and rename it to `step-{step}`. On failure the staging
    directory is removed and nothing else changes. `write_weights(tmp)`, when given, writes the
    weights instead of `save_pretrained` (a LoRA run's adapter, services/trainer/lora.py)."""
    with _staging(tmp):
        if write_weights is not None:
            write_weights(tmp)
        else:
            # A copy: save_pretrained deletes the tied duplicate from the dict it is given.
            model.save_pretrained(tmp, state_dict=dict(state_dict) if state_dict is not None else None,
                                  safe_serialization=True)
        if model_dir is not None:
            copy_tokenizer_files(model_dir, tmp)
        full_state = {"step": step, "version": step + 1, "saved_at": time.time(), **(state or {})}
        # Written last: its presence is what marks the checkpoint complete.
        (tmp / STATE_FILE).write_text(json.dumps(full_state, indent=2, default=str))
        return _seal(tmp, step_path(run_dir, step))


def save_checkpoint(
    run_dir: Path | str,
    step: int,
    model: Any,
    *,
    model_dir: Path | str | None = None,
    optimizer: Any = None,
    state: dict[str, Any] | None = None,
    keep: int | None = None,
) -> Path:
    """One process: write `step-{step}` atomically and return its path; prune to the newest `keep`."""
    import torch  # here, so that listing checkpoints does not import torch

    what, root = f"checkpoint step-{step}", checkpoint_dir(run_dir)
    needed = checkpoint_bytes(model.state_dict(), optimizer=optimizer is not None)
    ensure_space(root, needed, what)
    tmp = begin_checkpoint(run_dir, step)
    with disk_errors(root, needed, what):
        with _staging(tmp):
            if optimizer is not None:
                torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        final = commit_checkpoint(run_dir, step, tmp, model=model, model_dir=model_dir, state=state)
    if keep is not None:
        prune_checkpoints(run_dir, keep)
    return final


def prune_checkpoints(run_dir: Path | str, keep: int) -> list[Path]:
    """Delete all but the `keep` checkpoints written last; returns the deleted paths."""
    return _prune(list_checkpoints(run_dir), keep, "checkpoint is what a resume starts from", STATE_FILE)


# -- published weights ---------------------------------------------------------------------


def version_path(publish_root: Path | str, version: int) -> Path:
    return Path(publish_root) / f"version-{version}"


def list_published(publish_root: Path | str) -> list[tuple[int, Path]]:
    """Complete published weight directories as (version, path), oldest first."""
    return _complete_dirs(Path(publish_root), _VERSION_DIR, PUBLISHED_FILE)


def untie(state_dict: dict[str, Any], config: Any) -> dict[str, Any]:
    """The state dict without the second name of a shared tensor (tied embeddings): safetensors
    refuses shared storage, and loaders tie `lm_head` back themselves."""
    out: dict[str, Any] = {}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name, tensor in state_dict.items():
        where = (tensor.data_ptr(), tuple(tensor.shape))
        if tensor.numel() and where in seen:
            continue
        seen.add(where)
        out[name] = tensor
    if getattr(config, "tie_word_embeddings", False) and "model.embed_tokens.weight" in out:
        out.pop("lm_head.weight", None)
    return out


def non_finite_tensors(state_dict: dict[str, Any]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity: their smallest or
    largest value is then not finite (min and max propagate NaN). One fused pass, ~20x faster
    on the CPU than `isfinite(t).all()`, which materialises a boolean tensor first."""
    import torch

    bad = []
    for name, t in state_dict.items():
        if t.is_floating_point() and t.numel():
            lo, hi = torch.aminmax(t)
            if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):
                bad.append(name)
    return bad


def publish_weights(publish_root: Path | str, version: int, state_dict: dict[str, Any], config: Any, *,
                    dtype: Any, step: int) -> Path:
    """Write version `version`'s weights, cast to `dtype`, as `publish_root/version-{version}`
    (atomically; see the module docstring) and return its path. Refuses (ValueError) weights
    holding NaN or infinity: those must never reach inference."""
    from safetensors.torch import save_file

    tensors = cast_tensors(untie(state_dict, config), dtype)
    sums = checksums(tensors)

    def write(tmp: Path) -> Path:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        write_config(tmp, config, dtype)
        return tmp / WEIGHTS_FILE

    return write_version(publish_root, version, tensors, dtype=dtype, step=step, write=write,
                         marker={"kind": "full", "checksums": sums, "digest": state_digest(sums)})


def write_config(tmp: Path, config: Any, dtype: Any) -> None:
    """A published version's config.json: the model's config with the publish dtype."""
    config_dict = config.to_dict()
    config_dict["torch_dtype"] = config_dict["dtype"] = str(dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(config_dict, indent=2, default=str))


def cast_tensors(state_dict: dict[str, Any], dtype: Any) -> dict[str, Any]:
    """Detached, contiguous copies of the floating-point tensors in `dtype` (the others as they are)."""
    return {name: t.detach().to(dtype).contiguous() if t.is_floating_point() else t.detach().contiguous()
            for name, t in state_dict.items()}


def write_version(publish_root: Path | str, version: int, tensors: dict[str, Any], *, dtype: Any, step: int,
                  write: Any, marker: dict[str, Any] | None = None, needed: int | None = None) -> Path:
    """`publish_root/version-{version}` atomically: `write(tmp)` writes the files (`tensors`, already in
    `dtype`) into the staging directory and returns the weights file, then `published.json` (with
    `marker`'s extra keys) marks it complete. Refuses (ValueError) tensors holding NaN or infinity:
    those must never reach inference. Full weights (`publish_weights`), deltas (versions.py) and
    LoRA adapters (services/trainer/lora.py) are all written through here. `needed`: the bytes the
    files take, when not those of `tensors` (a delta)."""
    # Checked after the cast: a float16 cast can overflow to infinity on its own.
    bad = non_finite_tensors(tensors)
    if bad:
        raise ValueError(f"refusing to publish version {version}: non-finite values in {bad[:5]}"
                         f"{' and more' if len(bad) > 5 else ''}")
    root = Path(publish_root)
    what = f"published version-{version}"
    needed = tensor_bytes(tensors) if needed is None else needed
    ensure_space(root, needed, what)
    # Also removes the staging directories that earlier, crashed writes left behind.
    tmp = _new_staging_dir(root, f".tmp-version-{version}-{os.getpid()}")
    with disk_errors(root, needed, what), _staging(tmp):
        weights = write(tmp)
        # Written last: its presence is what marks the version complete.
        (tmp / PUBLISHED_FILE).write_text(json.dumps(
            {"version": version, "step": step, "dtype": str(dtype).removeprefix("torch."),
             "bytes": weights.stat().st_size, "saved_at": time.time(), **(marker or {})}))
        return _seal(tmp, version_path(root, version))


def prune_published(publish_root: Path | str, keep: int, protect: tuple[Path | str | None, ...] = ()) -> list[Path]:
    """Delete all but the `keep` versions written last, sparing those in `protect` (the one the
    sampler serves: a server that restarts loads it) and every version a spared delta is built
    from (its chain down to a full version); returns the deleted paths."""
    return _prune(list_published(publish_root), keep, "published version is what inference serves",
                  PUBLISHED_FILE, protect, needs=bases_on_disk)
