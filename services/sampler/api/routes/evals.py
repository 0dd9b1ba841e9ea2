"""POST /eval and GET /eval/{eval_id}: evaluation jobs on the latest served weights."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, status

from services.sampler.config import SamplerSettings
from services.sampler.api.deps import State
from services.sampler.rollouts.envs import BUILTINS
from shared.wire import EvalAccepted, EvalRequest, EvalResult

router = APIRouter(tags=["eval"])


def allowed_envs(settings: SamplerSettings) -> set[str]:
    """What an eval's `env` may name: the built-ins and what the operator configured.

    Never an arbitrary `package.module:factory` from the request: loading one imports a
    module and calls whatever it names (`os:abort` would kill the sampler).
    """
    lessons = {name for stage in settings.curriculum or [] for name in stage.lessons}
    return {*BUILTINS, settings.env, *lessons}


@router.post("/eval", status_code=status.HTTP_202_ACCEPTED, response_model=EvalAccepted)
async def start_eval(body: EvalRequest, state: State) -> EvalAccepted:
    allowed = allowed_envs(state.settings)
    if body.env and body.env not in allowed:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            detail=f"environment {body.env!r} is not available for evals: use one of {sorted(allowed)} "
                            "(the built-ins, the sampler's env and its curriculum lessons)")
    try:
        eval_id = await state.evals.start(body.model_dump())
    except ValueError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=str(exc)) from None
    return EvalAccepted(eval_id=eval_id)


@router.get("/eval/{eval_id}", response_model=EvalResult, responses={404: {"description": "unknown eval id"}})
async def get_eval(
    state: State,
    eval_id: Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")],
    timeout: Annotated[float, Query(ge=0, le=86400, description="seconds to wait for done/failed")] = 0.0,
) -> EvalResult:
    record = await state.evals.wait(eval_id, min(timeout, state.settings.max_poll_timeout))
    if record is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no eval with id {eval_id!r}")
    return EvalResult.model_validate(record)
