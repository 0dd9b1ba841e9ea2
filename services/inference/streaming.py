"""`stream: true` as vLLM sends it: `text/event-stream`, one `data: <JSON>\\n\\n` event per chunk,
then `data: [DONE]\\n\\n`.

The engine hands back whole outputs (engine.py has no per-token callback), so a stream is
cut from the finished response: the client gets the same chunks vLLM would send, one per
token, after generation rather than during it. Building the chunks from the non-streaming
response (protocol.py) keeps the two paths equal by construction: the streamed text, logprobs,
tool calls and finish reasons are those of the non-streamed answer for the same seed.

* chat (`chat.completion.chunk`): per choice a first chunk `delta: {"role": "assistant",
  "content": ""}`, then one chunk per token (`delta.content`, `logprobs.content` of that token,
  `token_ids` with return_token_ids; a token that adds no visible text sends `delta: {}`, or
  nothing when it carries neither logprobs nor ids), then per tool call one chunk
  `delta.tool_calls: [{index, id, type, function: {name, arguments}}]`, then a last chunk with
  `finish_reason`, `stop_reason` (and `weight_versions` when asked).
* completion (`text_completion`): one chunk per token (`text`, that token's `logprobs`,
  `token_ids`, `prompt_token_ids` on the choice's first chunk), then a last chunk with
  `finish_reason`.
* `stream_options.include_usage`: a last chunk with `choices: []` and the request's `usage`;
  `continuous_usage_stats`: every chunk carries the usage so far of its choice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import orjson
from fastapi.responses import StreamingResponse

from services.inference import protocol as P
from services.inference.sequences import Output

DONE = b"data: [DONE]\n\n"

Decode = Callable[[list[int]], str]


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


def event_stream(events: Iterable[dict[str, Any]]) -> StreamingResponse:
    async def body():
        for event in events:
            yield sse(event)
        yield DONE

    return StreamingResponse(body(), media_type="text/event-stream")


def text_deltas(token_ids: list[int], text: str, decode: Decode) -> list[str]:
    """One text delta per token whose concatenation is exactly `text` (the answer's final text,
    which a stop string may have cut, or a tool call's content), decoding growing prefixes as
    vLLM's incremental detokenizer does. A prefix ending in U+FFFD (half a UTF-8 character)
    waits for the next token; only characters that agree with `text` are sent; the last token
    sends whatever is left."""
    deltas: list[str] = []
    sent = 0
    for i in range(len(token_ids)):
        if i == len(token_ids) - 1:
            deltas.append(text[sent:])
            break
        prefix = decode(token_ids[: i + 1])
        end = sent
        if not prefix.endswith("\ufffd"):
            limit = min(len(prefix), len(text))
            while end < limit and prefix[end] == text[end]:
                end += 1
        deltas.append(text[sent:end])
        sent = end
    return deltas


def _usage_each(options: P.StreamOptions | None) -> bool:
    return bool(options and options.continuous_usage_stats)


def _final_usage(head: dict[str, Any], response: dict[str, Any], options: P.StreamOptions | None
                 ) -> Iterator[dict[str, Any]]:
    if options and options.include_usage:
        usage = {k: v for k, v in response["usage"].items() if v is not None}
        yield {**head, "choices": [], "usage": usage}


def chat_chunks(response: dict[str, Any], outs: list[Output], req: P.ChatCompletionRequest,
                decode: Decode) -> Iterator[dict[str, Any]]:
    """The chunks of a finished chat completion (`response`, protocol.chat_response)."""
    head = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"]}
    prompt_tokens = response["usage"]["prompt_tokens"]
    every = _usage_each(req.stream_options)

    def chunk(choice: dict[str, Any], generated: int) -> dict[str, Any]:
        event = {**head, "choices": [choice]}
        if every:
            event["usage"] = P.usage_json(prompt_tokens, generated)
        return event

    for j in range(len(outs)):
        first = chunk({"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None}, 0)
        if j == 0 and req.return_token_ids:
            first["prompt_token_ids"] = response["prompt_token_ids"]
        yield first
    for j, (choice, out) in enumerate(zip(response["choices"], outs)):
        message = choice["message"]
        logprobs = (choice["logprobs"] or {}).get("content")
        # With tool calls, `content` is the text before the first call: the call's own tokens
        # add no text, as with vLLM's hermes parser.
        pieces = text_deltas(out.token_ids, message["content"] or "", decode)
        for i, (token, piece) in enumerate(zip(out.token_ids, pieces)):
            if not piece and logprobs is None and not req.return_token_ids:
                continue
            delta = {"index": j, "delta": {"content": piece} if piece else {},
                     "logprobs": {"content": [logprobs[i]]} if logprobs is not None else None,
                     "finish_reason": None}
            if req.return_token_ids:
                delta["token_ids"] = [token]
            yield chunk(delta, i + 1)
        n = len(out.token_ids)
        for k, call in enumerate(message["tool_calls"]):
            yield chunk({"index": j, "delta": {"tool_calls": [{"index": k, **call}]}, "logprobs": None,
                         "finish_reason": None}, n)
        last = {"index": j, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"],
                "stop_reason": choice["stop_reason"]}
        if "weight_versions" in choice:
            last["weight_versions"] = choice["weight_versions"]
        yield chunk(last, n)
    yield from _final_usage(head, response, req.stream_options)


_LOGPROB_LISTS = ("text_offset", "token_logprobs", "tokens", "top_logprobs")


def completion_chunks(response: dict[str, Any], outs: list[Output], prompt_lens: list[int],
                      req: P.CompletionRequest, decode: Decode) -> Iterator[dict[str, Any]]:
    """The chunks of a finished completion (`response`, protocol.completion_response); `outs`
    and `prompt_lens` (the prompt length of each choice) in the order of its choices."""
    head = {"id": response["id"], "object": "text_completion", "created": response["created"],
            "model": response["model"]}
    every = _usage_each(req.stream_options)
    for choice, out, prompt_len in zip(response["choices"], outs, prompt_lens):
        logprobs = choice["logprobs"]
        pieces = text_deltas(out.token_ids, choice["text"], decode)
        events = []
        for i, (token, piece) in enumerate(zip(out.token_ids, pieces)):
            events.append({"index": choice["index"], "text": piece,
                           "logprobs": {k: logprobs[k][i:i + 1] for k in _LOGPROB_LISTS} if logprobs else None,
                           "finish_reason": None, "stop_reason": None})
            if req.return_token_ids:
                events[-1]["token_ids"] = [token]
        last = {"index": choice["index"], "text": "", "logprobs": None, "finish_reason": choice["finish_reason"],
                "stop_reason": choice["stop_reason"]}
        if "weight_versions" in choice:
            last["weight_versions"] = choice["weight_versions"]
        events.append(last)
        if req.return_token_ids:
            events[0]["prompt_token_ids"] = choice["prompt_token_ids"]
        for i, event in enumerate(events):
            out_event = {**head, "choices": [event]}
            if every:
                out_event["usage"] = P.usage_json(prompt_len, min(i + 1, len(out.token_ids)))
            yield out_event
    yield from _final_usage(head, response, req.stream_options)
