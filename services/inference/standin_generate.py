"""The stand-in's POST /inference/v1/generate (standin.py): vLLM's token-in/token-out request
turned into the stand-in's own completion request, and the completion turned back into
vLLM's generate response (tokens mode, the shape services/inference/generate.py documents,
`token: "token_id:<id>"` included).

The stand-in has no vocabulary beyond bytes and no model: it answers the request's
`n`, `max_tokens` (default: up to its max_model_len), `temperature`, `seed`, `stop_token_ids`
(the answer is cut after the first one, finish_reason "stop", stop_reason the id),
`logprobs` and `return_token_ids`; other sampling params are ignored. `stream` and
`output_mode: "text"` are a 400 here (the CPU server has both).
"""

from __future__ import annotations

from typing import Any


def completion_body(body: dict[str, Any], max_model_len: int) -> dict[str, Any] | str:
    """The stand-in completion request for a generate `body`, or what is wrong with it."""
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
        return "token_ids must be a non-empty list of non-negative integers"
    sp = body.get("sampling_params")
    if not isinstance(sp, dict):
        return "sampling_params must be an object"
    if body.get("stream"):
        return "the stand-in does not stream /inference/v1/generate; send stream: false"
    if body.get("output_mode", "tokens") != "tokens":
        return "the stand-in answers output_mode 'tokens' only"
    max_tokens = sp.get("max_tokens")
    return {"prompt": ids, "n": sp.get("n", 1), "temperature": sp.get("temperature", 1.0), "seed": sp.get("seed"),
            "max_tokens": max_model_len - len(ids) if max_tokens is None else max_tokens,
            "return_token_ids": True, "return_weight_versions": True}


def _choice(choice: dict[str, Any], sp: dict[str, Any]) -> dict[str, Any]:
    ids = list(choice["token_ids"])
    logprobs = list(choice["logprobs"]["token_logprobs"])
    finish, stop_reason = choice["finish_reason"], None
    stops = set(sp.get("stop_token_ids") or ())
    cut = next((i for i, t in enumerate(ids) if t in stops), None)
    spans = choice["weight_versions"]
    if cut is not None:
        ids, logprobs, finish, stop_reason = ids[:cut + 1], logprobs[:cut + 1], "stop", ids[cut]
        spans = [{**s, "end": min(s["end"], cut + 1)} for s in spans if s["start"] <= cut]
    content = None
    if sp.get("logprobs") is not None:
        content = [{"token_id": t, "logprob": lp, "rank": None,
                    "top_logprobs": [{"token_id": t, "logprob": lp, "rank": None}], "token": f"token_id:{t}"}
                   for t, lp in zip(ids, logprobs)]
    return {"index": choice["index"], "finish_reason": finish, "stop_reason": stop_reason, "token_ids": ids,
            "routed_experts": None, "sampling_mask": None, "weight_versions": spans,
            "logprobs": {"content": content} if content is not None else None}


def generate_response(completion: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    sp = body["sampling_params"]
    choices = [_choice(c, sp) for c in completion["choices"]]
    prompt_tokens = len(body["token_ids"])
    generated = sum(len(c["token_ids"]) for c in choices)
    return {
        "request_id": f"generate-tokens-{body.get('request_id') or completion['id']}",
        "model": completion["model"], "created": completion["created"],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + generated,
                  "completion_tokens": generated},
        "prompt_token_ids": list(body["token_ids"]) if body.get("return_token_ids") else None,
        "output_mode": "tokens", "choices": choices,
    }
