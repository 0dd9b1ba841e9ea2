"""GET/POST/DELETE /inference_servers: the run's inference servers, changed at run time.

Membership lives in Redis (fleet/members.py), so every replica and a restarted sampler use the same
set; `inference_urls` only seeds it. A server is added once it serves the published
version (its answer says which), and is refused with the reason when it cannot be brought
there. A removed server gets no new work; requests in flight to it finish, or are retried
on other servers if it dies.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status

from services.sampler.api.deps import State
from services.sampler.fleet.members import JoinRefused
from shared.wire import InferenceServerRemoved, InferenceServerRequest, InferenceServers, ServerVersion

router = APIRouter(tags=["inference servers"])


@router.get("/inference_servers", response_model=InferenceServers)
async def list_servers(state: State) -> InferenceServers:
    meta = await state.store.meta()
    return InferenceServers(servers=[ServerVersion(**s.snapshot()) for s in state.pool.servers],
                            published_version=meta["version"], checkpoint_path=meta["checkpoint_path"])


@router.post(
    "/inference_servers",
    response_model=ServerVersion,
    responses={409: {"description": "the server cannot be given the published weights (no checkpoint_path), "
                          "or is being added or removed already"},
               422: {"description": "the server does not answer, or could not load the published checkpoint"}},
)
async def add_server(body: InferenceServerRequest, state: State) -> ServerVersion:
    try:
        server = await state.fleet.join(body.url)
    except JoinRefused as exc:
        raise HTTPException(exc.status, detail=str(exc)) from None
    return ServerVersion(**server.snapshot())


@router.delete(
    "/inference_servers",
    response_model=InferenceServerRemoved,
    responses={404: {"description": "not one of the run's inference servers"}},
)
async def remove_server(
    body: InferenceServerRequest,
    state: State,
    timeout: Annotated[float, Query(ge=0, le=3600, description="seconds to wait for requests in flight")] = 30.0,
) -> InferenceServerRemoved:
    if state.pool.find(body.url) is None and body.url.rstrip("/") not in await _members(state):
        known = ", ".join(s.url for s in state.pool.servers) or "none"
        raise HTTPException(status.HTTP_404_NOT_FOUND,
                            detail=f"{body.url} is not one of the run's inference servers ({known})")
    return InferenceServerRemoved(**await state.fleet.leave(body.url, timeout))


async def _members(state: State) -> set[str]:
    return {url for url, m in (await state.store.members()).items() if not m.get("removed_at")}
