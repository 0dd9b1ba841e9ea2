"""The served model: GET /v1/models, POST /tokenize and POST /detokenize.

* `GET /v1/models` -> `{"object": "list", "data": [{"id", "object": "model", "created",
  "owned_by": "vllm", "root", "parent": null, "max_model_len", "permission": [...]}, ...]}`: the
  base model, then each loaded LoRA adapter as vLLM lists it (`root` its path, `parent` the base
  model's id, `max_model_len` null).
* `POST /tokenize` -> `{"count", "max_model_len", "tokens", "token_strs"}`: the ids of `prompt`,
  or of `messages` rendered by the chat template (with `tools` and `chat_template_kwargs`,
  as a chat completion renders them); `POST /detokenize` -> `{"prompt"}`.
"""

from __future__ import annotations

from fastapi import APIRouter

from services.inference import protocol as P
from services.inference.chat import check_tools, render_chat
from services.inference.deps import EngineDep, Served
from services.inference.request_error import RequestError

router = APIRouter(tags=["models"])


def _card(model_id: str, created: int, root: str, parent: str | None, max_model_len: int | None):
    return {
        "id": model_id, "object": "model", "created": created, "owned_by": "vllm",
        "root": root, "parent": parent, "max_model_len": max_model_len,
        "permission": [{"id": f"modelperm-{created}", "object": "model_permission", "created": created,
                        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                        "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                        "organization": "*", "group": None, "is_blocking": False}],
    }


@router.get("/v1/models")
async def models(eng: EngineDep, served: Served):
    cards = [_card(served.id, served.created, str(eng.model_path), None, eng.max_model_len)]
    # list(): a load on the model thread may add one meanwhile.
    loaded = list(eng.adapters.loaded.values()) if eng.adapters is not None else []
    cards += [_card(a.name, a.created, a.path, served.id, None) for a in loaded]
    return {"object": "list", "data": cards}


@router.post("/tokenize")
async def tokenize(req: P.TokenizeRequest, eng: EngineDep, served: Served):
    served.resolve(req.model, eng.adapters)  # an adapter shares the base model's tokenizer
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
    served.resolve(req.model, eng.adapters)  # an adapter shares the base model's tokenizer
    bad = [t for t in req.tokens if not 0 <= t < eng.vocab_size]
    if bad:
        raise RequestError(f"token id {bad[0]} is out of vocabulary", param="tokens")
    return {"prompt": eng.tokenizer.decode(req.tokens)}
