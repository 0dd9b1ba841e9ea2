"""`stream: true` on POST /v1/chat/completions and POST /v1/completions, read with the official
openai SDK and raw SSE: vLLM's chunk shapes, and the streamed answer equal to the non-streamed
one for the same seed (tool-call streams: test_inference_tools.py)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from services.inference.streaming import text_deltas
from services.inference.testing import ServerHandle

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def _sse(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    frames = r.text.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    return [json.loads(f.removeprefix("data: ")) for f in frames[:-2]]


def test_chat_stream_equals_the_answer(client: openai.OpenAI) -> None:
    kwargs = {"model": "tiny", "messages": MESSAGES, "max_tokens": 24, "temperature": 1.0, "seed": 9, "n": 2,
              "logprobs": True, "top_logprobs": 2}
    whole = client.chat.completions.create(**kwargs, extra_body={"return_token_ids": True,
                                                                 "return_weight_versions": True})
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True},
        extra_body={"return_token_ids": True, "return_weight_versions": True}))
    # First one role chunk per choice, the prompt's ids on the very first.
    for j in range(2):
        assert chunks[j].choices[0].index == j
        assert (chunks[j].choices[0].delta.role, chunks[j].choices[0].delta.content) == ("assistant", "")
    assert chunks[0].model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(exclude_none=True) == \
        whole.usage.model_dump(exclude_none=True)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == choice.index]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [t for c in mine for t in c.model_extra.get("token_ids") or []] == choice.model_extra["token_ids"]
        streamed = [e for c in mine if c.logprobs for e in c.logprobs.content]
        assert streamed == choice.logprobs.content
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
        assert mine[-1].finish_reason == choice.finish_reason
        assert mine[-1].model_extra["weight_versions"] == choice.model_extra["weight_versions"]
        assert not any(c.delta.tool_calls for c in mine)


def test_chat_stream_without_extras_sends_text_only(server: ServerHandle) -> None:
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    events = _sse(httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60))
    choices = [e["choices"][0] for e in events]
    assert "usage" not in events[-1] and "prompt_token_ids" not in events[0]
    # Every token chunk adds text (none carries logprobs or ids to justify an empty one).
    assert all(c["delta"].get("content") for c in choices[1:-1])
    assert all("token_ids" not in c and c["logprobs"] is None for c in choices)
    assert "".join(c["delta"].get("content", "") for c in choices) == whole["choices"][0]["message"]["content"]
    assert choices[-1] == {"index": 0, "delta": {}, "logprobs": None,
                           "finish_reason": whole["choices"][0]["finish_reason"], "stop_reason": None}


def test_continuous_usage_counts_up(server: ServerHandle) -> None:
    body = {"messages": MESSAGES, "max_tokens": 5, "temperature": 1.0, "seed": 1, "ignore_eos": True,
            "stream": True, "stream_options": {"continuous_usage_stats": True}}
    events = _sse(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60))
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 5
    assert len({e["usage"]["prompt_tokens"] for e in events}) == 1


def test_completion_stream_equals_the_answer_even_cut_by_a_stop_string(client: openai.OpenAI) -> None:
    kwargs = {"model": "tiny", "prompt": ["Once upon", "a time"], "max_tokens": 30, "temperature": 1.0, "seed": 4,
              "logprobs": 1}
    free = client.completions.create(**kwargs)
    # A stop string from inside the first answer: the text is cut there, mid-token-stream.
    stop = free.choices[0].text[10:12]
    whole = client.completions.create(**kwargs, stop=[stop], extra_body={"return_token_ids": True})
    assert whole.choices[0].finish_reason == "stop" and whole.choices[0].text == free.choices[0].text.split(stop)[0]
    chunks = list(client.completions.create(**kwargs, stop=[stop], stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [t for c in mine for t in c.model_extra.get("token_ids") or []] == choice.model_extra["token_ids"]
        assert mine[0].model_extra["prompt_token_ids"] == choice.model_extra["prompt_token_ids"]
        assert [lp for c in mine if c.logprobs for lp in c.logprobs.token_logprobs] == choice.logprobs.token_logprobs
        assert [off for c in mine if c.logprobs for off in c.logprobs.text_offset] == choice.logprobs.text_offset
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + [choice.finish_reason]
        assert mine[-1].model_extra["stop_reason"] == stop


def test_text_deltas_hold_half_characters_back() -> None:
    """Byte tokens (the stand-in's, and byte-level BPE's): a delta never holds half a UTF-8
    character, and the deltas add up to the text, cut or not."""
    ids = list("aé€!".encode())

    def decode(prefix: list[int]) -> str:
        return bytes(prefix).decode(errors="replace")

    assert text_deltas(ids, "aé€!", decode) == ["a", "", "é", "", "", "€", "!"]
    assert text_deltas(ids, "aé", decode) == ["a", "", "é", "", "", "", ""]  # a stop string cut the rest
    assert text_deltas([], "", decode) == []
