"""GET /metrics: the sampler's Prometheus metrics (text exposition format).

The registry belongs to this app's `SamplerMetrics` (state.metrics); see
services/sampler/observability/metrics.py for the metric names.
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from services.sampler.api.deps import State

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def metrics(state: State) -> Response:
    body = await state.metrics.render()
    return Response(body, media_type=CONTENT_TYPE_LATEST)
