"""Request guards: a body-size limit (413), invalid bodies as 422s and Redis outages as 503s,
never 500s."""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.sampler.storage.redis_link import is_outage


class BodyLimitMiddleware:
    """Answer 413 to bodies over `limit` bytes, declared (Content-Length) or streamed."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self._reject(send)
                return
        seen = 0
        rejected = False
        started = False

        async def counted() -> Message:
            # Over the limit, answer 413 ourselves and tell the app the client went away,
            # so it stops reading; anything it still sends is dropped.
            nonlocal seen, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    rejected = True
                    if not started:
                        await self._reject(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if rejected:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted, guarded_send)

    async def _reject(self, send: Send) -> None:
        body = json.dumps({"detail": f"request body larger than {self.limit} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _json_safe(value: Any) -> Any:
    """NaN and infinities as strings: Python's JSON reader accepts them in a body, and the 422
    that echoes the body back must not fail to encode them (that was a 500)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def install(app: FastAPI, max_body_bytes: int) -> None:
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler, with values that JSON can carry.
        return JSONResponse(status_code=422, content={"detail": _json_safe(jsonable_encoder(exc.errors()))})

    @app.exception_handler(RedisError)
    async def redis_unavailable(request: Request, exc: RedisError) -> JSONResponse:
        # The link (redis_link.py) knows how long it has been down; it hears of this one too.
        link = getattr(getattr(request.state, "sampler", None), "link", None)
        if link is not None and is_outage(exc):
            link.report(exc)
        since = link.problem() if link is not None else None
        cause = since or f"{type(exc).__name__}: {exc}"
        return JSONResponse(
            status_code=503,
            content={"detail": f"the sampler's Redis is unavailable ({cause}); nothing acknowledged is lost: "
                               "retry shortly"},
            headers={"Retry-After": "1"},
        )
