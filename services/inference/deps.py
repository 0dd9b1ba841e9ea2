"""FastAPI dependencies of the CPU inference server: the engine and the served model, both
read from the app's state (set by `create_app` and its lifespan), and which model a request names.
They are coroutines although they never wait: FastAPI runs a plain function dependency on its
thread pool, a hop per dependency per request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from services.inference.engine import Engine
from services.inference.request_error import RequestError

if TYPE_CHECKING:
    from services.inference.adapters import Adapter, Adapters


@dataclass(frozen=True)
class ServedModel:
    """The model id clients name in requests, and when the server started serving it."""

    id: str
    created: int

    def resolve(self, model: str | None, adapters: Adapters | None) -> Adapter | None:
        """The LoRA adapter a request names, None for the base model (`model` left out, empty or
        the served id); any other name is a 404, as in vLLM."""
        if not model or model == self.id:
            return None
        adapter = adapters.get(model) if adapters is not None else None
        if adapter is None:
            raise RequestError(f"The model `{model}` does not exist.", status=404, param="model")
        return adapter


async def get_engine(request: Request) -> Engine:
    # On app.state rather than in the lifespan's state: ServerHandle.engine (testing.py) reads
    # it from outside any request.
    return request.app.state.engine


async def get_served_model(request: Request) -> ServedModel:
    return request.app.state.served_model


EngineDep = Annotated[Engine, Depends(get_engine)]
Served = Annotated[ServedModel, Depends(get_served_model)]
