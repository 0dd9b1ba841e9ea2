"""POST /inference/v1/generate: vLLM's token-in, token-out endpoint, served by the sampler
for verifiers' training client (services/sampler/rollouts/vf) and forwarded to the inference pool.

The sampler is the one place every model call of a trajectory passes through, so calls
routed here get what the sampler's own rollouts get: the version gate (a server serving
weights older than the trajectory needs is not used), requests kept across weight syncs,
balancing, session affinity by `X-Session-ID` (the trace id), and the weight versions of
every token, written down for the trajectory's sample (vf/sessions.py). The answer is
vLLM's shape, with each logprob entry also carrying the `token: "token_id:N"` string the
`renderers` package checks, and never a -9999.0 sentinel (completions.parse_generate).

The work after parsing the body is vf/generate.py's, which the sampler's own verifiers
environments call in-process (vf/local_client.py); this route serves everyone else (a
verifiers eval pointed at the sampler from outside, or `vf_client = http`).

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

from services.sampler.api.deps import State
from services.sampler.fleet.inference_pool import InferenceRequestError, InferenceUnavailable
from services.sampler.rollouts.vf.generate import ROUTE, SESSION_HEADER, error_body, generate_tokens

router = APIRouter(tags=["generate"])



def _error(status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, kind, param), status_code=status)


@router.get("/v1/models")
async def models(state: State) -> Any:
    try:
        card = await state.rollouts.served_model()
    except (InferenceRequestError, InferenceUnavailable) as exc:
        return _error(503, str(exc), kind="ServiceUnavailableError")
    return {"object": "list", "data": [card]}


@router.post(ROUTE)
async def generate(request: Request, state: State) -> Any:
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "the body is not valid JSON")
    except ClientDisconnect:
        # The body-size guard answered 413 and cut the body off (guards.py); nothing to add.
        return _error(413, "request body too large")
    # What the sampler's own verifiers environments call in-process (vf/local_client.py).
    status, answer = await generate_tokens(state.rollouts, state.sessions, body, request.headers.get(SESSION_HEADER))
    return answer if status == 200 else JSONResponse(answer, status_code=status)
