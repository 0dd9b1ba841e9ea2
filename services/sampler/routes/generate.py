"""POST /inference/v1/generate: vLLM's token-in, token-out endpoint, served by the sampler
for verifiers' training client (services/sampler/vf) and forwarded to the inference pool.

The sampler is the one place every model call of a trajectory passes through, so calls
routed here get what the sampler's own rollouts get: the version gate (a server serving
weights older than the trajectory needs is not used), requests kept across weight syncs,
balancing, session affinity by `X-Session-ID` (the trace id), and the weight versions of
every token, written down for the trajectory's sample (vf/sessions.py). The answer is
vLLM's shape, with each logprob entry also carrying the `token: "token_id:N"` string the
`renderers` package checks, and never a -9999.0 sentinel (completions.parse_generate).

Not streamed (`stream: true` is a 400): the trajectory needs the whole answer anyway. Like
every route but /health, it takes the run's token when one is set (the verifiers environments
of this sampler send it).

GET /v1/models answers the served model's card (`id`, `max_model_len`, `root`) from the first
server, so a client can check a prompt's length before sending it (the `renderers` client
does: an overlong prompt then never reaches a server).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from services.sampler.completions import parse_generate
from services.sampler.deps import State
from services.sampler.inference_pool import InferenceRequestError, InferenceUnavailable
from services.sampler.rollout import derive_seed
from services.sampler.vf.sessions import Call

router = APIRouter(tags=["generate"])

SESSION_HEADER = "x-session-id"


def _error(status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> JSONResponse:
    # vLLM's error shape, so verifiers' client (openai SDK) reads the message.
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


def _check(body: Any) -> str | None:
    """What is wrong with a generate request, or None."""
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
        return "token_ids must be a non-empty list of token ids (integers >= 0)"
    if not isinstance(body.get("sampling_params", {}), dict):
        return "sampling_params must be an object"
    if body.get("stream"):
        return "stream=true is not supported by the sampler's generate endpoint: send stream=false"
    n = body.get("sampling_params", {}).get("n", 1)
    if n != 1:
        return f"sampling_params.n must be 1 (got {n!r}): a trajectory samples one answer per call"
    return None


@router.get("/v1/models")
async def models(state: State) -> Any:
    try:
        card = await state.rollouts.served_model()
    except (InferenceRequestError, InferenceUnavailable) as exc:
        return _error(503, str(exc), kind="ServiceUnavailableError")
    return {"object": "list", "data": [card]}


@router.post("/inference/v1/generate")
async def generate(request: Request, state: State) -> Any:
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "the body is not valid JSON")
    except ClientDisconnect:
        # The body-size guard answered 413 and cut the body off (guards.py); nothing to add.
        return _error(413, "request body too large")
    problem = _check(body)
    if problem is not None:
        return _error(400, problem)
    session_id = request.headers.get(SESSION_HEADER)
    session = state.sessions.get(session_id)
    rollouts = state.rollouts
    sampling = dict(body.get("sampling_params") or {})
    min_version = 0
    if session is not None:
        # The training contract wins over what verifiers sent: the sampler's temperature and
        # nucleus, and a seed per turn (one seed for every turn would move the turns together).
        sampling.update(session.sampling)
        sampling.setdefault("seed", derive_seed(session.seed, session.label, session_id, len(session.calls)))
        min_version = session.min_version
    sampling.setdefault("logprobs", 0)
    try:
        # As for the sampler's own turns: max_tokens is cut to the room the context has left.
        context = await rollouts.context_length()
        if context is not None:
            room = context - len(body["token_ids"])
            if room <= 0:
                return _error(400, f"the prompt ({len(body['token_ids'])} tokens) leaves no room in the model's "
                                   f"maximum context length ({context} tokens)")
            sampling["max_tokens"] = min(int(sampling.get("max_tokens") or room), room)
        forward = {**body, "sampling_params": sampling, "model": body.get("model") or await rollouts.model()}
        (answer, versions, masked), _ = await state.pool.post(
            "/inference/v1/generate", forward, min_version=min_version, parse=parse_generate, session=session_id)
    except InferenceRequestError as exc:
        return _error(400, f"{exc}. (A 404 means the server has no /inference/v1/generate: vLLM serves it with "
                           "--enable-scale-out, which tandem's vLLM launcher passes)")
    except InferenceUnavailable as exc:
        if session is not None:
            session.inference_error = exc
        return _error(503, str(exc), kind="ServiceUnavailableError")
    choice = answer["choices"][0]
    completion = list(choice.get("token_ids") or [])
    rollouts.completions_done += 1
    rollouts.tokens_done += len(completion)
    if session is not None:
        session.calls.append(Call(prompt_ids=list(body["token_ids"]), completion_ids=completion, versions=versions,
                                  masked=masked, finish_reason=choice.get("finish_reason") or "stop"))
    return answer
