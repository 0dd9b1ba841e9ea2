"""POST /v1/completions and POST /v1/chat/completions: generation, in vLLM's OpenAI shapes.

`prompt_logprobs: k` on a completion gives `choices[i].prompt_logprobs` in vLLM's shape
(protocol.py). No streaming (`stream: true` is a 400) and no `echo`. A chat request's `tools`
go to the chat template; with tool_choice "auto" (the default with tools) the answers are read
for Hermes tool calls (chat.py, protocol.tool_call_message).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.inference import protocol as P
from services.inference.chat import check_tools, parses_tool_calls, render_chat
from services.inference.deps import EngineDep, Served
from services.inference.engine import RequestError

router = APIRouter(tags=["completions"])

DISCONNECT_POLL_S = 1.0


def _unsupported(req: P._Request) -> None:
    if req.stream:
        raise RequestError("stream=true is not supported by the CPU inference server", param="stream")


async def _unless_disconnected(request: Request, coro) -> Any:
    """Run `coro`; cancel it (aborting its sequences) if the client goes away meanwhile."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                return Response(status_code=499)
    finally:
        if not task.done():
            task.cancel()


def _piece(tokenizer):
    cache: dict[int, str] = {}

    def piece(token_id: int) -> str:
        if token_id not in cache:
            cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
        return cache[token_id]

    return piece


@router.post("/v1/completions")
async def completions(req: P.CompletionRequest, request: Request, eng: EngineDep, served: Served):
    served.check(req.model)
    _unsupported(req)
    if req.echo:
        raise RequestError("echo=true is not supported by the CPU inference server", param="echo")
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts = [eng.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]  # type: ignore[arg-type]
    elif prompt:
        prompts = [eng.tokenizer.encode(p, add_special_tokens=req.add_special_tokens) if isinstance(p, str)
                   else list(p) for p in prompt]
    else:
        raise RequestError("prompt is empty", param="prompt")
    params = []
    for ids in prompts:
        max_tokens = req.max_tokens if req.max_tokens is not None else eng.max_model_len - len(ids)
        sp = req.sampling(max_tokens, req.logprobs)
        eng.validate(ids, sp)
        params.append(sp)

    async def run():
        return await asyncio.gather(*(eng.generate(ids, sp, req.n) for ids, sp in zip(prompts, params)))

    result = await _unless_disconnected(request, run())
    if isinstance(result, Response):
        return result
    piece = _piece(eng.tokenizer)
    choices, completion_tokens = [], 0
    for i, (ids, outs) in enumerate(zip(prompts, result)):
        for j, out in enumerate(outs):
            choices.append(P.completion_choice(i * req.n + j, out, ids, req, piece))
            completion_tokens += len(out.token_ids)
    prompt_tokens = sum(len(ids) for ids in prompts)
    return P.completion_response(served.id, choices, prompt_tokens, completion_tokens)


@router.post("/v1/chat/completions")
async def chat_completions(req: P.ChatCompletionRequest, request: Request, eng: EngineDep, served: Served):
    served.check(req.model)
    _unsupported(req)
    tools = check_tools(req.tools)
    parse_tools = parses_tool_calls(tools, req.tool_choice)
    ids = render_chat(eng.tokenizer, req.messages, req.add_generation_prompt,
                      req.continue_final_message, req.chat_template_kwargs, tools)
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = limit if limit is not None else eng.max_model_len - len(ids)
    top = (req.top_logprobs or 0) if req.logprobs else None
    sp = req.sampling(max_tokens, top)
    eng.validate(ids, sp)
    outs = await _unless_disconnected(request, eng.generate(ids, sp, req.n))
    if isinstance(outs, Response):
        return outs
    piece = _piece(eng.tokenizer)
    choices = [P.chat_choice(j, out, req, piece, parse_tools) for j, out in enumerate(outs)]
    return P.chat_response(served.id, choices, outs, ids, req)
