"""shared/weights_delta: sparse deltas between published versions, checksums, chains."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shared import weights_delta as wd


def _state(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(64, 16, generator=gen).to(dtype),
            "layers.0.mlp.weight": torch.randn(32, 16, generator=gen).to(dtype),
            "norm.weight": torch.ones(16, dtype=dtype),
            "step": torch.tensor([3], dtype=torch.int64)}


def _step(state: dict[str, torch.Tensor], gen: torch.Generator, frac: float = 0.02) -> dict[str, torch.Tensor]:
    """A small update: a fraction of the floating values nudged, as an RL step does."""
    out = {}
    for name, t in state.items():
        if not t.is_floating_point():
            out[name] = t.clone()
            continue
        wide = t.float()
        mask = torch.rand(t.shape, generator=gen) < frac
        out[name] = torch.where(mask, wide + torch.randn(t.shape, generator=gen) * 1e-2, wide).to(t.dtype)
    return out


def _manifest(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16, **extra) -> dict:
    sums = wd.checksums(tensors)
    return {"dtype": str(dtype).removeprefix("torch."), "checksums": sums, "digest": wd.state_digest(sums),
            **extra}


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return wd.checksums(a) == wd.checksums(b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_is_bit_identical(dtype: torch.dtype) -> None:
    prev = _state(0, dtype)
    new = _step(prev, torch.Generator().manual_seed(1))
    # Values whose bits differ though they compare equal (or unequal to themselves) must travel.
    new["norm.weight"][0] = -0.0
    new["norm.weight"][1] = float("nan")
    delta, changed, total = wd.encode(prev, new)
    assert total == sum(t.numel() for t in new.values())
    assert 0 < changed < total // 10
    assert "step/idx" not in delta  # unchanged tensors are left out
    assert delta["embed.weight/idx"].dtype == torch.int32 and delta["embed.weight/val"].dtype == dtype
    held = {k: v.clone() for k, v in prev.items()}
    changed_names = wd.apply(held, delta, _manifest(new, dtype))
    assert set(changed_names) == {"embed.weight", "layers.0.mlp.weight", "norm.weight"}
    assert _bits_equal(held, new)
    assert torch.signbit(held["norm.weight"][0]) and torch.isnan(held["norm.weight"][1])


def test_applies_to_wider_float32_weights() -> None:
    """A server's float32 parameters holding bf16-exact values: verified in the publish dtype."""
    prev = _state(0)
    new = _step(prev, torch.Generator().manual_seed(2))
    held = {k: v.float() if v.is_floating_point() else v.clone() for k, v in prev.items()}
    delta, _, _ = wd.encode(prev, new)
    wd.apply(held, delta, _manifest(new))
    assert held["embed.weight"].dtype == torch.float32
    assert _bits_equal({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in held.items()}, new)


def test_fifty_deltas_reproduce_the_source() -> None:
    gen = torch.Generator().manual_seed(3)
    source = _state(0)
    held = {k: v.clone() for k, v in source.items()}
    for _ in range(50):
        new = _step(source, gen, frac=0.01)
        delta, _, _ = wd.encode(source, new)
        wd.apply(held, delta, _manifest(new))
        source = new
    assert wd.state_digest(wd.checksums(held)) == wd.state_digest(wd.checksums(source))


def test_checksums_are_deterministic_across_processes() -> None:
    code = ("import torch; from shared import weights_delta as wd; "
            "print(wd.checksums({'x': torch.arange(1000, dtype=torch.float32).to(torch.bfloat16)}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    assert out == str(wd.checksums({"x": torch.arange(1000, dtype=torch.float32).to(torch.bfloat16)}))


def test_checksum_mismatch_is_refused_and_undone() -> None:
    prev = _state(0)
    new = _step(prev, torch.Generator().manual_seed(4))
    delta, _, _ = wd.encode(prev, new)
    other = _step(prev, torch.Generator().manual_seed(5))  # the delta's base is not what is held
    held = {k: v.clone() for k, v in other.items()}
    with pytest.raises(wd.DeltaError, match="do not match their checksums"):
        wd.apply(held, delta, _manifest(new))
    assert _bits_equal(held, other)  # nothing left half-applied


def test_bad_deltas_are_refused_before_writing() -> None:
    prev = _state(0)
    new = _step(prev, torch.Generator().manual_seed(6))
    delta, _, _ = wd.encode(prev, new)
    manifest = _manifest(new)
    cases = {
        "out of range": {**delta, "norm.weight/idx": torch.tensor([0, 99], dtype=torch.int32),
                         "norm.weight/val": torch.zeros(2, dtype=torch.bfloat16)},
        "do not have": {**delta, "ghost/idx": torch.tensor([0], dtype=torch.int32),
                        "ghost/val": torch.zeros(1, dtype=torch.bfloat16)},
        "missing": {k: v for k, v in delta.items() if k != "embed.weight/val"},
    }
    for fragment, bad in cases.items():
        held = {k: v.clone() for k, v in prev.items()}
        with pytest.raises(wd.DeltaError, match=fragment):
            wd.apply(held, bad, manifest)
        assert _bits_equal(held, prev)


def test_encode_refuses_other_names_shapes_and_dtypes() -> None:
    prev = _state(0)
    with pytest.raises(wd.DeltaError, match="names differ"):
        wd.encode(prev, {**prev, "extra": torch.zeros(1)})
    with pytest.raises(wd.DeltaError, match="write a full version"):
        wd.encode(prev, {**prev, "norm.weight": torch.ones(17, dtype=torch.bfloat16)})
    with pytest.raises(wd.DeltaError, match="float32"):
        wd.encode(prev, {**prev, "norm.weight": torch.ones(16)})


def _publish(root: Path, version: int, tensors: dict, base: tuple[int, dict, dict] | None) -> dict:
    """A version directory as the trainer lays it out (without the trainer)."""
    d = root / f"version-{version}"
    d.mkdir(parents=True)
    manifest = {"version": version, **_manifest(tensors)}
    if base is None:
        save_file(tensors, str(d / wd.FULL_FILE))
        manifest["kind"] = "full"
    else:
        base_version, base_tensors, base_manifest = base
        delta, changed, total = wd.encode(base_tensors, tensors)
        save_file(delta, str(d / wd.DELTA_FILE))
        manifest.update(kind="delta", encoding=wd.ENCODING, base_version=base_version,
                        base_digest=base_manifest["digest"], changed_elements=changed, total_elements=total)
    (d / wd.MANIFEST_FILE).write_text(json.dumps(manifest))
    return manifest


@pytest.fixture
def published(tmp_path: Path) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    """version-1 full, versions 2..4 deltas on the one before."""
    gen = torch.Generator().manual_seed(7)
    states = [_state(0)]
    manifests = [_publish(tmp_path, 1, states[0], None)]
    for v in range(2, 5):
        states.append(_step(states[-1], gen))
        manifests.append(_publish(tmp_path, v, states[-1], (v - 1, states[-2], manifests[-1])))
    return tmp_path, states


def test_chain_and_load_state(published) -> None:
    root, states = published
    assert wd.chain(root / "version-4") == [root / f"version-{v}" for v in (1, 2, 3, 4)]
    assert wd.is_delta(root / "version-4") and not wd.is_delta(root / "version-1")
    assert not wd.is_delta(root)  # no manifest: a model directory
    tensors, manifest = wd.load_state(root / "version-4")
    assert manifest["version"] == 4 and _bits_equal(tensors, states[-1])


def test_missing_base_is_refused_with_a_clear_message(published) -> None:
    root, _ = published
    (root / "version-2" / wd.MANIFEST_FILE).unlink()
    with pytest.raises(wd.DeltaError, match=r"version-3 is a delta on version-2, which is not in .*: publish a full"):
        wd.load_state(root / "version-4")


def test_rewritten_base_is_refused(published) -> None:
    root, _ = published
    m = json.loads((root / "version-3" / wd.MANIFEST_FILE).read_text())
    (root / "version-3" / wd.MANIFEST_FILE).write_text(json.dumps({**m, "digest": "0" * 64}))
    with pytest.raises(wd.DeltaError, match="holds other weights"):
        wd.chain(root / "version-4")


def test_corrupted_delta_file_is_refused(published) -> None:
    root, _ = published
    path = root / "version-3" / wd.DELTA_FILE
    data = bytearray(path.read_bytes())
    for i in range(len(data) - 40, len(data) - 8):  # the data section's tail: values
        data[i] ^= 0x55
    path.write_bytes(bytes(data))
    with pytest.raises(wd.DeltaError, match="checksums"):
        wd.load_state(root / "version-4")
    data[:8] = b"\xff" * 8  # the header length: unreadable
    path.write_bytes(bytes(data))
    with pytest.raises(wd.DeltaError, match="cannot read"):
        wd.load_state(root / "version-4")


def test_corrupted_full_version_is_refused(published) -> None:
    root, _ = published
    path = root / "version-1" / wd.FULL_FILE
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(wd.DeltaError, match="version-1: 1 tensors do not match"):
        wd.load_state(root / "version-2")


def test_imports_only_the_standard_library() -> None:
    code = "import sys, shared.weights_delta; print('torch' in sys.modules, 'safetensors' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    assert out == "False False"


def test_checksums_are_the_same_on_the_calling_thread_and_in_the_pool(monkeypatch) -> None:
    """Small states are summed on the calling thread (a pool's threads cost more than their
    CRCs), large ones in a pool: the same checksums either way, cast included."""
    state = _state(3, torch.float32)
    serial = {name: wd._checksum(t, torch.bfloat16) for name, t in state.items()}
    assert wd.checksums(state, torch.bfloat16) == serial  # a small state: on this thread
    started = []
    real = wd.ThreadPoolExecutor

    def pool(*args, **kwargs):
        started.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(wd, "ThreadPoolExecutor", pool)
    assert wd.checksums(state, torch.bfloat16) == serial and not started
    monkeypatch.setattr(wd, "_POOL_MIN_BYTES", 0)  # as if it were large
    assert wd.checksums(state, torch.bfloat16) == serial and started
    assert len(set(serial.values())) == len(serial)  # the sums tell the tensors apart
