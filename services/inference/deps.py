"""FastAPI dependencies of the CPU inference server: the engine and the served model, both
read from the app's state (set by `create_app` and its lifespan)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from services.inference.engine import Engine, RequestError


@dataclass(frozen=True)
class ServedModel:
    """The model id clients name in requests, and when the server started serving it."""

    id: str
    created: int

    def check(self, model: str | None) -> None:
        """A request may leave `model` out; naming another model is a 404, as in vLLM."""
        if model is not None and model != self.id:
            raise RequestError(f"The model `{model}` does not exist.", status=404, param="model")


def get_engine(request: Request) -> Engine:
    # On app.state rather than in the lifespan's state: ServerHandle.engine (testing.py) reads
    # it from outside any request.
    return request.app.state.engine


def get_served_model(request: Request) -> ServedModel:
    return request.app.state.served_model


EngineDep = Annotated[Engine, Depends(get_engine)]
Served = Annotated[ServedModel, Depends(get_served_model)]
