"""HF-format checkpoints, written atomically, one directory per step.

`run_dir/checkpoints/step-N` holds the weights after optimizer step N, i.e. weights
version N+1 (docs/staleness.md, Steps and versions). It is an ordinary Hugging Face model directory
(config, safetensors, tokenizer files copied from the starting model), so vLLM's
`reload_weights` and the CPU inference server read it directly, plus:

* `trainer_state.json`: `{"step": N, "version": N+1, ...}`; its presence marks a
  complete checkpoint.
* `optimizer.pt` (optional): AdamW state, for an exact resume.

Atomicity: everything is written into a temporary sibling directory (`.tmp-...`), files
are fsynced, then the directory is renamed to `step-N` in one `os.rename`. A reader
therefore sees either no `step-N` or a complete one; a crash leaves only a `.tmp-*`
directory, which the next save removes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("tandem.trainer.checkpoint")

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")
# Files that save_pretrained writes itself or that are weights of the starting model:
# never copied from the model directory into a checkpoint.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_SKIP_NAMES = {"config.json", "generation_config.json", "model.safetensors.index.json",
               "pytorch_model.bin.index.json", STATE_FILE, OPTIMIZER_FILE}


def checkpoint_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / "checkpoints"


def step_path(run_dir: Path | str, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step-{step}"


def list_checkpoints(run_dir: Path | str) -> list[tuple[int, Path]]:
    """Complete checkpoints as (step, path), oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir() and (entry / STATE_FILE).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(run_dir: Path | str) -> tuple[int, Path] | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


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


def _fsync_tree(path: Path) -> None:
    for entry in path.iterdir():
        if entry.is_file():
            with open(entry, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    """Write `step-{step}` atomically and return its path; prune to the newest `keep`."""
    import torch  # here, so that listing checkpoints does not import torch

    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-step-{step}-{os.getpid()}"
    tmp.mkdir()
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if model_dir is not None:
            copy_tokenizer_files(model_dir, tmp)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        full_state = {"step": step, "version": step + 1, "saved_at": time.time(), **(state or {})}
        # Written last: its presence is what marks the checkpoint complete.
        (tmp / STATE_FILE).write_text(json.dumps(full_state, indent=2, default=str))
        _fsync_tree(tmp)
        final = step_path(run_dir, step)
        if final.exists():
            # A re-run of the same step (resume after a crash between save and publish):
            # move the old one aside first, since rename cannot replace a non-empty directory.
            trash = root / f".tmp-old-step-{step}-{os.getpid()}"
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep is not None:
        prune_checkpoints(run_dir, keep)
    return final


def prune_checkpoints(run_dir: Path | str, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints; returns the deleted paths."""
    if keep < 1:
        raise ValueError("keep must be >= 1: the newest checkpoint is what a resume starts from")
    found = list_checkpoints(run_dir)
    doomed = [path for _, path in found[:-keep]]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
        log.debug("deleted old checkpoint %s", path)
    return doomed
