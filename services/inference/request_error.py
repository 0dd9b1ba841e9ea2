"""`RequestError`: bad input, raised anywhere in the CPU server (the engine, adapters, routes)
and answered by the HTTP layer (errors.py) with its status and an OpenAI-style error body.
Its own module so that everything that raises it can import it without importing the engine."""

from __future__ import annotations


class RequestError(ValueError):
    """Bad input: the HTTP layer answers it with `status` and an OpenAI-style error body."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
