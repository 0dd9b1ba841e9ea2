"""The CPU server's OpenAI/vLLM API shapes, driven with the official openai SDK and raw httpx."""

from __future__ import annotations

import httpx
import openai
import pytest

from services.inference.testing import ServerHandle


@pytest.fixture
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=30)


@pytest.fixture
async def aclient(server: ServerHandle):
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_models_and_health(server: ServerHandle, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert models.data[0].id == "tiny"
    raw = httpx.get(server.url + "/v1/models").json()
    assert raw["data"][0]["max_model_len"] == 2048
    assert httpx.get(server.url + "/health").status_code == 200


async def test_completion_with_sdk(aclient: openai.AsyncOpenAI, server: ServerHandle) -> None:
    prompt = "Q: What is 3 + 4?\nA:"
    r = await aclient.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=7, logprobs=2,
        extra_body={"return_token_ids": True, "return_weight_versions": True, "ignore_eos": True},
    )
    choice = r.choices[0]
    extra = choice.model_extra
    tok = server.engine.tokenizer
    assert extra["prompt_token_ids"] == tok.encode(prompt)
    assert len(extra["token_ids"]) == 8
    assert tok.decode(extra["token_ids"], skip_special_tokens=True) == choice.text
    assert len(choice.logprobs.token_logprobs) == 8
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert choice.logprobs.tokens == [tok.decode([t]) for t in extra["token_ids"]]
    assert choice.logprobs.text_offset == list(range(8))
    assert all(2 <= len(t) <= 3 for t in choice.logprobs.top_logprobs)
    assert extra["weight_versions"] == [{"version": "0", "start": 0, "end": 8}]
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(extra["prompt_token_ids"]) and r.usage.completion_tokens == 8


async def test_chat_with_sdk(aclient: openai.AsyncOpenAI) -> None:
    r = await aclient.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=3, seed=1,
        logprobs=True, top_logprobs=2,
        extra_body={"return_token_ids": True, "ignore_eos": True, "return_weight_versions": True},
    )
    assert len(r.choices) == 3
    assert r.model_extra["prompt_token_ids"][0] == 1  # <|im_start|>
    for i, choice in enumerate(r.choices):
        assert choice.index == i
        assert choice.message.role == "assistant"
        assert len(choice.model_extra["token_ids"]) == 5
        assert [c.logprob for c in choice.logprobs.content] == pytest.approx(
            [c.logprob for c in choice.logprobs.content])
        assert len(choice.logprobs.content) == 5
        assert all(len(c.top_logprobs) == 2 for c in choice.logprobs.content)
        assert choice.model_extra["weight_versions"] == [{"version": "0", "start": 0, "end": 5}]
    # n samples with one seed are different samples (seed + i), not copies.
    assert len({tuple(c.model_extra["token_ids"]) for c in r.choices}) > 1


def test_raw_shapes_and_omitted_fields(server: ServerHandle) -> None:
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 200
    data = r.json()
    assert data["object"] == "text_completion"
    choice = data["choices"][0]
    # Not requested: absent (weight_versions) or null (token ids, logprobs), as in vLLM.
    assert "weight_versions" not in choice
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None and choice["logprobs"] is None
    assert set(data["usage"]) >= {"prompt_tokens", "completion_tokens", "total_tokens"}


def test_list_of_prompts(server: ServerHandle) -> None:
    body = {"prompt": ["ab", "cd"], "max_tokens": 2, "n": 2, "temperature": 0, "return_token_ids": True}
    data = httpx.post(server.url + "/v1/completions", json=body).json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    tok = server.engine.tokenizer
    assert [c["prompt_token_ids"] for c in data["choices"]] == [tok.encode("ab")] * 2 + [tok.encode("cd")] * 2
    assert data["usage"]["prompt_tokens"] == 4


def test_tokenize_and_detokenize(server: ServerHandle) -> None:
    r = httpx.post(server.url + "/tokenize", json={"prompt": "12 apples"}).json()
    assert r["count"] == 9 and r["max_model_len"] == 2048
    assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "12 apples"
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()
    # Three special tokens plus one token per character of "user\nx\nassistant\n".
    assert chat["count"] == 3 + len("user\nx\nassistant\n")


def test_metrics_are_prometheus_text(server: ServerHandle) -> None:
    httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
    text = httpx.get(server.url + "/metrics").text
    assert "vllm:generation_tokens_total" in text
    assert "tandem_inference_batch_size_bucket" in text


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({"prompt": "x" * 3000, "max_tokens": 1}, 400, "maximum context length"),
        ({"prompt": "hello", "max_tokens": 2047}, 400, "max_tokens"),
        ({"prompt": "hello", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "hello", "temperature": -0.5}, 400, "temperature"),
        ({"prompt": "hello", "top_p": 0}, 400, "top_p"),
        ({"prompt": "hello", "n": 0}, 400, "n"),
        ({"prompt": [1, 2, 100000]}, 400, "vocabulary"),
        ({"prompt": ""}, 400, "empty"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": "hi", "model": "no-such-model"}, 404, "does not exist"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "only be defined when `stream=True`"),
    ],
)
def test_bad_completion_requests_are_4xx(server: ServerHandle, body, status, fragment) -> None:
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"]
    assert err["code"] == status and err["type"] in ("BadRequestError", "NotFoundError")


def test_bad_requests_elsewhere_are_4xx(server: ServerHandle) -> None:
    assert httpx.post(server.url + "/v1/chat/completions", json={"messages": []}).status_code == 400
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert httpx.post(server.url + "/collective_rpc", json={"method": "explode"}).status_code == 400
    assert httpx.post(server.url + "/update_weight_version", json={}).status_code == 400
    assert httpx.post(server.url + "/pause", params={"mode": "sometimes"}).status_code == 400
    assert httpx.get(server.url + "/no/such/route").status_code == 404


def test_sdk_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="tiny", prompt="y" * 2100, max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=1)
