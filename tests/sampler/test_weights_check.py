"""Weights holding NaN or infinity are refused at POST /weights_version (422, nothing loaded,
nothing published), probe or not; the scan reads safetensors without torch, in every float
format, and a path the sampler cannot read is not refused."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from services.sampler.fleet import weights_check
from services.sampler.fleet.weights_check import NonFinite, Unreadable, scan_checkpoint

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e5m2, torch.float8_e4m3fn]


def _poisoned(dtype: torch.dtype, n: int = 1000) -> dict[str, torch.Tensor]:
    """Tensors of `dtype`: finite ones (extremes included), and ones with NaN, +inf, -inf where
    the format has them (float8 e4m3fn has no infinity)."""
    info = torch.finfo(dtype)
    finite = torch.linspace(-1, 1, n, dtype=torch.float32).to(dtype)
    extremes = torch.tensor([info.max, -info.max, info.tiny, -info.tiny, 0.0, -0.0], dtype=torch.float64).to(dtype)
    tensors = {"finite": finite, "extremes": extremes, "ints": torch.arange(n, dtype=torch.int64)}
    specials = {"nan": float("nan")} if dtype == torch.float8_e4m3fn else {
        "nan": float("nan"), "pos_inf": float("inf"), "neg_inf": float("-inf")}
    for name, value in specials.items():
        bad = finite.clone()
        bad[[3, n - 1]] = torch.tensor(value).to(dtype)
        tensors[name] = bad
    return tensors


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_float_format_is_scanned_bit_exactly(tmp_path, dtype, monkeypatch):
    # Chunks of 64 bytes: values of every tensor straddle many chunk boundaries.
    monkeypatch.setattr(weights_check, "CHUNK_BYTES", 64)
    tensors = _poisoned(dtype)
    save_file(tensors, tmp_path / "model.safetensors")
    found = scan_checkpoint(tmp_path)
    expected = {name for name, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t.double()).all()}
    assert {f.tensor for f in found} == expected and expected
    assert all(f.count == 2 and f.total == 1000 and f.file == "model.safetensors" for f in found)


def test_sharded_checkpoints_are_scanned_by_their_index(tmp_path):
    save_file({"a": torch.zeros(10, dtype=torch.bfloat16)}, tmp_path / "model-00001-of-00002.safetensors")
    bad = torch.zeros(10, dtype=torch.bfloat16)
    bad[7] = float("nan")
    save_file({"b": bad}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert scan_checkpoint(tmp_path) == [NonFinite("model-00002-of-00002.safetensors", "b", 1, 10)]


async def test_what_cannot_be_read_here_is_not_refused(tmp_path, caplog):
    check = weights_check.WeightsCheck()
    for _ in range(2):
        assert await check.refuse_nonfinite(str(tmp_path / "only-the-servers-see-this")) is None
    assert [r.getMessage() for r in caplog.records if "could not check" in r.getMessage()] == [
        f"could not check {str(tmp_path / 'only-the-servers-see-this')!r} for NaN/inf weights ({tmp_path}/"
        "only-the-servers-see-this is not a file or directory here); the inference servers load it unchecked. "
        "Logged once"]
    with pytest.raises(Unreadable, match="not a file or directory"):
        scan_checkpoint(tmp_path / "only-the-servers-see-this")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(Unreadable, match="no \\*.safetensors"):
        scan_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(Unreadable, match="header length"):
        scan_checkpoint(tmp_path)


def test_nonfinite_weights_are_refused_and_finite_ones_published(make_sampler, standin, tiny_model, tmp_path):
    sampler = make_sampler()
    poisoned = tmp_path / "version-1"
    shutil.copytree(tiny_model, poisoned)
    weights = load_file(poisoned / "model.safetensors")
    weights["model.layers.0.mlp.down_proj.weight"][0, :3] = float("nan")
    weights["model.norm.weight"][1] = float("inf")
    save_file(weights, poisoned / "model.safetensors")

    with httpx.Client(base_url=sampler.url, timeout=60) as http:
        refused = http.post("/weights_version", json={"version": 1, "checkpoint_path": str(poisoned)})
        assert refused.status_code == 422, refused.text
        detail = refused.json()["detail"]
        assert "model.safetensors: model.layers.0.mlp.down_proj.weight (3 of " in detail, detail
        assert "model.norm.weight (1 of " in detail and "not published" in detail, detail
        assert http.get("/weights_version").json()["version"] == 0
        assert httpx.get(f"{standin.url}/_standin/stats").json()["reloads"] == [], "the servers were synced"

        published = http.post("/weights_version", json={"version": 1, "checkpoint_path": str(tiny_model)})
        assert published.status_code == 200, published.text
        assert published.json()["version"] == 1
        assert httpx.get(f"{standin.url}/_standin/stats").json()["reloads"] == [str(tiny_model)]
