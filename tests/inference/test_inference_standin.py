"""The stand-in's POST /tokenize (vLLM's shape; tokens are bytes, chat messages rendered by the
tiny model's template) and its scripted multi-turn replies, over HTTP, on the instant path
(token_latency 0) and the per-token one."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from services.inference.standin import ALPHABET
from services.inference.tokenizer import build_tokenizer
from tests.support import generate_checks
from tests.support.servers import UvicornThread, start_standin

pytestmark = pytest.mark.timeout(60)

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
REPLIES = ["first turn", "second <tool_call> turn", "third and last"]


@pytest.fixture(params=[0.0, 0.001], ids=["instant", "per-token"])
def any_standin(request) -> Iterator[UvicornThread]:
    server = start_standin(token_latency=request.param)
    yield server
    server.stop()


def _post(server: UvicornThread, path: str, body) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def test_tokenize_a_prompt_gives_its_bytes(standin: UvicornThread) -> None:
    r = _post(standin, "/tokenize", {"model": "standin", "prompt": "2 + 3 = \u00e9", "add_special_tokens": False})
    assert r.status_code == 200, r.text
    expected = list("2 + 3 = \u00e9".encode())
    assert r.json() == {"count": len(expected), "max_model_len": 4096, "tokens": expected, "token_strs": None}


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "2 + 3?"}]},
    {"messages": [{"role": "user", "content": "2 + 3?"}], "add_generation_prompt": False, "tools": TOOLS},
    {"messages": [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "<tool_call>"}],
     "tools": TOOLS, "continue_final_message": True, "add_generation_prompt": False},
])
def test_tokenize_messages_gives_the_tiny_models_prompt(standin: UvicornThread, body) -> None:
    r = _post(standin, "/tokenize", {**body, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    text = build_tokenizer().apply_chat_template(
        body["messages"], tools=body.get("tools"), tokenize=False,
        add_generation_prompt=body.get("add_generation_prompt", True),  # vLLM's default
        continue_final_message=body.get("continue_final_message", False))
    assert r.json()["tokens"] == list(text.encode())
    assert r.json()["count"] == len(text.encode())


@pytest.mark.parametrize("body, fragment", [
    (b"{not json", "not JSON"),
    ([1, 2], "JSON object"),
    ({"prompt": 12}, "give either prompt"),
    ({}, "give either prompt"),
    ({"messages": "hi"}, "messages must be a list"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": "add"}, "tools must be a list"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"function": {}}]}, "could not apply"),
])
def test_bad_tokenize_bodies_are_400(standin: UvicornThread, body, fragment) -> None:
    if isinstance(body, bytes):
        r = httpx.post(standin.url + "/tokenize", content=body, headers={"content-type": "application/json"})
    else:
        r = _post(standin, "/tokenize", body)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]


def _prompt_at_turn(server: UvicornThread, turn: int) -> str:
    """The prompt of the turn-th model turn of a conversation, rendered by the stand-in."""
    messages = [{"role": "user", "content": "go"}]
    for k in range(turn - 1):
        messages += [{"role": "assistant", "content": REPLIES[min(k, 2)]}, {"role": "tool", "content": "ok"}]
    return bytes(_post(server, "/tokenize", {"messages": messages, "tools": TOOLS}).json()["tokens"]).decode()


def _complete(server: UvicornThread, prompt, max_tokens: int = 64, n: int = 1) -> list[dict]:
    r = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "n": n,
                                          "return_token_ids": True, "temperature": 1.0})
    assert r.status_code == 200, r.text
    return r.json()["choices"]


def test_scripted_replies_follow_the_turns(any_standin: UvicornThread) -> None:
    r = _post(any_standin, "/_standin/configure", {"replies": REPLIES})
    assert r.status_code == 200 and r.json()["replies"] == REPLIES
    for turn, expected in [(1, REPLIES[0]), (2, REPLIES[1]), (3, REPLIES[2]), (5, REPLIES[2])]:
        prompt = _prompt_at_turn(any_standin, turn)
        assert prompt.count("<|im_start|>assistant") == turn
        choices = _complete(any_standin, prompt, n=2)
        for choice in choices:
            assert choice["text"] == expected and choice["token_ids"] == list(expected.encode())
            assert choice["finish_reason"] == "stop"
    # A prompt with no assistant header at all gets the first reply; so do token-id prompts.
    assert _complete(any_standin, "plain text")[0]["text"] == REPLIES[0]
    ids = list(_prompt_at_turn(any_standin, 2).encode()) + [1000]
    assert _complete(any_standin, ids)[0]["text"] == REPLIES[1]


def test_max_tokens_cuts_a_scripted_reply(any_standin: UvicornThread) -> None:
    _post(any_standin, "/_standin/configure", {"replies": ["abcdef"]})
    cut = _complete(any_standin, "x", max_tokens=4)[0]
    assert (cut["text"], cut["finish_reason"]) == ("abcd", "length")
    # No room for the end of the sequence after the last character: cut, as in vLLM.
    assert _complete(any_standin, "x", max_tokens=6)[0]["finish_reason"] == "length"
    assert _complete(any_standin, "x", max_tokens=7)[0]["finish_reason"] == "stop"


def test_replies_win_over_reply_and_null_clears_them(any_standin: UvicornThread) -> None:
    _post(any_standin, "/_standin/configure", {"reply": "always", "replies": ["scripted"]})
    assert _complete(any_standin, "x")[0]["text"] == "scripted"
    r = _post(any_standin, "/_standin/configure", {"replies": None})
    assert r.json()["replies"] is None
    assert _complete(any_standin, "x")[0]["text"] == "always"
    _post(any_standin, "/_standin/configure", {"reply": None})
    texts = [c["text"] for c in _complete(any_standin, "x", max_tokens=8, n=8)]
    assert all(set(t) <= set(ALPHABET) for t in texts) and "always" not in texts


@pytest.mark.parametrize("replies", [[], "one", [1, 2], ["ok", None]])
def test_bad_replies_are_400(standin: UvicornThread, replies) -> None:
    r = _post(standin, "/_standin/configure", {"replies": replies})
    assert r.status_code == 400 and "replies must be" in r.json()["error"]["message"]
    assert _post(standin, "/_standin/configure", {}).json()["replies"] is None  # unchanged


def _generate(server: UvicornThread, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.url + "/inference/v1/generate", json=body, timeout=30, **kwargs)


def test_generate_answers_in_vllms_tokens_shape(any_standin: UvicornThread) -> None:
    """/inference/v1/generate on the stand-in: the completion path's tokens, in the generate
    shape (with renderers' `token` strings), stop_token_ids honoured."""
    prompt = list(b"count: ")
    body = {"token_ids": prompt, "sampling_params": {"n": 2, "max_tokens": 6, "seed": 1, "logprobs": 1},
            "return_token_ids": True}
    r = _generate(any_standin, body, headers={"X-Session-ID": "trace-7"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["prompt_token_ids"] == prompt and out["output_mode"] == "tokens"
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for choice in out["choices"]:
        generate_checks.check_logprobs_aligned(choice, token_strings=True)
        n = len(choice["token_ids"])
        assert choice["weight_versions"] == ([{"version": "0", "start": 0, "end": n}] if n else [])
    assert out["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in out["choices"])
    assert httpx.get(any_standin.url + "/_standin/stats").json()["sessions"] == {"trace-7": 1}

    _post(any_standin, "/_standin/configure", {"reply": "abcabc"})
    cut = _generate(any_standin, {"token_ids": prompt, "sampling_params": {"stop_token_ids": [ord("c")],
                                                                           "logprobs": 0}}).json()["choices"][0]
    assert cut["token_ids"] == list(b"abc") and (cut["finish_reason"], cut["stop_reason"]) == ("stop", ord("c"))
    assert cut["weight_versions"] == [{"version": "0", "start": 0, "end": 3}]
    assert len(cut["logprobs"]["content"]) == 3
    plain = _generate(any_standin, {"token_ids": prompt, "sampling_params": {}}).json()["choices"][0]
    assert plain["token_ids"] == list(b"abcabc") and plain["logprobs"] is None


@pytest.mark.parametrize("body, fragment", [
    ({"token_ids": [], "sampling_params": {}}, "token_ids"),
    ({"token_ids": [1, -2], "sampling_params": {}}, "token_ids"),
    ({"token_ids": [1]}, "sampling_params"),
    ({"token_ids": [1], "sampling_params": {}, "stream": True}, "stream"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 5000}}, "maximum context length"),
])
def test_bad_generate_bodies_are_400(standin: UvicornThread, body, fragment) -> None:
    r = _generate(standin, body)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
