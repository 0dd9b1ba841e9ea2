"""POST /inference/v1/generate, vLLM's token-in/token-out endpoint: the request model, its
checks, and the response and stream chunks in vLLM 0.33's shapes
(vllm/entrypoints/scale_out/token_in_token_out/{protocol,serving}.py).

Request: `{"token_ids": [...] (at least one), "sampling_params": {n, temperature, top_p, top_k,
min_p, seed, max_tokens, min_tokens, stop, stop_token_ids, ignore_eos, logprobs (int k),
prompt_logprobs, include_stop_str_in_output, skip_special_tokens, ...}, "model", "request_id",
"stream", "stream_options", "output_mode": "tokens" | "text", "cache_salt", "priority",
"return_token_ids"}`. Unknown fields, in the request or its sampling_params, are ignored, as on
/v1/completions (vLLM ignores unknown sampling params too).

Response: `{request_id: "generate-tokens-<id>", model, created, usage, prompt_logprobs,
prompt_token_id_logprobs, prompt_token_ids, mm_placeholders, metrics, kv_transfer_params,
ec_transfer_params, output_mode, choices: [{index, finish_reason, stop_reason, token_ids,
routed_experts, sampling_mask, weight_versions, logprobs (+ text in text mode)}]}`.

Tokens-mode logprobs are `{"content": [{"token_id", "logprob", "rank", "top_logprobs":
[{"token_id", "logprob", "rank"}, ...], "token": "token_id:<id>"}, ...]}`, one entry per output
token, `top_logprobs` the sampled token first, then the top k without it (vLLM 0.33's order).
`token` is not in vLLM's tokens mode: the `renderers` package (verifiers' TrainClient) checks
`entry["token"] == f"token_id:{id}"`, the placeholder vLLM writes without a tokenizer. The
sampled token's logprob is always its real, finite one (vLLM writes -9999.0 for a missing one;
here the engine always has it). `rank` is known when the sampled token is among the top k, or
is the greedy argmax; otherwise null (the engine does not rank the whole vocabulary).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.inference import protocol as P
from services.inference.sequences import Output, SamplingParams
from services.inference.request_error import RequestError
from services.inference.streaming import text_deltas

# vLLM's validate_cache_salt: the salt becomes part of cache keys.
_CACHE_SALT_MAX = 128
_CACHE_SALT_FORBIDDEN = ("@", "/", "\\", "\0")


class GenerateSamplingParams(BaseModel):
    """The sampling_params fields the CPU engine implements, with vLLM SamplingParams' defaults."""

    model_config = ConfigDict(extra="ignore")

    n: int = Field(default=1, ge=1, le=256)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = None
    # None: up to the end of the context, vLLM's server-side default for a missing max_tokens.
    max_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True

    def engine(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k if self.top_k > 0 else 0, min_p=self.min_p, seed=self.seed,
            stop=tuple(s for s in stop if s), stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, logprobs=self.logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, prompt_logprobs=self.prompt_logprobs,
        )


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    token_ids: list[int] = Field(min_length=1)
    sampling_params: GenerateSamplingParams
    model: str | None = None
    request_id: str | None = None
    stream: bool | None = False
    stream_options: P.StreamOptions | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    cache_salt: str | None = None
    # Accepted and ignored, as vLLM's default first-come-first-served scheduler does.
    priority: int = 0
    return_token_ids: bool | None = None
    # Multimodal inputs: refused (check below), never silently dropped.
    features: Any = None
    content_parts: Any = None

    @field_validator("token_ids")
    @classmethod
    def _non_negative(cls, ids: list[int]) -> list[int]:
        bad = next((i for i, t in enumerate(ids) if t < 0), None)
        if bad is not None:
            raise ValueError(f"token_ids must not contain negative values (token_ids[{bad}] = {ids[bad]})")
        return ids


def check(req: GenerateRequest, vocab_size: int, max_model_len: int) -> SamplingParams:
    """The engine's sampling params for `req`, or the 400 that says what to fix."""
    P.check_stream_options(req.stream, req.stream_options)
    if req.features is not None or req.content_parts is not None:
        raise RequestError("multimodal inputs (features, content_parts) are not supported by the CPU inference "
                           "server: send text-only token_ids", param="features")
    salt = req.cache_salt
    if salt is not None and (not salt or len(salt) > _CACHE_SALT_MAX or any(c in salt for c in _CACHE_SALT_FORBIDDEN)):
        raise RequestError(f"Parameter 'cache_salt' must be a non-empty string of at most {_CACHE_SALT_MAX} "
                           "characters without '@', '/', '\\\\' or NUL.", param="cache_salt")
    sp = req.sampling_params
    if req.output_mode == "text" and not sp.detokenize:
        raise RequestError("output_mode='text' requires sampling_params.detokenize to be true", param="output_mode")
    ids = req.token_ids
    bad = next((i for i, t in enumerate(ids) if t >= vocab_size), None)
    if bad is not None:
        raise RequestError(f"token_ids[{bad}] = {ids[bad]} is out of vocabulary (vocab size {vocab_size})",
                           param="token_ids")
    n, limit = len(ids), max_model_len
    if n >= limit:
        raise RequestError(f"token_ids has {n} tokens; this model's maximum context length is {limit} tokens, "
                           f"which leaves no room to generate: send at most {limit - 1}", param="token_ids")
    if sp.max_tokens is not None and n + sp.max_tokens > limit:
        raise RequestError(f"sampling_params.max_tokens is {sp.max_tokens}, but this model's maximum context length "
                           f"is {limit} tokens and token_ids has {n}: send max_tokens <= {limit - n}, or leave it "
                           "out to generate up to the end of the context", param="sampling_params.max_tokens")
    return sp.engine(sp.max_tokens if sp.max_tokens is not None else limit - n)


def _entry(token: int, logprob: float, rank: int | None) -> dict[str, Any]:
    return {"token_id": token, "logprob": logprob, "rank": rank}


def token_logprobs(out: Output, j: int, greedy: bool) -> dict[str, Any]:
    """Output token j's tokens-mode logprobs entry."""
    token, logprob = out.token_ids[j], out.logprobs[j]
    if not math.isfinite(logprob):
        # Never a sentinel: a sampled token has a real logprob, so this is an engine fault.
        raise RuntimeError(f"the engine gave output token {j} (id {token}) the logprob {logprob}")
    top = out.top_logprobs[j] if out.top_logprobs else []
    rank = next((r for r, (t, _) in enumerate(top, start=1) if t == token), 1 if greedy else None)
    candidates = [_entry(token, logprob, rank)]
    candidates += [_entry(t, P.finite(lp), r) for r, (t, lp) in enumerate(top, start=1) if t != token]
    return {**_entry(token, logprob, rank), "top_logprobs": candidates, "token": f"token_id:{token}"}


def _text_logprobs(entry: dict[str, Any], piece) -> dict[str, Any]:
    """The text-mode (OpenAI chat) shape of a tokens-mode entry: decoded tokens and their bytes."""
    def text(e: dict[str, Any]) -> dict[str, Any]:
        s = piece(e["token_id"])
        return {"token": s, "logprob": e["logprob"], "bytes": list(s.encode())}

    return {**text(entry), "top_logprobs": [text(e) for e in entry["top_logprobs"]]}


def choice(index: int, out: Output, req: GenerateRequest, piece) -> dict[str, Any]:
    logprobs = None
    if req.sampling_params.logprobs is not None:
        greedy = req.sampling_params.temperature == 0
        content = [token_logprobs(out, j, greedy) for j in range(len(out.token_ids))]
        if req.output_mode == "text":
            content = [_text_logprobs(e, piece) for e in content]
        logprobs = {"content": content}
    body: dict[str, Any] = {
        "index": index,
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
        "token_ids": list(out.token_ids),
        "routed_experts": None,
        "sampling_mask": None,
        # Always: vLLM's generate answers them without being asked.
        "weight_versions": [s.as_dict() for s in out.weight_versions],
    }
    if req.output_mode == "text":
        body["text"] = out.text
    body["logprobs"] = logprobs
    return body


def response(request_id: str, model: str, outs: list[Output], req: GenerateRequest, piece) -> dict[str, Any]:
    completion_tokens = sum(len(o.token_ids) for o in outs)
    return {
        "request_id": request_id,
        "model": model,
        "created": int(time.time()),
        "usage": {**P.usage_json(len(req.token_ids), completion_tokens), "completion_tokens_details": None},
        "prompt_logprobs": P.prompt_logprobs_json(outs[0], piece) if outs else None,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": list(req.token_ids) if req.return_token_ids else None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": req.output_mode,
        "choices": [choice(j, out, req, piece) for j, out in enumerate(outs)],
    }


def stream_chunks(body: dict[str, Any], outs: list[Output], req: GenerateRequest, decode
                  ) -> Iterator[dict[str, Any]]:
    """vLLM's generate stream, cut from the finished `body`: per choice one chunk per token
    (`token_ids: [id]`, that token's logprobs, the text delta in text mode), the last one with
    `finish_reason`, `stop_reason` and `weight_versions`; `prompt_token_ids` on the first chunk
    with return_token_ids; then the usage chunk with stream_options.include_usage."""
    options = req.stream_options
    every = bool(options and options.continuous_usage_stats)
    prompt_tokens = len(req.token_ids)
    first = True
    for ch, out in zip(body["choices"], outs):
        n = len(out.token_ids)
        texts = text_deltas(out.token_ids, out.text, decode) if req.output_mode == "text" else None
        logprobs = (ch["logprobs"] or {}).get("content")
        # A choice with no tokens (aborted at once) still sends its finish reason.
        for i in range(max(n, 1)):
            last = i >= n - 1
            delta: dict[str, Any] = {
                "index": ch["index"], "finish_reason": ch["finish_reason"] if last else None,
                "stop_reason": ch["stop_reason"] if last else None, "token_ids": out.token_ids[i:i + 1],
                "routed_experts": None, "sampling_mask": None,
                "weight_versions": ch["weight_versions"] if last else None,
            }
            if texts is not None:
                delta["text"] = texts[i] if n else ""
            delta["logprobs"] = {"content": logprobs[i:i + 1]} if logprobs is not None else None
            event: dict[str, Any] = {"request_id": body["request_id"],
                                     "usage": P.usage_json(prompt_tokens, min(i + 1, n)) if every else None}
            if first and req.return_token_ids:
                event["prompt_token_ids"] = list(req.token_ids)
            first = False
            event.update({"output_mode": req.output_mode, "choices": [delta]})
            yield event
    if options and options.include_usage:
        usage = {k: v for k, v in body["usage"].items() if v is not None}
        yield {"request_id": body["request_id"], "usage": usage, "output_mode": req.output_mode, "choices": []}
