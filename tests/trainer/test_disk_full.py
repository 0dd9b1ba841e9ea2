"""A full disk while the trainer writes: the error names the directory and the space needed,
no staging directory is left, and what was committed before is intact.

A real full disk: a small tmpfs mounted for the test (root only; skipped otherwise)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from services.trainer import checkpoint as ckpt


@pytest.fixture
def small_disk(tmp_path: Path):
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(disk: Path, leave: int) -> None:
    """Write a ballast file so that about `leave` bytes stay free."""
    import shutil

    free = shutil.disk_usage(disk).free
    with open(disk / "ballast", "wb") as fh:
        fh.write(b"\0" * max(free - leave, 0))


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)


def test_a_checkpoint_that_cannot_fit_is_refused_before_anything_is_written(small_disk: Path, model) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    first = ckpt.save_checkpoint(small_disk, 0, model, optimizer=opt)
    before = sorted(p.name for p in first.iterdir())
    _fill(small_disk, leave=1_500_000)  # the weights would fit, weights + AdamW moments do not
    with pytest.raises(ckpt.DiskFullError) as caught:
        ckpt.save_checkpoint(small_disk, 1, model, optimizer=opt)
    message = str(caught.value)
    assert str(small_disk / "checkpoints") in message and "needs about" in message and "free" in message
    assert [s for s, _ in ckpt.list_checkpoints(small_disk)] == [0]
    assert sorted(p.name for p in first.iterdir()) == before
    assert not list((small_disk / "checkpoints").glob(".tmp-*"))


def test_a_version_that_cannot_fit_is_refused(small_disk: Path, model) -> None:
    root = small_disk / "published"
    ckpt.publish_weights(root, 1, model.state_dict(), model.config, dtype=torch.float32, step=0)
    _fill(small_disk, leave=300_000)
    with pytest.raises(ckpt.DiskFullError, match="published version-2"):
        ckpt.publish_weights(root, 2, model.state_dict(), model.config, dtype=torch.float32, step=1)
    assert [v for v, _ in ckpt.list_published(root)] == [1]
    assert not list(root.glob(".tmp-*"))


def test_a_disk_that_fills_during_the_write_is_named_as_such(small_disk: Path) -> None:
    """What the estimate cannot foresee (another writer, a larger file): torch.save's own error on
    a full disk is opaque (`basic_ios::clear` or `PytorchStreamWriter failed`); it becomes a
    DiskFullError naming the place."""
    _fill(small_disk, leave=200_000)
    with pytest.raises(ckpt.DiskFullError, match="not enough disk space for the test write"):
        with ckpt.disk_errors(small_disk, 4_000_000, "the test write"):
            torch.save({"w": torch.zeros(1_000_000)}, small_disk / "state.pt")
