"""POST /weights_version with LoRA adapters, before any server loads one: the checks the
sampler makes itself, and a server that cannot serve adapters (the stand-in has no
/v1/load_lora_adapter, as a vLLM started without runtime LoRA updating)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from shared.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS

pytestmark = pytest.mark.timeout(60)


def _adapter_dir(root: Path) -> Path:
    path = root / "version-1"
    path.mkdir()
    (path / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    # A valid, empty safetensors file: an 8-byte header length, then a JSON header of 2 bytes.
    (path / ADAPTER_WEIGHTS).write_bytes((2).to_bytes(8, "little") + b"{}")
    return path


def _full_dir(root: Path) -> Path:
    path = root / "full-1"
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    return path


def test_an_adapter_needs_a_checkpoint_path(make_sampler):
    sampler = make_sampler()
    answer = httpx.post(sampler.url + "/weights_version", json={"version": 1, "adapter": True}, timeout=30)
    assert answer.status_code == 422
    assert "checkpoint_path is null" in answer.text


def test_an_adapter_published_as_full_weights_and_the_reverse_are_refused(make_sampler, standin, tmp_path):
    sampler = make_sampler()
    with httpx.Client(base_url=sampler.url, timeout=30) as http:
        adapter, full = _adapter_dir(tmp_path), _full_dir(tmp_path)
        as_full = http.post("/weights_version", json={"version": 1, "checkpoint_path": str(adapter)})
        assert as_full.status_code == 422
        assert "send adapter: true" in as_full.json()["detail"]
        as_adapter = http.post("/weights_version", json={"version": 1, "checkpoint_path": str(full),
                                                         "adapter": True})
        assert as_adapter.status_code == 422
        assert "holds no LoRA adapter" in as_adapter.json()["detail"]
        assert http.get("/weights_version").json()["version"] == 0
    # Refused before any server was touched.
    assert httpx.get(standin.url + "/_standin/stats").json()["reloads"] == []


def test_a_server_without_adapter_support_is_told_how_to_start(make_sampler, standin, tmp_path):
    sampler = make_sampler()
    answer = httpx.post(sampler.url + "/weights_version",
                        json={"version": 1, "checkpoint_path": str(_adapter_dir(tmp_path)), "adapter": True},
                        timeout=30)
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"]
    assert "does not serve LoRA adapters" in detail and "--enable-lora" in detail
    weights = httpx.get(sampler.url + "/weights_version").json()
    assert weights["version"] == 0 and weights["adapter"] is False
    assert httpx.get(standin.url + "/is_paused").json()["is_paused"] is False
