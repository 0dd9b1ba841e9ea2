"""GET /health: liveness, and whether the sampler can do its work right now."""

from fastapi import APIRouter

from services.sampler.api.deps import State
from shared.wire import Health

router = APIRouter(tags=["health"])


@router.get("/health", response_model=Health)
async def health(state: State) -> Health:
    # Answered from memory: it must work while Redis is down, which is when it matters.
    problem = state.link.problem()
    return Health(status="degraded", problems=[problem]) if problem else Health()
