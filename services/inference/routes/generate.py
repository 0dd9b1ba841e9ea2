"""POST /inference/v1/generate: vLLM's token-in/token-out endpoint (shapes in generate.py).

The prompt's token ids go to the engine as they are, through the same `Engine.generate` as
/v1/completions, so pausing (abort / wait / keep), weight reloads and version labels act on it
exactly as on a completion. `X-Request-Id` (else `request_id`, else a random id) names the
response `generate-tokens-<id>`, as in vLLM; `X-Session-ID` is accepted and ignored, as on
/v1/completions.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.inference import generate as G
from services.inference.deps import EngineDep, Served
from services.inference.routes.common import json_answer, text_decoder, token_pieces, unless_disconnected
from services.inference.streaming import event_stream

router = APIRouter(tags=["generate"])


@router.post("/inference/v1/generate")
async def generate(req: G.GenerateRequest, request: Request, eng: EngineDep, served: Served):
    adapter = served.resolve(req.model, eng.adapters)
    params = G.check(req, eng.vocab_size, eng.max_model_len)
    eng.validate(req.token_ids, params)  # what the engine checks itself (stop_token_ids, ...)
    outs = await unless_disconnected(request, eng.generate(req.token_ids, params, req.sampling_params.n, adapter))
    if isinstance(outs, Response):
        return outs
    request_id = request.headers.get("x-request-id") or req.request_id or uuid.uuid4().hex
    model = adapter.name if adapter else served.id
    body = G.response(f"generate-tokens-{request_id}", model, outs, req, token_pieces(eng.tokenizer, eng.pieces))
    if not req.stream:
        return json_answer(body)
    decode = text_decoder(eng.tokenizer, req.sampling_params.skip_special_tokens)
    return event_stream(G.stream_chunks(body, outs, req, decode))
