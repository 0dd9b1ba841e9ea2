"""GET /auth: does this request's bearer token open the sampler? (docs/sampler-api.md)

204 when it does, or when the sampler has no `api_token` (nothing is checked); 401 otherwise,
from the app's TokenGuard, exactly as every other guarded route would answer. A trainer asks
at start-up, before it loads a model, so a wrong `--api-token` costs a second rather than the
first optimizer step.
"""

from fastapi import APIRouter, Response, status

router = APIRouter(tags=["auth"])


@router.get(
    "/auth",
    status_code=status.HTTP_204_NO_CONTENT,
    responses={204: {"description": "the token is accepted (or the sampler has no api_token)"},
               401: {"description": "the token is missing or wrong"}},
)
async def check_token() -> Response:
    return Response(status_code=status.HTTP_204_NO_CONTENT)
