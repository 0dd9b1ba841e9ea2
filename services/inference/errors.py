"""Every error the CPU inference server answers, in vLLM's shape:
`{"error": {"message", "type", "param", "code"}}` (protocol.error_body).

Request validation errors are 400, as in vLLM (FastAPI's default would be 422); a
`RequestError` from the engine or a route carries its own status; a server fault is 500.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.inference import protocol as P
from services.inference.request_error import RequestError

log = logging.getLogger("tandem.inference.server")


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(P.error_body(message, status, param), status_code=status)


async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
    return error_response(exc.message, exc.status, exc.param)


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return error_response("; ".join(parts) or "invalid request", 400)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(str(exc.detail), exc.status_code)


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error")
    return error_response(f"internal server error: {exc}", 500)


def install(app: FastAPI) -> None:
    """Answer every error of `app` in vLLM's shape."""
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
