"""LoRA versions through the sampler into Tandem's CPU server (real server, real adapters
built with peft): each version's adapter is loaded in place, verified by the trainer's probe
before the server gets work, and then every request computes with it; a wrong adapter is
caught; a restarted server is brought back to the current adapter; a joining server that
cannot serve adapters is refused."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.inference.testing import ServerHandle, start_server
from shared.adapters import DEFAULT_ADAPTER_NAME
from tests.support.adapters import build_adapter, probe_of, reference_logprobs

pytestmark = pytest.mark.timeout(120)

IDS = [5, 17, 3, 42, 8, 11, 29, 4, 61, 7, 23, 9]


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: build_adapter(tiny_model, root / name, seed=seed) for name, seed in (("a", 1), ("b", 2))}


@pytest.fixture(scope="module")
def probes(tiny_model: Path, adapters: dict[str, Path]) -> dict[str, dict]:
    return {name: probe_of(tiny_model, path, IDS) for name, path in adapters.items()}


@pytest.fixture
def lora_server(tiny_model: Path) -> Iterator[ServerHandle]:
    handle = start_server(tiny_model, served_model_name="tiny", enable_lora=True)
    yield handle
    handle.stop()


def _publish(url: str, version: int, path: Path, probe: dict | None) -> httpx.Response:
    body = {"version": version, "checkpoint_path": str(path), "adapter": True}
    if probe is not None:
        body["probe"] = probe
    return httpx.post(url + "/weights_version", json=body, timeout=60)


def _wait(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _server(url: str) -> dict:
    return httpx.get(url + "/inference_servers", timeout=10).json()["servers"][0]


def _greedy_through_sampler(sampler_url: str) -> dict:
    body = {"token_ids": IDS[:6], "sampling_params": {"temperature": 0, "max_tokens": 6, "ignore_eos": True,
                                                      "logprobs": 0}}
    answer = httpx.post(sampler_url + "/inference/v1/generate", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


def test_each_adapter_version_is_verified_then_every_request_computes_with_it(
        make_sampler, lora_server, tiny_model, adapters, probes):
    sampler = make_sampler(inference_urls=[lora_server.url])
    _wait(lambda: _server(sampler.url)["state"] == "ok", "the server to join")
    for version, name in ((1, "a"), (2, "b")):
        answer = _publish(sampler.url, version, adapters[name], probes[name])
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["version"] == version and body["adapter"] is True
        server = body["servers"][0]
        assert server["version"] == version and server["adapter"] == DEFAULT_ADAPTER_NAME
        assert server["probe"]["ok"] and server["probe"]["max_abs_diff"] < 1e-4, server["probe"]
        # The server holds the adapter under the run's name, loaded from this version's directory.
        cards = httpx.get(lora_server.url + "/v1/models", timeout=10).json()["data"]
        assert {c["id"]: c.get("root") for c in cards}[DEFAULT_ADAPTER_NAME] == str(adapters[name])
        # A request through the sampler names the base model; the server computes with the adapter.
        choice = _greedy_through_sampler(sampler.url)
        served = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        ids = IDS[:6] + choice["token_ids"]
        expected = reference_logprobs(tiny_model, adapters[name], ids)[len(IDS[:6]) - 1:]
        assert max(abs(s - e) for s, e in zip(served, expected)) < 1e-3, (served, expected)
        base = reference_logprobs(tiny_model, None, ids)[len(IDS[:6]) - 1:]
        assert max(abs(s - b) for s, b in zip(served, base)) > 0.05  # and not with the base model
        assert choice["weight_versions"][0]["version"] == str(version)


def test_a_wrong_adapter_is_caught_by_the_probe_and_not_published(make_sampler, lora_server, adapters, probes):
    sampler = make_sampler(inference_urls=[lora_server.url])
    _wait(lambda: _server(sampler.url)["state"] == "ok", "the server to join")
    # Adapter b's directory, adapter a's numbers: what a trainer that published the wrong files sends.
    answer = _publish(sampler.url, 1, adapters["b"], probes["a"])
    assert answer.status_code == 422, answer.text
    assert "none computes the trainer's logprobs" in answer.json()["detail"]
    weights = httpx.get(sampler.url + "/weights_version", timeout=10).json()
    assert weights["version"] == 0
    assert weights["servers"][0]["state"] == "mismatch"
    # The right adapter brings it back.
    assert _publish(sampler.url, 1, adapters["a"], probes["a"]).status_code == 200
    assert _server(sampler.url)["state"] == "ok"


def test_a_restarted_server_is_resynced_to_the_current_adapter(make_sampler, tiny_model, adapters, probes):
    first = start_server(tiny_model, served_model_name="tiny", enable_lora=True)
    port = first.port
    try:
        sampler = make_sampler(inference_urls=[first.url], server_check_interval=0.2)
        _wait(lambda: _server(sampler.url)["state"] == "ok", "the server to join")
        assert _publish(sampler.url, 1, adapters["a"], probes["a"]).status_code == 200
        first.stop()
        again = start_server(tiny_model, served_model_name="tiny", enable_lora=True, port=port)
        try:
            # A fresh server holds no adapter; the fleet sees the lost label and loads version 1's.
            server = _wait(lambda: (s := _server(sampler.url))["resyncs"] >= 1 and s["state"] == "ok" and s,
                           "the restarted server to be re-synced")
            assert server["version"] == 1 and server["adapter"] == DEFAULT_ADAPTER_NAME
            assert server["probe"]["ok"], server["probe"]
            cards = httpx.get(again.url + "/v1/models", timeout=10).json()["data"]
            assert {c["id"]: c.get("root") for c in cards}[DEFAULT_ADAPTER_NAME] == str(adapters["a"])
        finally:
            again.stop()
    finally:
        first.stop()


def test_a_server_that_cannot_serve_adapters_is_refused_at_join(make_sampler, lora_server, standin, adapters, probes):
    sampler = make_sampler(inference_urls=[lora_server.url])
    _wait(lambda: _server(sampler.url)["state"] == "ok", "the server to join")
    assert _publish(sampler.url, 1, adapters["a"], probes["a"]).status_code == 200
    # The stand-in has no /v1/load_lora_adapter, as a vLLM started without runtime LoRA updating.
    answer = httpx.post(sampler.url + "/inference_servers", json={"url": standin.url}, timeout=60)
    assert answer.status_code == 422, answer.text
    assert "does not serve LoRA adapters" in answer.json()["detail"]
    urls = [s["url"] for s in httpx.get(sampler.url + "/inference_servers", timeout=10).json()["servers"]]
    assert urls == [lora_server.url]


def test_an_adapter_path_the_server_cannot_find_is_a_422_naming_it(make_sampler, lora_server, tmp_path):
    sampler = make_sampler(inference_urls=[lora_server.url])
    _wait(lambda: _server(sampler.url)["state"] == "ok", "the server to join")
    missing = tmp_path / "not-written-yet"
    answer = _publish(sampler.url, 1, missing, None)
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"]
    # The server serves adapters; it found none there: that is what the message must say.
    assert "No adapter found" in detail and "does not serve LoRA adapters" not in detail, detail
    assert httpx.get(sampler.url + "/weights_version", timeout=10).json()["version"] == 0
