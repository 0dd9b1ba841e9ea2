"""FastAPI dependencies: the sampler state.

The run token is checked before any route runs, by the app's TokenGuard (shared/token_guard.py,
installed in app.py): every route but /health (and /metrics, unless `metrics_token` is set) is
guarded, so a route added later needs nothing here to be closed.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from services.sampler.api.state import SamplerState


async def get_state(request: Request) -> SamplerState:
    # A coroutine although it never waits: FastAPI runs a plain function on its thread pool.
    return request.state.sampler


State = Annotated[SamplerState, Depends(get_state)]
