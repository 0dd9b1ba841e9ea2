"""POST /v1/completions and POST /v1/chat/completions: generation, in vLLM's OpenAI shapes.

`prompt_logprobs: k` on a completion gives `choices[i].prompt_logprobs` in vLLM's shape
(protocol.py). `stream: true` sends the same answer as server-sent events once it is generated
(streaming.py). No `echo`. A `model` naming a loaded LoRA adapter is computed with it (and
answered under its name), as in vLLM. A chat request's `tools` go to the chat template; with tool_choice
"auto" (the default with tools) the answers are read for Hermes tool calls (chat.py,
protocol.tool_call_message), streamed as `delta.tool_calls`.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.inference import protocol as P
from services.inference.chat import check_tools, parses_tool_calls, render_chat
from services.inference.deps import EngineDep, Served
from services.inference.request_error import RequestError
from services.inference.routes.common import (
    json_answer,
    text_decoder,
    token_pieces,
    unless_disconnected,
)
from services.inference.streaming import chat_chunks, completion_chunks, event_stream

router = APIRouter(tags=["completions"])


@router.post("/v1/completions")
async def completions(req: P.CompletionRequest, request: Request, eng: EngineDep, served: Served):
    adapter = served.resolve(req.model, eng.adapters)
    P.check_stream_options(req.stream, req.stream_options)
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
        return await asyncio.gather(*(eng.generate(ids, sp, req.n, adapter) for ids, sp in zip(prompts, params)))

    result = await unless_disconnected(request, run())
    if isinstance(result, Response):
        return result
    piece = token_pieces(eng.tokenizer, eng.pieces)
    choices, completion_tokens = [], 0
    for i, (ids, outs) in enumerate(zip(prompts, result)):
        for j, out in enumerate(outs):
            choices.append(P.completion_choice(i * req.n + j, out, ids, req, piece))
            completion_tokens += len(out.token_ids)
    prompt_tokens = sum(len(ids) for ids in prompts)
    response = P.completion_response(adapter.name if adapter else served.id, choices, prompt_tokens,
                                     completion_tokens)
    if not req.stream:
        return json_answer(response)
    outs = [out for outs in result for out in outs]
    lens = [len(ids) for ids, outs in zip(prompts, result) for _ in outs]
    decode = text_decoder(eng.tokenizer, req.skip_special_tokens)
    return event_stream(completion_chunks(response, outs, lens, req, decode))


@router.post("/v1/chat/completions")
async def chat_completions(req: P.ChatCompletionRequest, request: Request, eng: EngineDep, served: Served):
    adapter = served.resolve(req.model, eng.adapters)
    P.check_stream_options(req.stream, req.stream_options)
    tools = check_tools(req.tools)
    parse_tools = parses_tool_calls(tools, req.tool_choice)
    ids = render_chat(eng.tokenizer, req.messages, req.add_generation_prompt,
                      req.continue_final_message, req.chat_template_kwargs, tools)
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = limit if limit is not None else eng.max_model_len - len(ids)
    top = (req.top_logprobs or 0) if req.logprobs else None
    sp = req.sampling(max_tokens, top)
    eng.validate(ids, sp)
    outs = await unless_disconnected(request, eng.generate(ids, sp, req.n, adapter))
    if isinstance(outs, Response):
        return outs
    piece = token_pieces(eng.tokenizer, eng.pieces)
    choices = [P.chat_choice(j, out, req, piece, parse_tools) for j, out in enumerate(outs)]
    response = P.chat_response(adapter.name if adapter else served.id, choices, outs, ids, req)
    if not req.stream:
        return json_answer(response)
    return event_stream(chat_chunks(response, outs, req, text_decoder(eng.tokenizer, req.skip_special_tokens)))
