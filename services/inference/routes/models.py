"""The served model: GET /v1/models, POST /tokenize and POST /detokenize.

* `GET /v1/models` -> `{"object": "list", "data": [{"id", "object": "model", "created",
  "owned_by": "vllm", "root", "parent": null, "max_model_len", "permission": [...]}]}`.
* `POST /tokenize` -> `{"count", "max_model_len", "tokens", "token_strs"}`: the ids of `prompt`,
  or of `messages` rendered by the chat template (with `tools` and `chat_template_kwargs`,
  as a chat completion renders them); `POST /detokenize` -> `{"prompt"}`.
"""

from __future__ import annotations

from fastapi import APIRouter

from services.inference import protocol as P
from services.inference.chat import check_tools, render_chat
from services.inference.deps import EngineDep, Served
from services.inference.engine import RequestError

router = APIRouter(tags=["models"])


@router.get("/v1/models")
async def models(eng: EngineDep, served: Served):
    created = served.created
    return {"object": "list", "data": [{
        "id": served.id, "object": "model", "created": created, "owned_by": "vllm",
        "root": str(eng.model_path), "parent": None, "max_model_len": eng.max_model_len,
        "permission": [{"id": f"modelperm-{created}", "object": "model_permission", "created": created,
                        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                        "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                        "organization": "*", "group": None, "is_blocking": False}],
    }]}


@router.post("/tokenize")
async def tokenize(req: P.TokenizeRequest, eng: EngineDep, served: Served):
    served.check(req.model)
    if req.messages is not None:
        ids = render_chat(eng.tokenizer, req.messages, req.add_generation_prompt,
                          req.continue_final_message, req.chat_template_kwargs, check_tools(req.tools))
    elif req.prompt is not None:
        ids = eng.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        raise RequestError("give either prompt or messages", param="prompt")
    strs = eng.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": eng.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(req: P.DetokenizeRequest, eng: EngineDep, served: Served):
    served.check(req.model)
    bad = [t for t in req.tokens if not 0 <= t < eng.vocab_size]
    if bad:
        raise RequestError(f"token id {bad[0]} is out of vocabulary", param="tokens")
    return {"prompt": eng.tokenizer.decode(req.tokens)}
