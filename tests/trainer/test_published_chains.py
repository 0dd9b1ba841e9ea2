"""Delta versions written by the trainer's checkpoint functions: manifests, chains, pruning."""

from __future__ import annotations

import json

import pytest
import torch

from services.trainer import checkpoint as ckpt
from services.trainer.versions import publish_delta, snapshot
from shared import weights_delta as wd


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)


def _train_step(state: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """float32 weights nudged at an RL learning rate: a few bf16 values change."""
    return {n: t + torch.randn(t.shape, generator=gen) * 1e-3 * t.abs() if t.is_floating_point() else t
            for n, t in state.items()}


def _publish_run(root, model, versions: range, full_every: int = 100):
    """Publish versions as the trainer does: full at the start and every `full_every`, deltas
    between; returns the float32 states and the publish-dtype snapshots by version."""
    gen = torch.Generator().manual_seed(0)
    state = dict(model.state_dict())
    snaps: dict[int, dict[str, torch.Tensor]] = {}
    base = None
    for version in versions:
        state = _train_step(state, gen)
        snap = snapshot(state, model.config, torch.bfloat16)
        if base is None or (version - versions.start) % full_every == 0:
            path = ckpt.publish_weights(root, version, snap, model.config, dtype=torch.bfloat16, step=version - 1)
            manifest = wd.read_manifest(path)
        else:
            path, manifest = publish_delta(root, version, snap, base[0], base[1], model.config,
                                                dtype=torch.bfloat16, step=version - 1)
        snaps[version], base = snap, (snap, manifest)
    return snaps


def test_full_then_deltas_have_their_manifests(tmp_path, model) -> None:
    snaps = _publish_run(tmp_path, model, range(1, 4))
    full = json.loads((tmp_path / "version-1" / ckpt.PUBLISHED_FILE).read_text())
    assert full["kind"] == "full" and full["digest"] == wd.state_digest(full["checksums"])
    assert full["checksums"] == wd.checksums(snaps[1])
    assert "lm_head.weight" not in full["checksums"]  # untied, as the weights file
    delta = json.loads((tmp_path / "version-3" / ckpt.PUBLISHED_FILE).read_text())
    assert sorted(p.name for p in (tmp_path / "version-3").iterdir()) == \
        ["config.json", wd.DELTA_FILE, ckpt.PUBLISHED_FILE]
    assert (delta["kind"], delta["encoding"], delta["base_version"], delta["full_version"], delta["step"]) == \
        ("delta", wd.ENCODING, 2, 1, 2)
    v2 = json.loads((tmp_path / "version-2" / ckpt.PUBLISHED_FILE).read_text())
    assert delta["base_digest"] == v2["digest"] and delta["checksums"] == wd.checksums(snaps[3])
    assert 0 < delta["changed_elements"] < delta["total_elements"] // 2
    assert delta["bytes"] < (tmp_path / "version-1" / ckpt.WEIGHTS_FILE).stat().st_size // 2
    assert json.loads((tmp_path / "version-3" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_load_state_of_the_newest_equals_the_source(tmp_path, model) -> None:
    snaps = _publish_run(tmp_path, model, range(1, 8), full_every=4)  # full 1 and 5, deltas between
    tensors, manifest = wd.load_state(tmp_path / "version-7")
    assert manifest["version"] == 7 and manifest["full_version"] == 5
    assert wd.chain(tmp_path / "version-7") == [tmp_path / f"version-{v}" for v in (5, 6, 7)]
    assert wd.checksums(tensors) == wd.checksums(snaps[7])
    for name, t in tensors.items():
        assert torch.equal(t.view(torch.int16), snaps[7][name].view(torch.int16)), name


def test_pruning_keeps_the_chains_of_kept_versions(tmp_path, model) -> None:
    _publish_run(tmp_path, model, range(1, 7), full_every=100)  # 1 full, 2..6 deltas
    deleted = ckpt.prune_published(tmp_path, 2)
    # 5 and 6 are kept, so is everything they are built from: the chain back to version-1.
    assert deleted == [] and [v for v, _ in ckpt.list_published(tmp_path)] == [1, 2, 3, 4, 5, 6]

    snaps = _publish_run(tmp_path / "b", model, range(1, 8), full_every=3)  # full 1, 4, 7
    deleted = ckpt.prune_published(tmp_path / "b", 2, protect=(tmp_path / "b" / "version-3",))
    # Kept 6 and 7 (7 full, 6 on 5 on 4), protected 3 (on 2 on 1): nothing of a kept chain goes.
    assert [v for v, _ in ckpt.list_published(tmp_path / "b")] == [1, 2, 3, 4, 5, 6, 7]
    assert deleted == []
    deleted = ckpt.prune_published(tmp_path / "b", 2)
    assert sorted(p.name for p in deleted) == ["version-1", "version-2", "version-3"]
    assert [v for v, _ in ckpt.list_published(tmp_path / "b")] == [4, 5, 6, 7]
    assert wd.checksums(wd.load_state(tmp_path / "b" / "version-6")[0]) == wd.checksums(snaps[6])
    deleted = ckpt.prune_published(tmp_path / "b", 1)
    assert [v for v, _ in ckpt.list_published(tmp_path / "b")] == [7]


def test_stale_staging_dirs_are_swept_by_the_next_write(tmp_path, model) -> None:
    (tmp_path / ".tmp-version-9-12345").mkdir(parents=True)
    _publish_run(tmp_path, model, range(1, 3))
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_delta_that_cannot_be_made_is_refused(tmp_path, model) -> None:
    snap = snapshot(model.state_dict(), model.config, torch.bfloat16)
    path = ckpt.publish_weights(tmp_path, 1, snap, model.config, dtype=torch.bfloat16, step=0)
    manifest = wd.read_manifest(path)
    moved = {n: t.clone() for n, t in snap.items()}
    moved["model.norm.weight"][0] += 1
    with pytest.raises(wd.DeltaError, match="delta on itself"):
        publish_delta(tmp_path, 1, moved, snap, manifest, model.config, dtype=torch.bfloat16, step=1)
    with pytest.raises(wd.DeltaError, match="not version 1's weights"):
        publish_delta(tmp_path, 2, moved, moved, manifest, model.config, dtype=torch.bfloat16, step=1)
    old = {k: v for k, v in manifest.items() if k not in ("kind", "checksums", "digest")}
    with pytest.raises(wd.DeltaError, match="no digest"):
        publish_delta(tmp_path, 2, moved, snap, old, model.config, dtype=torch.bfloat16, step=1)
    bad = {**moved, "model.norm.weight": moved["model.norm.weight"].clone()}
    bad["model.norm.weight"][1] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        publish_delta(tmp_path, 2, bad, snap, manifest, model.config, dtype=torch.bfloat16, step=1)
    ckpt.prune_published(tmp_path, 1)
    path.rename(tmp_path / "gone")
    with pytest.raises(wd.DeltaError, match="is gone or holds other weights"):
        publish_delta(tmp_path, 2, moved, snap, manifest, model.config, dtype=torch.bfloat16, step=1)
    assert ckpt.list_published(tmp_path) == []
