"""Weight updates: reload_weights from an HF checkpoint dir, version labels, and the full
sampler sequence pause(keep) -> reload -> update_weight_version -> reset_prefix_cache -> resume."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.inference.testing import ServerHandle
from shared.probe import probe_request, served_logprobs


def _greedy(url: str, **extra) -> dict:
    body = {"prompt": "The weights are", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "return_weight_versions": True, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.fixture(scope="module")
def perturbed_checkpoint(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the trainer writes: the same architecture, changed weights, save_pretrained."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    out = tmp_path_factory.mktemp("ckpt") / "step-1"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    return out


def test_reload_changes_outputs_and_version(fresh_server: ServerHandle, perturbed_checkpoint: Path,
                                            tiny_model: Path) -> None:
    url = fresh_server.url
    assert httpx.get(url + "/weight_info").json() == {"weight_version": "0"}
    before = _greedy(url)
    assert before["weight_versions"] == [{"version": "0", "start": 0, "end": 12}]

    r = httpx.post(url + "/collective_rpc", timeout=60,
                   json={"method": "reload_weights", "kwargs": {"weights_path": str(perturbed_checkpoint)}})
    assert r.status_code == 200 and r.json() == {"results": [None]}
    assert httpx.post(url + "/update_weight_version", json={"new_version": "1"}).json() == \
        {"success": True, "new_version": "1"}
    assert httpx.get(url + "/weight_info").json() == {"weight_version": "1"}

    after = _greedy(url)
    assert after["token_ids"] != before["token_ids"]
    assert after["weight_versions"] == [{"version": "1", "start": 0, "end": 12}]

    # Reloading the original checkpoint restores the original greedy output exactly.
    r = httpx.post(url + "/collective_rpc", timeout=60,
                   json={"method": "reload_weights", "kwargs": {"weights_path": str(tiny_model)}})
    assert r.status_code == 200
    assert _greedy(url)["token_ids"] == before["token_ids"]
    assert 'tandem_inference_weight_version_info{model_name="tiny",version="1"} 1.0' in \
        httpx.get(url + "/metrics").text


def test_bad_checkpoints_are_400_and_change_nothing(fresh_server: ServerHandle, tmp_path: Path,
                                                   tiny_model: Path) -> None:
    url = fresh_server.url
    before = _greedy(url)
    other = AutoModelForCausalLM.from_config(
        AutoModelForCausalLM.from_pretrained(tiny_model).config.__class__(
            vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=1, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True))
    other.save_pretrained(tmp_path / "wrong-shape")
    (tmp_path / "empty").mkdir()
    for path, fragment in ((tmp_path / "missing", "not a directory"), (tmp_path / "empty", "no *.safetensors"),
                           (tmp_path / "wrong-shape", "shape")):
        r = httpx.post(url + "/collective_rpc", json={"method": "reload_weights",
                                                      "kwargs": {"weights_path": str(path)}})
        assert r.status_code == 400, r.text
        assert fragment in r.json()["error"]["message"]
    assert _greedy(url)["token_ids"] == before["token_ids"]


async def test_keep_pause_across_update_gives_two_spans(fresh_server: ServerHandle,
                                                        perturbed_checkpoint: Path) -> None:
    """The sampler's weight-sync sequence, with a request in flight across it."""
    url, engine = fresh_server.url, fresh_server.engine
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        body = {"prompt": "long", "max_tokens": 200, "ignore_eos": True, "temperature": 1.0, "seed": 1,
                "return_token_ids": True, "return_weight_versions": True, "logprobs": 0}
        flight = asyncio.create_task(c.post("/v1/completions", json=body))
        while engine.stats["generated_tokens"] < 20:
            await asyncio.sleep(0.005)
        assert (await c.post("/pause", params={"mode": "keep"})).json() == {"status": "paused"}
        assert (await c.get("/is_paused")).json() == {"is_paused": True}
        r = await c.post("/collective_rpc", json={"method": "reload_weights",
                                                  "kwargs": {"weights_path": str(perturbed_checkpoint)}})
        assert r.status_code == 200
        assert (await c.post("/update_weight_version", json={"new_version": "1"})).status_code == 200
        assert (await c.post("/reset_prefix_cache")).json() == {"success": True}
        assert not flight.done()
        assert (await c.post("/resume")).json() == {"status": "resumed"}
        assert (await c.get("/is_paused")).json() == {"is_paused": False}
        choice = (await flight).json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 200
    spans = choice["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "1"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 200
    assert 20 <= spans[0]["end"] < 200
    assert len(choice["logprobs"]["token_logprobs"]) == 200


async def test_a_relabelling_reload_swaps_weights_and_label_between_two_steps(
        fresh_server: ServerHandle, perturbed_checkpoint: Path, tiny_model: Path) -> None:
    """`tandem_reload_weights` with `weight_version`: no pause around it, and the tokens labelled
    with the old version are the old weights' (greedy), the rest are not."""
    url, engine = fresh_server.url, fresh_server.engine
    info = httpx.get(url + "/server_info").json()
    assert info == {"tandem": {"server": "cpu", "reload_method": "tandem_reload_weights", "relabels_on_reload": True}}
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        body = {"prompt": "long", "max_tokens": 200, "ignore_eos": True, "temperature": 0,
                "return_token_ids": True, "return_weight_versions": True}
        old = (await c.post("/v1/completions", json=body)).json()["choices"][0]["token_ids"]
        done = engine.stats["generated_tokens"]
        flight = asyncio.create_task(c.post("/v1/completions", json=body))
        while engine.stats["generated_tokens"] < done + 20:
            await asyncio.sleep(0.005)
        r = await c.post("/collective_rpc", json={"method": "tandem_reload_weights", "kwargs": {
            "weights_path": str(perturbed_checkpoint), "weight_version": "7"}})
        assert r.status_code == 200, r.text
        assert r.json()["results"][0]["weight_version"] == "7"
        assert (await c.get("/weight_info")).json() == {"weight_version": "7"}
        assert (await c.get("/is_paused")).json() == {"is_paused": False}
        choice = (await flight).json()["choices"][0]
        spans = choice["weight_versions"]
        assert [s["version"] for s in spans] == ["0", "7"], spans
        cut = spans[0]["end"]
        assert 20 <= cut < 200 and spans[1] == {"version": "7", "start": cut, "end": 200}
        assert choice["token_ids"][:cut] == old[:cut]
        assert choice["token_ids"][cut:] != old[cut:]


@pytest.mark.parametrize(("rpc", "says"), [
    ({"method": "tandem_reload_weights", "kwargs": {"weight_version": 7}}, "weight_version must be a string"),
    ({"method": "reload_weights", "kwargs": {"weight_version": "7"}}, "weight_version must be a string"),
    ({"method": "tandem_reload_weights", "kwargs": {"weight_version": "7", "probe_token_ids": [5]}},
     "probe_token_ids must be a list of 2 to"),
    ({"method": "tandem_reload_weights", "kwargs": {"weight_version": "7", "probe_token_ids": [5, 10 ** 6]}},
     "probe_token_ids must be a list of 2 to"),
    ({"method": "tandem_reload_weights", "kwargs": {"weight_version": "7", "probe_token_ids": "5 6"}},
     "probe_token_ids must be a list of 2 to"),
    ({"method": "reload_weights", "kwargs": {"probe_token_ids": [5, 6]}}, "only tandem_reload_weights takes it"),
])
def test_a_bad_relabelling_reload_is_a_400_that_changes_nothing(fresh_server: ServerHandle, rpc: dict,
                                                                says: str) -> None:
    url = fresh_server.url
    r = httpx.post(url + "/collective_rpc", json=rpc, timeout=30)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]
    assert httpx.get(url + "/weight_info").json() == {"weight_version": "0"}
    assert fresh_server.engine.stats["reloads"] == 0


def test_a_reload_answers_the_probe_as_a_completion_would_on_the_new_weights(
        fresh_server: ServerHandle, perturbed_checkpoint: Path) -> None:
    """`probe_token_ids`: the answer's `probe` is the prompt logprobs a completion asks for, under
    the weights just loaded (not the ones before), in a completion's shape."""
    url, ids = fresh_server.url, [5, 17, 33, 8, 61, 2, 40]
    before = httpx.post(url + "/v1/completions", json={**probe_request(ids)}, timeout=60).json()
    r = httpx.post(url + "/collective_rpc", json={"method": "tandem_reload_weights", "kwargs": {
        "weights_path": str(perturbed_checkpoint), "weight_version": "3", "probe_token_ids": ids}}, timeout=60)
    assert r.status_code == 200, r.text
    inline = r.json()["results"][0]["probe"]
    after = httpx.post(url + "/v1/completions", json={**probe_request(ids)}, timeout=60).json()
    assert served_logprobs(inline, ids) == served_logprobs(after, ids)
    assert served_logprobs(inline, ids) != served_logprobs(before, ids)
    assert inline["choices"][0]["prompt_logprobs"] == after["choices"][0]["prompt_logprobs"]
