"""LoRA adapters on the CPU server, as vLLM serves them: POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, `model: <adapter>` per request, in-place reloads that requests in flight
continue on, /v1/models. Real PEFT adapters of the tiny model, built here; every served number is
held to what transformers + peft compute with the same adapter."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from services.inference.testing import ServerHandle, start_server
from tests.support.adapters import adapter_of

pytestmark = pytest.mark.timeout(60)

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IDS = [5, 17, 42, 8, 33, 60, 12, 9, 17, 42]
TOL = 1e-4


def _build(model, out: Path, *, seed: int, rank: int = 8, targets=ALL) -> Path:
    return adapter_of(model, out, seed=seed, rank=rank, targets=tuple(targets))


def _base(tiny_model: Path):
    return AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    other = _base(tiny_model).config.__class__(
        vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=1,
        num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
    return {
        "a": _build(_base(tiny_model), root / "a", seed=1),
        # a's rank and targets, other numbers: a new version of the same adapter (its tensors are
        # copied into the layers a built, the path a trainer's every step takes)
        "a2": _build(_base(tiny_model), root / "a2", seed=5),
        "b": _build(_base(tiny_model), root / "b", seed=2, rank=4, targets=("q_proj", "v_proj", "down_proj")),
        "other-shapes": _build(AutoModelForCausalLM.from_config(other), root / "other", seed=3),
        "rank-32": _build(_base(tiny_model), root / "rank32", seed=4, rank=32),
    }


def _logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, float32."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def reference(tiny_model: Path, adapters: dict[str, Path]):
    """reference(adapter or None, ids): transformers (+ peft) logprobs of ids[1:]."""
    models = {None: _base(tiny_model)}
    for key in ("a", "b"):
        models[key] = PeftModel.from_pretrained(_base(tiny_model), str(adapters[key])).eval()
    return lambda key, ids: _logprobs(models[key], ids)


@pytest.fixture(scope="module")
def lora_server(tiny_model: Path) -> Iterator[ServerHandle]:
    """Shared: every test loads its adapters under names of its own, in place."""
    handle = start_server(tiny_model, served_model_name="tiny", enable_lora=True, max_loras=8)
    yield handle
    handle.stop()


def _load(url: str, name: str, path: Path | str, inplace: bool = True) -> httpx.Response:
    return httpx.post(url + "/v1/load_lora_adapter", timeout=30,
                      json={"lora_name": name, "lora_path": str(path), "load_inplace": inplace})


def _probe(url: str, model: str | None, ids: list[int] = IDS) -> list[float]:
    """The sampler's probe: prompt_logprobs of a token-id prompt."""
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    if model is not None:
        body["model"] = model
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    rows = r.json()["choices"][0]["prompt_logprobs"]
    return [rows[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]


def _diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def _error(r: httpx.Response, status: int, fragment: str) -> None:
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]["message"], r.text


async def _waiting(c: httpx.AsyncClient, n: int) -> None:
    for _ in range(1000):
        text = (await c.get("/metrics")).text
        if re.search(rf'^vllm:num_requests_waiting{{[^}}]*}} {n}\.0$', text, re.M):
            return
        await asyncio.sleep(0.01)
    raise TimeoutError(f"{n} requests never waited")


async def test_adapter_rows_match_peft_and_base_rows_stay_base_in_one_batch(
        lora_server: ServerHandle, adapters, reference) -> None:
    url, engine = lora_server.url, lora_server.engine
    assert _load(url, "mix", adapters["a"]).text == "Success: LoRA adapter 'mix' added successfully."
    # The same prompt with and without the adapter (never one prefill, nor one prompt_logprobs, for
    # both), and a shorter one (left padding).
    asks = [("mix", "a", [5, 17, 42, 8, 33, 60]), ("tiny", None, [5, 17, 42, 8, 33, 60]), ("tiny", None, [12, 9, 17])]
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0, "prompt_logprobs": 0,
            "return_token_ids": True}
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        # Paused, all queue; resumed, one step admits them all: adapter and base rows in one batch.
        await c.post("/pause", params={"mode": "keep"})
        flights = [asyncio.create_task(c.post("/v1/completions", json={**body, "model": m, "prompt": p}))
                   for m, _, p in asks]
        await _waiting(c, len(asks))
        await c.post("/resume")
        answers = [(await f).json() for f in flights]
    assert engine.stats["last_batch_size"] == len(asks)
    for (model, key, prompt), answer in zip(asks, answers):
        assert answer["model"] == model
        choice = answer["choices"][0]
        ids = prompt + choice["token_ids"]
        expected = reference(key, ids)
        served_prompt = [choice["prompt_logprobs"][i][str(ids[i])]["logprob"] for i in range(1, len(prompt))]
        assert _diff(served_prompt, expected[:len(prompt) - 1]) < TOL
        assert _diff(choice["logprobs"]["token_logprobs"], expected[len(prompt) - 1:]) < TOL
    # The adapter moves the numbers: a server that ignored it would fail above.
    assert _diff(reference("a", IDS), reference(None, IDS)) > 0.1
    assert _diff(_probe(url, "mix"), reference("a", IDS)) < TOL
    assert _diff(_probe(url, None), reference(None, IDS)) < TOL
    assert _diff(_probe(url, "tiny"), reference(None, IDS)) < TOL


def test_other_endpoints_take_the_adapter(lora_server: ServerHandle, adapters, reference) -> None:
    url = lora_server.url
    assert _load(url, "ends", adapters["a"]).status_code == 200
    r = httpx.post(url + "/inference/v1/generate", timeout=30, json={
        "model": "ends", "token_ids": IDS, "sampling_params": {"max_tokens": 1, "temperature": 0,
                                                              "prompt_logprobs": 0}})
    assert r.status_code == 200 and r.json()["model"] == "ends", r.text
    rows = r.json()["prompt_logprobs"]
    assert _diff([rows[i][str(IDS[i])]["logprob"] for i in range(1, len(IDS))], reference("a", IDS)) < TOL
    r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": "ends", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "ends", r.text
    assert httpx.post(url + "/tokenize", json={"model": "ends", "prompt": "hi"}).status_code == 200


def test_load_in_place_serves_the_new_adapter(lora_server: ServerHandle, adapters, reference) -> None:
    url = lora_server.url
    assert _load(url, "swap", adapters["a"]).status_code == 200
    assert _diff(_probe(url, "swap"), reference("a", IDS)) < TOL
    assert _load(url, "swap", adapters["b"]).status_code == 200  # other rank, other target modules
    served = _probe(url, "swap")
    assert _diff(served, reference("b", IDS)) < TOL
    assert _diff(served, reference("a", IDS)) > 0.1
    card = next(m for m in httpx.get(url + "/v1/models").json()["data"] if m["id"] == "swap")
    assert card["root"] == str(adapters["b"])
    # A full-weights reload still finds the base weights under the adapter's LoRA layers.
    r = httpx.post(url + "/collective_rpc", timeout=60,
                   json={"method": "reload_weights", "kwargs": {"weights_path": str(lora_server.engine.model_path)}})
    assert r.status_code == 200, r.text
    assert _diff(_probe(url, "swap"), reference("b", IDS)) < TOL


@pytest.mark.parametrize("second", ["a2", "b"])
async def test_a_request_frozen_by_pause_keep_continues_on_the_new_adapter(
        lora_server: ServerHandle, adapters, tiny_model: Path, second: str) -> None:
    url, engine = lora_server.url, lora_server.engine
    name = "keep-" + second
    assert _load(url, name, adapters["a"]).status_code == 200
    label = engine.weight_version
    prompt = [5, 17, 42]
    body = {"model": name, "prompt": prompt, "max_tokens": 200, "ignore_eos": True, "temperature": 0,
            "logprobs": 0, "return_token_ids": True, "return_weight_versions": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        start = engine.stats["generated_tokens"]
        flight = asyncio.create_task(c.post("/v1/completions", json=body))
        while engine.stats["generated_tokens"] - start < 20:
            await asyncio.sleep(0.005)
        await c.post("/pause", params={"mode": "keep"})
        # The sampler's sync: pause keep, load in place, relabel, resume.
        r = await c.post("/v1/load_lora_adapter",
                         json={"lora_name": name, "lora_path": str(adapters[second]), "load_inplace": True})
        assert r.status_code == 200, r.text
        await c.post("/update_weight_version", json={"new_version": name + "-v2"})
        assert not flight.done()
        await c.post("/resume")
        choice = (await flight).json()["choices"][0]
    spans, tokens, served = choice["weight_versions"], choice["token_ids"], choice["logprobs"]["token_logprobs"]
    assert [s["version"] for s in spans] == [label, name + "-v2"], spans
    k = spans[0]["end"]
    assert 20 <= k < 200
    # What it must equal: tokens 0..k-1 under A; then B, on top of the KV cache A computed for the
    # prompt and tokens 0..k-2 (token k-1 is the input of the first step under B).
    model = PeftModel.from_pretrained(_base(tiny_model), str(adapters["a"]), adapter_name="a")
    model.load_adapter(str(adapters[second]), adapter_name="b")
    model.eval()
    ids = prompt + tokens
    cut = len(prompt) + k - 1
    with torch.no_grad():
        first = model(input_ids=torch.tensor([ids[:cut]]), use_cache=True, adapter_names=["a"])
        rest = model(input_ids=torch.tensor([ids[cut:-1]]), past_key_values=first.past_key_values,
                     use_cache=True, adapter_names=["b"])
    logits = torch.cat([first.logits[0, len(prompt) - 1:], rest.logits[0]]).float()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    assert _diff(served, expected) < TOL
    # Had it stayed on A, the tokens after k would be A's numbers instead.
    with torch.no_grad():
        on_a = model(input_ids=torch.tensor([ids[:-1]]), adapter_names=["a"]).logits[0, len(prompt) - 1:]
    only_a = torch.log_softmax(on_a.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    assert _diff(served[:k], only_a[:k]) < TOL and _diff(served[k:], only_a[k:]) > 0.1


async def test_unload_lets_requests_in_flight_finish_with_the_adapter(lora_server: ServerHandle, adapters,
                                                                    reference) -> None:
    url, engine = lora_server.url, lora_server.engine
    assert _load(url, "going", adapters["a"]).status_code == 200
    body = {"model": "going", "prompt": IDS, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_token_ids": True}
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        await c.post("/pause", params={"mode": "keep"})
        flight = asyncio.create_task(c.post("/v1/completions", json=body))
        await _waiting(c, 1)
        assert (await c.post("/v1/unload_lora_adapter", json={"lora_name": "going"})).status_code == 200
        # A load frees the weights of unloaded adapters, but not while a request still needs them.
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "after", "lora_path": str(adapters["b"]),
                                                        "load_inplace": True})
        assert r.status_code == 200
        assert engine.adapters.slots == len(engine.adapters.loaded) + 1
        await c.post("/resume")
        choice = (await flight).json()["choices"][0]
    ids = IDS + choice["token_ids"]
    assert _diff(choice["logprobs"]["token_logprobs"], reference("a", ids)[len(IDS) - 1:]) < TOL
    assert _load(url, "after", adapters["b"]).status_code == 200
    assert engine.adapters.slots == len(engine.adapters.loaded)


def test_bad_requests_are_4xx_and_change_nothing(lora_server: ServerHandle, adapters, reference,
                                                 tmp_path: Path) -> None:
    url = lora_server.url
    assert _load(url, "good", adapters["a"]).status_code == 200
    load = url + "/v1/load_lora_adapter"
    _error(httpx.post(load, json={"lora_path": str(adapters["a"])}), 400, "lora_name")
    _error(httpx.post(load, json={"lora_name": "", "lora_path": str(adapters["a"])}), 400,
           "Both 'lora_name' and 'lora_path' must be provided.")
    _error(_load(url, "tiny", adapters["a"]), 400, "conflicts with a served base model")
    _error(_load(url, "good", adapters["b"], inplace=False), 400, "set 'load_inplace' to True")
    _error(_load(url, "x", tmp_path / "nowhere"), 404, "No adapter found")
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "adapter_config.json").write_text((adapters["a"] / "adapter_config.json").read_text())
    _error(_load(url, "x", tmp_path / "config-only"), 404, "adapter_model.safetensors")
    _error(_load(url, "x", adapters["rank-32"]), 400, "--max-lora-rank 32")
    # Failed loads in place, under the serving name: the old adapter keeps serving.
    _error(_load(url, "good", adapters["other-shapes"]), 400, "shape")
    _error(_load(url, "good", adapters["rank-32"]), 400, "greater than max_lora_rank 16")
    _error(httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "never"}), 404, "cannot be found")
    _error(httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": ""}), 400, "needs to be provided")
    ids = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    assert "x" not in ids and "good" in ids
    assert _diff(_probe(url, "good"), reference("a", IDS)) < TOL
    assert _diff(_probe(url, None), reference(None, IDS)) < TOL


def test_models_list_and_unload(lora_server: ServerHandle, adapters, reference) -> None:
    url = lora_server.url
    assert _load(url, "listed", adapters["a"]).status_code == 200
    data = httpx.get(url + "/v1/models").json()["data"]
    assert data[0]["id"] == "tiny" and data[0]["parent"] is None
    card = next(m for m in data if m["id"] == "listed")
    assert card["object"] == "model" and card["root"] == str(adapters["a"]) and card["parent"] == "tiny"
    assert card["owned_by"] == "vllm" and card["max_model_len"] is None

    _error(httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 1}), 404,
           "The model `nope` does not exist.")
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "listed"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'listed' removed successfully."
    assert "listed" not in [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    _error(httpx.post(url + "/v1/completions", json={"model": "listed", "prompt": "hi", "max_tokens": 1}), 404,
           "does not exist")
    # Loaded again (not in place: the name is free), it serves again.
    assert _load(url, "listed", adapters["b"], inplace=False).status_code == 200
    assert _diff(_probe(url, "listed"), reference("b", IDS)) < TOL


def test_first_and_last_adapter_max_loras_and_a_server_without_lora(tiny_model: Path, adapters, reference) -> None:
    with_two = start_server(tiny_model, served_model_name="tiny", max_loras=2)  # enable_lora unset: on
    off = start_server(tiny_model, served_model_name="tiny", enable_lora=False)
    url, unload = with_two.url, with_two.url + "/v1/unload_lora_adapter"
    try:
        # A first adapter that does not fit: the LoRA layers peft put in for it go again.
        _error(_load(url, "one", adapters["other-shapes"]), 400, "shape")
        assert with_two.engine.adapters.slots == 0
        assert _diff(_probe(url, None), reference(None, IDS)) < TOL
        for name in ("one", "two"):
            assert _load(url, name, adapters["a"]).status_code == 200
        _error(_load(url, "three", adapters["a"]), 400, "--max-loras")
        assert httpx.post(unload, json={"lora_name": "one"}).status_code == 200
        assert _load(url, "three", adapters["b"]).status_code == 200
        assert _diff(_probe(url, "three"), reference("b", IDS)) < TOL
        # Unloaded and used by no request: freed at once; the last one gone, the bare model again.
        for name in ("two", "three"):
            assert httpx.post(unload, json={"lora_name": name}).status_code == 200
        assert with_two.engine.adapters.slots == 0
        assert _diff(_probe(url, None), reference(None, IDS)) < TOL

        _error(_load(off.url, "one", adapters["a"]), 404, "--enable-lora")
        _error(httpx.post(off.url + "/v1/unload_lora_adapter", json={"lora_name": "one"}), 404, "--enable-lora")
        _error(httpx.post(off.url + "/v1/completions", json={"model": "one", "prompt": "hi", "max_tokens": 1}),
               404, "does not exist")
        assert [m["id"] for m in httpx.get(off.url + "/v1/models").json()["data"]] == ["tiny"]
    finally:
        with_two.stop()
        off.stop()
