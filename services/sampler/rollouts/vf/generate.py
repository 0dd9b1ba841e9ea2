"""One verifiers model call through the inference pool: what the sampler's
`POST /inference/v1/generate` (routes/generate.py) does once it has the JSON body, and what
the in-process client of the sampler's own verifiers environments (vf/local_client.py) calls
without the HTTP round trip. One function for both, so a call is served the same way
whichever way it came.

A call whose `session_id` names an open trajectory (vf/sessions.py) is gated at that
trajectory's version, sampled with the sampler's temperature and nucleus and a seed per
turn, and written down for the trajectory's sample; any other call is served at any version,
as it asks. The answer is vLLM's shape (completions.parse_generate), errors vLLM's error shape,
so verifiers' client (the openai SDK over HTTP, or the in-process client) reads the message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.sampler.rollouts.completions import parse_generate
from services.sampler.fleet.inference_pool import InferenceRequestError, InferenceUnavailable
from services.sampler.rollouts.seeds import derive_seed
from services.sampler.rollouts.vf.sessions import Call, Sessions

if TYPE_CHECKING:
    from services.sampler.rollouts.rollout import Rollouts

ROUTE = "/inference/v1/generate"
# The header naming a call's trajectory (vf/sessions.py), as verifiers' client sends it.
SESSION_HEADER = "x-session-id"


def error_body(status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> dict[str, Any]:
    # vLLM's error shape, so verifiers' client (openai SDK) reads the message.
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def check(body: Any) -> str | None:
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


async def generate_tokens(rollouts: Rollouts, sessions: Sessions, body: Any,
                          session_id: str | None) -> tuple[int, dict[str, Any]]:
    """(200, vLLM's answer) or (an HTTP status, vLLM's error body) for one generate request."""
    problem = check(body)
    if problem is not None:
        return 400, error_body(400, problem)
    session = sessions.get(session_id)
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
                return 400, error_body(400, f"the prompt ({len(body['token_ids'])} tokens) leaves no room in the "
                                            f"model's maximum context length ({context} tokens)")
            sampling["max_tokens"] = min(int(sampling.get("max_tokens") or room), room)
        forward = {**body, "sampling_params": sampling, "model": body.get("model") or await rollouts.model()}
        (answer, versions, masked), _ = await rollouts.pool.post(
            ROUTE, forward, min_version=min_version, parse=parse_generate, session=session_id)
    except InferenceRequestError as exc:
        return 400, error_body(400, f"{exc}. (A 404 means the server has no /inference/v1/generate: vLLM serves it "
                                    "with --enable-scale-out, which tandem's vLLM launcher passes)")
    except InferenceUnavailable as exc:
        if session is not None:
            session.inference_error = exc
        return 503, error_body(503, str(exc), kind="ServiceUnavailableError")
    choice = answer["choices"][0]
    completion = list(choice.get("token_ids") or [])
    rollouts.completions_done += 1
    rollouts.tokens_done += len(completion)
    if session is not None:
        session.calls.append(Call(prompt_ids=list(body["token_ids"]), completion_ids=completion, versions=versions,
                                  masked=masked, finish_reason=choice.get("finish_reason") or "stop"))
    return 200, answer
