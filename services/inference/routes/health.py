"""Liveness and monitoring: GET /health (200, empty body), GET /version and GET /metrics
(Prometheus text, from the engine's own registry: metrics.py)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from services.inference.deps import EngineDep

router = APIRouter(tags=["health"])


@router.get("/health")
async def health():
    return Response(status_code=200)


@router.get("/version")
async def version():
    return {"version": "tandem-cpu"}


@router.get("/metrics")
async def metrics(eng: EngineDep):
    body = eng.metrics.render()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
