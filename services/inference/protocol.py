"""Request models and response builders for the OpenAI-compatible endpoints, in vLLM 0.33's
JSON shapes (what `vllm serve` returns for the same request).

Requests accept the OpenAI fields plus vLLM's extras Tandem uses (`return_token_ids`,
`return_weight_versions`, `ignore_eos`, `top_k`, `min_p`, `min_tokens`, `stop_token_ids`, ...); unknown
fields are ignored, as vLLM does. `stream: true` (with `stream_options`) sends the response below
as chunks (streaming.py). Responses:

* completion choice: `index, text, logprobs {tokens, token_logprobs, top_logprobs, text_offset} | null,
  finish_reason, stop_reason, prompt_logprobs, token_ids, prompt_token_ids`
  (+ `weight_versions` only when requested). With `prompt_logprobs: k` in the request,
  `prompt_logprobs` is `[null, {"<token id>": {"logprob", "rank", "decoded_token"}, ...}, ...]`:
  one dict per prompt position after the first, keyed by the token id as a string, holding the
  prompt token itself first and then the top k (k + 1 entries, k when the prompt token is
  among the top k), exactly as vLLM 0.32 writes it.
* chat choice: `index, message {role, content, reasoning_content, tool_calls}, logprobs {content:
  [{token, logprob, bytes, top_logprobs}]} | null, finish_reason, stop_reason, token_ids`; the
  prompt's ids are top-level `prompt_token_ids`. With tools and tool_choice "auto", an answer
  holding Hermes tool-call blocks has `tool_calls` `[{id, type: "function", function: {name,
  arguments (a JSON string)}}]`, `content` the text before the first call (null when empty) and
  finish_reason "tool_calls", as `vllm serve --tool-call-parser hermes` answers.
* errors: `{"error": {"message", "type", "param", "code"}}` with `code` the HTTP status.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.inference.sequences import Output, SamplingParams
from services.inference.request_error import RequestError
from services.inference.tokenizer import message_text
from shared.toolcalls import parse_tool_calls

# JSON has no -inf; vLLM writes masked logprobs as -9999.0.
NEG_INF_LOGPROB = -9999.0


class StreamOptions(BaseModel):
    """vLLM's `stream_options`: a last chunk with the whole request's usage (`include_usage`),
    and/or each chunk's usage so far (`continuous_usage_stats`)."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


def check_stream_options(stream: bool | None, options: StreamOptions | None) -> None:
    if options is not None and not stream:
        # vLLM's own 400: options for a stream that will not be sent are a mistake in the request.
        raise RequestError("Stream options can only be defined when `stream=True`.", param="stream_options")


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(default=1, ge=1, le=256)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool | None = False
    return_weight_versions: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    def sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            # `--generation-config vllm`: the model's generation_config.json does not set defaults.
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k if self.top_k and self.top_k > 0 else 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=tuple(s for s in stop if s),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            prompt_logprobs=getattr(self, "prompt_logprobs", None),
        )


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    # vLLM also takes -1 (the whole vocabulary); the probe and the trainer never need it.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    add_special_tokens: bool = True


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        return message_text(self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Checked by chat.check_tools / chat.parses_tool_calls, whose 400s name the bad entry.
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class LoadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False  # vLLM's (MoE adapters); accepted and ignored


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; accepted and ignored


class UpdateWeightVersionRequest(BaseModel):
    new_version: str


class CollectiveRpcRequest(BaseModel):
    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kind = {400: "BadRequestError", 401: "UnauthorizedError", 404: "NotFoundError", 405: "MethodNotAllowed",
            409: "ConflictError", 413: "RequestTooLarge", 422: "UnprocessableEntityError",
            501: "NotImplementedError"}.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def finite(x: float) -> float:
    return max(NEG_INF_LOGPROB, x)


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None}


def _top_dict(out: Output, j: int, piece) -> dict[str, float]:
    # vLLM returns the sampled token together with the top-k, so the dict can hold k + 1 entries.
    entries = dict(out.top_logprobs[j]) if out.top_logprobs else {}
    entries.setdefault(out.token_ids[j], out.logprobs[j])
    return {piece(t): finite(lp) for t, lp in entries.items()}


def prompt_logprobs_json(out: Output, piece) -> list[dict[str, dict[str, Any]] | None] | None:
    return None if out.prompt_logprobs is None else prompt_logprobs_rows(out.prompt_logprobs, piece)


def prompt_logprobs_rows(prompt_logprobs: list, piece) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` shape of the engine's PromptLogprobs (null for the first token)."""
    rows: list[dict[str, dict[str, Any]] | None] = [None]
    for entries in prompt_logprobs:
        rows.append({str(tid): {"logprob": finite(lp), "rank": rank, "decoded_token": piece(tid)}
                     for tid, lp, rank in entries})
    return rows


def completion_choice(index: int, out: Output, prompt_ids: list[int], req: CompletionRequest, piece) -> dict[str, Any]:
    logprobs = None
    if req.logprobs is not None:
        tokens = [piece(t) for t in out.token_ids]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        token_logprobs = [finite(lp) for lp in out.logprobs]
        if any(out.top_logprobs or ()):
            top = [_top_dict(out, j, piece) for j in range(len(out.token_ids))]
        else:  # logprobs=0 (what the sampler asks): each position's dict is the sampled token alone
            top = [{t: lp} for t, lp in zip(tokens, token_logprobs)]
        logprobs = {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}
    choice: dict[str, Any] = {
        "index": index,
        "text": out.text,
        "logprobs": logprobs,
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
        "prompt_logprobs": prompt_logprobs_json(out, piece),
        "prompt_token_ids": list(prompt_ids) if req.return_token_ids else None,
        "token_ids": out.token_ids if req.return_token_ids else None,
    }
    if req.return_weight_versions:
        choice["weight_versions"] = [s.as_dict() for s in out.weight_versions]
    return choice


def completion_response(
    model: str, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_json(prompt_tokens, completion_tokens),
        "kv_transfer_params": None,
    }


def tool_call_message(text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
    """(content, tool_calls) of an answer that calls tools, None for one that does not, as vLLM's
    `hermes` tool parser reads it: content is the text before the first call (null when empty);
    each call gets an id unique to it. A block that is not a valid call makes the whole answer
    plain text, as in vLLM (the caller still sees what the model wrote)."""
    content, calls = parse_tool_calls(text)
    if not calls or any(call.error for call in calls):
        return None
    for call in calls:
        call.id = f"chatcmpl-tool-{uuid.uuid4().hex}"
    return content or None, [call.openai() for call in calls]


def chat_choice(index: int, out: Output, req: ChatCompletionRequest, piece, parse_tools: bool = False
                ) -> dict[str, Any]:
    logprobs = None
    if req.logprobs:
        content = []
        for j, t in enumerate(out.token_ids):
            tok = piece(t)
            top = []
            if req.top_logprobs and out.top_logprobs:
                top = [{"token": piece(i), "logprob": finite(lp), "bytes": list(piece(i).encode())}
                       for i, lp in out.top_logprobs[j]]
            content.append({"token": tok, "logprob": finite(out.logprobs[j]), "bytes": list(tok.encode()),
                            "top_logprobs": top})
        logprobs = {"content": content}
    content, tool_calls, finish_reason = out.text, [], out.finish_reason
    called = tool_call_message(out.text) if parse_tools else None
    if called is not None:
        content, tool_calls = called
        finish_reason = "tool_calls"  # as vLLM, whatever ended the generation
    choice: dict[str, Any] = {
        "index": index,
        "message": {"role": "assistant", "content": content, "refusal": None, "annotations": None,
                    "audio": None, "function_call": None, "tool_calls": tool_calls, "reasoning_content": None},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": out.stop_reason,
        "token_ids": out.token_ids if req.return_token_ids else None,
    }
    if req.return_weight_versions:
        choice["weight_versions"] = [s.as_dict() for s in out.weight_versions]
    return choice


def chat_response(model: str, choices: list[dict[str, Any]], outs: list[Output], prompt_ids: list[int],
                  req: ChatCompletionRequest) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_json(len(prompt_ids), sum(len(o.token_ids) for o in outs)),
        "prompt_logprobs": None,
        "prompt_token_ids": list(prompt_ids) if req.return_token_ids else None,
        "kv_transfer_params": None,
    }


PauseModeParam = Literal["abort", "wait", "keep"]
