"""FastAPI dependencies: the sampler state and bearer-token auth for mutating endpoints."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status

from services.sampler.state import SamplerState


def get_state(request: Request) -> SamplerState:
    return request.state.sampler


State = Annotated[SamplerState, Depends(get_state)]


def require_token(request: Request, state: State) -> None:
    """When `api_token` is set, mutating endpoints need `Authorization: Bearer <token>`."""
    token = state.settings.api_token
    if not token:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), token.encode()):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            detail="this endpoint needs 'Authorization: Bearer <api_token>' with the sampler's api_token",
            headers={"WWW-Authenticate": "Bearer"},
        )


Authorized = Depends(require_token)
