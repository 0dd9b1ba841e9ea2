"""ASGI middleware that feeds the HTTP request metrics of `SamplerMetrics`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from services.sampler.api.state import SamplerState


class HttpMetricsMiddleware:
    """Counts requests and their duration by method, route template and status.

    Pure ASGI (no BaseHTTPMiddleware) so long-polls and streaming answers pass through
    untouched. The route template (`/eval/{eval_id}`) rather than the path keeps label
    cardinality bounded; paths matching no route are labelled `<unmatched>`.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            # No sampler state outside the lifespan: nothing to count into.
            sampler: SamplerState | None = (scope.get("state") or {}).get("sampler")
            if sampler is not None:
                sampler.metrics.observe_request(scope["method"], _route_label(scope), status,
                                                time.perf_counter() - started)


def _route_label(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    if path:
        return path
    if scope.get("path", "").startswith("/static/"):
        return "/static/{path}"
    return "<unmatched>"
