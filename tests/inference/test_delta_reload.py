"""Delta versions on Tandem's CPU server, over HTTP as the sampler reloads: applied in place
when the server holds the base, the chain replayed when it does not, verified bit for bit, and
a corrupt version refused with the previous weights still served."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.inference.testing import ServerHandle, start_server
from services.inference.vllm_ext import RELOAD_METHOD
from services.trainer import checkpoint as ckpt
from services.trainer.versions import publish_delta, snapshot
from shared import weights_delta as wd

TOKEN = "delta-reload-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def guarded_server(tiny_model: Path) -> Iterator[ServerHandle]:
    handle = start_server(tiny_model, served_model_name="tiny", api_token=TOKEN)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def published(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """What a trainer with full_every 100 writes: version-1 full, versions 2..6 deltas on the one
    before; and its bfloat16 snapshot of each version."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    root = tmp_path_factory.mktemp("published")
    gen = torch.Generator().manual_seed(0)
    state = {n: t + torch.randn(t.shape, generator=gen) * 0.05 for n, t in model.state_dict().items()}
    snaps, base = {}, None
    for version in range(1, 7):
        if version > 1:  # an RL step: small changes, some of which survive the bf16 rounding
            state = {n: t + torch.randn(t.shape, generator=gen) * 2e-3 * t.abs() for n, t in state.items()}
        snap = snapshot(state, model.config, torch.bfloat16)
        _, manifest = _publish(root, version, snap, base, model.config)
        snaps[version], base = snap, (snap, manifest)
    return root, snaps


def _publish(root: Path, version: int, snap: dict[str, torch.Tensor], base: tuple | None, config
             ) -> tuple[Path, dict]:
    """Version `version` as the trainer writes it: whole without a base, else a delta on `base`
    ((its snapshot, its manifest))."""
    if base is None:
        path = ckpt.publish_weights(root, version, snap, config, dtype=torch.bfloat16, step=0)
        return path, wd.read_manifest(path)
    return publish_delta(root, version, snap, base[0], base[1], config, dtype=torch.bfloat16, step=version - 1)


def _reload(server: ServerHandle, path: Path, method: str = RELOAD_METHOD) -> httpx.Response:
    return httpx.post(server.url + "/collective_rpc", headers=AUTH, timeout=60,
                      json={"method": method, "kwargs": {"weights_path": str(path)}})


def _applied(server: ServerHandle, path: Path) -> str:
    r = _reload(server, path)
    assert r.status_code == 200, r.text
    result = r.json()["results"][0]
    assert result["delta"] == (result["applied"] == "delta") and result["weights_path"] == str(path)
    return result["applied"]


def _served_digest(server: ServerHandle) -> str:
    """The digest of what the server computes with, bit for bit, in the publish dtype (its
    float32 parameters hold bfloat16 values exactly), tied lm_head left out as published."""
    params = {n: p for n, p in server.engine.model.named_parameters() if n != "lm_head.weight"}
    return wd.state_digest(wd.checksums(params, torch.bfloat16))


def _digest(snap: dict[str, torch.Tensor]) -> str:
    return wd.state_digest(wd.checksums(snap))


def _greedy(server: ServerHandle) -> list[int]:
    body = {"prompt": "The weights are", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return [*choice["token_ids"], *choice["logprobs"]["token_logprobs"]]


def test_full_then_deltas_are_applied_in_place(guarded_server: ServerHandle, published) -> None:
    root, snaps = published
    assert _reload(guarded_server, root / "version-1").status_code == 200
    assert _served_digest(guarded_server) == _digest(snaps[1]) == guarded_server.engine.weights_digest
    for version in range(2, 7):
        assert _digest(snaps[version]) != _digest(snaps[version - 1])
        assert _applied(guarded_server, root / f"version-{version}") == "delta"
        # After each delta the server computes with the trainer's snapshot, bit for bit.
        assert _served_digest(guarded_server) == _digest(snaps[version]) == guarded_server.engine.weights_digest
    assert _greedy(guarded_server) != []
    # The version held, synced again (announced again after a step that left the weights as
    # they were): nothing read, nothing copied.
    assert _applied(guarded_server, root / "version-6") == "held"
    assert _served_digest(guarded_server) == _digest(snaps[6])
    # vLLM's method name still answers as vLLM does.
    r = _reload(guarded_server, root / "version-6", method="reload_weights")
    assert r.status_code == 200 and r.json() == {"results": [None]}


def test_a_fresh_server_given_a_delta_loads_its_chain(guarded_server: ServerHandle, published) -> None:
    root, snaps = published
    assert guarded_server.engine.weights_digest is None  # started from a model directory
    assert _applied(guarded_server, root / "version-4") == "chain"
    assert _served_digest(guarded_server) == _digest(snaps[4])
    assert _applied(guarded_server, root / "version-5") == "delta"
    assert _served_digest(guarded_server) == _digest(snaps[5])


def test_a_delta_whose_base_the_server_does_not_hold_loads_the_chain(guarded_server: ServerHandle,
                                                                      published) -> None:
    root, snaps = published
    assert _applied(guarded_server, root / "version-1") == "full"
    assert _applied(guarded_server, root / "version-3") == "chain"  # version-2 was missed
    assert _served_digest(guarded_server) == _digest(snaps[3])
    assert _applied(guarded_server, root / "version-4") == "delta"
    # Back to the starting model: no digest held, so the next delta replays its chain again.
    assert _applied(guarded_server, guarded_server.engine.model_path) == "full"
    assert guarded_server.engine.weights_digest is None
    assert _applied(guarded_server, root / "version-5") == "chain"
    assert _served_digest(guarded_server) == _digest(snaps[5])


def _copy(root: Path, dest: Path, versions: range) -> Path:
    import shutil

    for v in versions:
        shutil.copytree(root / f"version-{v}", dest / f"version-{v}")
    return dest


def _flip(path: Path, start: int, stop: int) -> None:
    data = bytearray(path.read_bytes())
    for i in range(start % len(data), stop % len(data) or len(data)):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def test_a_corrupted_delta_is_400_and_the_previous_version_keeps_serving(guarded_server: ServerHandle,
                                                                          published, tmp_path: Path) -> None:
    root = _copy(published[0], tmp_path, range(1, 5))
    snaps = published[1]
    assert _applied(guarded_server, root / "version-1") == "full"
    assert _applied(guarded_server, root / "version-2") == "delta"
    before = _greedy(guarded_server)
    # Values flipped: the in-place apply fails its checksums and is undone, the chain fails them too.
    _flip(root / "version-3" / wd.DELTA_FILE, -200, -1)
    r = _reload(guarded_server, root / "version-3")
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "version-3" in message and ("checksums" in message or "out of range" in message), message
    assert "publish a full version" in message
    assert _served_digest(guarded_server) == _digest(snaps[2]) == guarded_server.engine.weights_digest
    assert _greedy(guarded_server) == before
    # The header broken: unreadable.
    _flip(root / "version-3" / wd.DELTA_FILE, 0, 8)
    r = _reload(guarded_server, root / "version-3")
    assert r.status_code == 400 and "cannot read" in r.json()["error"]["message"], r.text
    assert _served_digest(guarded_server) == _digest(snaps[2])
    assert _greedy(guarded_server) == before


def test_a_broken_chain_is_400_saying_what_to_do(guarded_server: ServerHandle, published,
                                                 tmp_path: Path) -> None:
    root = _copy(published[0], tmp_path, range(3, 5))  # version-1 and version-2 are gone
    before = _served_digest(guarded_server)
    r = _reload(guarded_server, root / "version-4")
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert f"version-3 is a delta on version-2, which is not in {root}" in message, message
    assert "publish a full version (trainer full_every) or restore it" in message
    assert _served_digest(guarded_server) == before and guarded_server.engine.weights_digest is None


def test_a_corrupted_full_version_is_400_and_changes_nothing(guarded_server: ServerHandle, published,
                                                             tmp_path: Path) -> None:
    root = _copy(published[0], tmp_path, range(1, 2))
    before = _greedy(guarded_server)
    _flip(root / "version-1" / wd.FULL_FILE, -64, -1)  # inside the last tensor's values
    r = _reload(guarded_server, root / "version-1")
    assert r.status_code == 400 and "do not match their checksums" in r.json()["error"]["message"], r.text
    assert _greedy(guarded_server) == before and guarded_server.engine.weights_digest is None


def test_after_fifty_deltas_the_server_holds_the_trainers_snapshot_bit_for_bit(guarded_server: ServerHandle,
                                                                               tiny_model: Path, tmp_path: Path) -> None:
    """Issue 40's target: one full version, then 50 deltas each applied in place on the last
    (never a chain replay), and what the server computes with hashes like the trainer's snapshot."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    state = {n: t.clone() for n, t in model.state_dict().items()}
    base = None
    for version in range(1, 52):
        if version > 1:
            # An RL step at bf16 resolution: a few values in every tensor move by a visible amount.
            state = {n: t + (torch.rand(t.shape, generator=gen) < 0.02) * 0.05 * t for n, t in state.items()}
        snap = snapshot(state, model.config, torch.bfloat16)
        path, manifest = _publish(tmp_path, version, snap, base, model.config)
        base = (snap, manifest)
        applied = _applied(guarded_server, path)
        assert applied == ("full" if version == 1 else "delta"), (version, applied)
    assert manifest["kind"] == "delta" and manifest["full_version"] == 1
    assert _served_digest(guarded_server) == _digest(base[0]) == guarded_server.engine.weights_digest
