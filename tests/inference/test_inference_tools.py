"""Tools on the CPU server, over real HTTP: `tools` rendered into the prompt (chat completions
and /tokenize alike), tool calls the model writes returned as OpenAI `tool_calls` (as `vllm
serve --tool-call-parser hermes` returns them), and a 400 for what the server cannot do.

The tiny model never writes a tool call on its own, so `caller_model` is the tiny model trained
(a second, on CPU) to answer one question with one: generation, parsing and the response are
then all the server's own."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from services.inference import protocol as P
from services.inference.sequences import Output, VersionSpan
from services.inference.testing import ServerHandle, running_server
from services.inference.tokenizer import TOOL_INSTRUCTION
from shared.toolcalls import format_tool_call

pytestmark = pytest.mark.timeout(120)

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
# The answer `caller_model` learns: some content, then a call.
ANSWER = "Adding.\n" + format_tool_call("add", {"a": 2, "b": 3})


def _tokenize(server: ServerHandle, **body) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_tools_are_rendered_into_the_prompt(server: ServerHandle) -> None:
    without = _tokenize(server, messages=QUESTION)
    with_tools = _tokenize(server, messages=QUESTION, tools=[ADD])
    tok = server.engine.tokenizer
    # The tool block comes first; the conversation after it is rendered as without tools.
    assert with_tools[-len(without):] == without
    block = tok.decode(with_tools[:-len(without)], skip_special_tokens=False)
    assert block.startswith("<|im_start|>system\n" + TOOL_INSTRUCTION + "\n")
    assert '{"name": "add", "description": "Add two integers.", "parameters": ' in block
    # A chat completion renders the same prompt, tool_choice "none" included (as vLLM: the
    # tools are still shown to the model, its answer is just not read for calls).
    for choice in ("auto", "none"):
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "messages": QUESTION, "tools": [ADD], "tool_choice": choice, "max_tokens": 4, "temperature": 0,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["prompt_token_ids"] == with_tools
        assert r.json()["choices"][0]["message"]["tool_calls"] == []  # the untrained model calls nothing


def test_the_openai_sdk_sends_tools(server: ServerHandle) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=30)
    r = client.chat.completions.create(model="tiny", messages=QUESTION, tools=[ADD], max_tokens=3,
                                       extra_body={"return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == _tokenize(server, messages=QUESTION, tools=[ADD])
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, fragment", [
    ({"tools": "add"}, "tools: Input should be a valid list"),
    ({"tools": [ADD, "add"]}, "tools[1] must be an object"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, 'tools[0].type must be "function"'),
    ({"tools": [{"type": "function"}]}, "tools[0].function must be an object"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name must be a non-empty"),
    ({"tools": [ADD, {"type": "function", "function": {"name": 7}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ["a"]}}]},
     "tools[0].function.parameters must be a JSON Schema object"),
    ({"tools": [ADD], "tool_choice": "required"}, 'tool_choice "required" is not supported'),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}},
     "tool_choice naming the function 'add' is not supported"),
    ({"tools": [ADD], "tool_choice": "sometimes"}, 'tool_choice must be "none", "auto"'),
    ({"tool_choice": "auto"}, "tool_choice needs tools"),
])
def test_bad_tools_and_tool_choice_are_400(server: ServerHandle, body, fragment) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]


def test_forced_calls_say_what_to_use_instead(server: ServerHandle) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={"messages": QUESTION, "tools": [ADD], "tool_choice": choice})
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "guided decoding" in message and 'tool_choice "auto"' in message and "vLLM" in message


def test_tokenize_checks_tools_too(server: ServerHandle) -> None:
    r = httpx.post(server.url + "/tokenize", json={"messages": QUESTION, "tools": [{"function": {}}]})
    assert r.status_code == 400 and "tools[0].function.name" in r.json()["error"]["message"]
    # A call in the history that the template cannot write is the request's fault too.
    bad_call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {}}]}
    r = httpx.post(server.url + "/tokenize", json={"messages": QUESTION + [bad_call], "tools": [ADD]})
    assert r.status_code == 400 and "could not apply the chat template" in r.json()["error"]["message"]


def _output(text: str, tok) -> Output:
    ids = tok.encode(text, add_special_tokens=False)
    return Output(token_ids=ids, text=text, logprobs=[-0.5] * len(ids), top_logprobs=None, finish_reason="stop",
                  stop_reason=None, weight_versions=[VersionSpan("0", 0, len(ids))])


@pytest.mark.parametrize("text, content, names", [
    (ANSWER, "Adding.", ["add"]),
    (format_tool_call("add", {"a": 1}) + "\n" + format_tool_call("clock", {}), None, ["add", "clock"]),
    ("no call here", "no call here", []),
    # Not calls: a block that is not JSON makes the answer plain text, as in vLLM's hermes
    # parser; an opening tag without its end (cut off by max_tokens) is text.
    ("Adding.\n<tool_call>\n{not json}\n</tool_call>", "Adding.\n<tool_call>\n{not json}\n</tool_call>", []),
    ("Adding.\n<tool_call>\n{\"name\": \"add\"", "Adding.\n<tool_call>\n{\"name\": \"add\"", []),
])
def test_chat_choice_reads_tool_calls(server: ServerHandle, text, content, names) -> None:
    req = P.ChatCompletionRequest(messages=QUESTION, tools=[ADD])
    choice = P.chat_choice(0, _output(text, server.engine.tokenizer), req, str, parse_tools=True)
    message = choice["message"]
    assert message["content"] == content
    assert [c["function"]["name"] for c in message["tool_calls"]] == names
    assert choice["finish_reason"] == ("tool_calls" if names else "stop")
    # tool_choice "none": the same text is not read.
    unread = P.chat_choice(0, _output(text, server.engine.tokenizer), req, str, parse_tools=False)
    assert unread["message"]["content"] == text and unread["message"]["tool_calls"] == []


@pytest.fixture(scope="module")
def caller_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model trained until its greedy answer to QUESTION with tools [ADD] is ANSWER."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("models") / "caller"
    shutil.copytree(tiny_model, out)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    prompt = tok.apply_chat_template(QUESTION, tools=[ADD], add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    answer_ids = tok.encode(ANSWER + "<|im_end|>", add_special_tokens=False)
    ids = torch.tensor([prompt_ids + answer_ids])
    labels = ids.clone()
    labels[0, :len(prompt_ids)] = -100  # learn the answer only
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(500):
        result = model(ids, labels=labels)
        optimizer.zero_grad()
        result.loss.backward()
        optimizer.step()
        predicted = result.logits[0, len(prompt_ids) - 1:-1].argmax(-1)
        if bool((predicted == ids[0, len(prompt_ids):]).all()) and result.loss.item() < 0.05:
            break
    else:
        raise AssertionError(f"the tiny model did not learn the answer (loss {result.loss.item():.3f})")
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def caller(caller_model: Path) -> Iterator[ServerHandle]:
    with running_server(caller_model, served_model_name="caller") as handle:
        yield handle


def test_a_call_the_model_writes_comes_back_as_tool_calls(caller: ServerHandle) -> None:
    body = {"messages": QUESTION, "tools": [ADD], "temperature": 0, "max_tokens": 120, "n": 2}
    r = httpx.post(caller.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    ids = []
    for choice in choices:
        message = choice["message"]
        assert message["content"] == "Adding."
        [call] = message["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] == "add"
        assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
        assert call["id"].startswith("chatcmpl-tool-")
        ids.append(call["id"])
        assert choice["finish_reason"] == "tool_calls"
    assert len(set(ids)) == len(ids) == 2  # unique within the response

    # tool_choice "none": the same answer, as text.
    r = httpx.post(caller.url + "/v1/chat/completions", json={**body, "n": 1, "tool_choice": "none"}, timeout=60)
    choice = r.json()["choices"][0]
    assert choice["message"] == {**choice["message"], "content": ANSWER, "tool_calls": []}
    assert choice["finish_reason"] == "stop"


def test_the_openai_sdk_reads_the_tool_calls(caller: ServerHandle) -> None:
    client = openai.OpenAI(base_url=caller.base_url, api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="caller", messages=QUESTION, tools=[ADD], temperature=0, max_tokens=120)
    call = r.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
    assert r.choices[0].finish_reason == "tool_calls"
    # The call goes back into the conversation with the tool's answer, and the server renders
    # it as the model wrote it: the prompt of the next turn continues this turn's ids.
    first = _tokenize(caller, messages=QUESTION, tools=[ADD])
    turn = caller.engine.tokenizer.encode(ANSWER + "<|im_end|>\n", add_special_tokens=False)
    history = QUESTION + [r.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    after = _tokenize(caller, messages=history, tools=[ADD])
    assert after[:len(first) + len(turn)] == first + turn


def test_a_streamed_call_is_the_same_call(caller: ServerHandle) -> None:
    """stream=True through the openai SDK: the content before the call as content deltas, the
    call as one `delta.tool_calls` entry, finish_reason "tool_calls", as without streaming."""
    client = openai.OpenAI(base_url=caller.base_url, api_key="unused", max_retries=0, timeout=60)
    kwargs = {"model": "caller", "messages": QUESTION, "tools": [ADD], "temperature": 0, "max_tokens": 120}
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert chunks[0].delta.role == "assistant"
    assert "".join(c.delta.content or "" for c in chunks) == whole.message.content == "Adding."
    calls = [call for c in chunks for call in c.delta.tool_calls or []]
    assert [(c.index, c.type, c.function.name) for c in calls] == [(0, "function", "add")]
    assert json.loads(calls[0].function.arguments) == {"a": 2, "b": 3}
    assert calls[0].id.startswith("chatcmpl-tool-")
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["tool_calls"] == [whole.finish_reason]
    # The SDK's own accumulation of the stream gives the non-streamed message.
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.message.content == "Adding." and final.finish_reason == "tool_calls"
    [call] = final.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
