"""The CPU inference server: a FastAPI app that speaks the subset of vLLM's HTTP API that
Tandem uses (docs/inference-api.md), so the sampler cannot tell it from `vllm serve`.

`create_app(settings)` builds the app; its lifespan loads the model into an `Engine`
(batched generation, see engine.py) and closes it on shutdown. Nothing happens at import.

The routes, one APIRouter per resource under routes/ (each module lists its endpoints' shapes):

* completions.py: `POST /v1/completions`, `POST /v1/chat/completions` (with `stream: true` too).
* generate.py: `POST /inference/v1/generate`, vLLM's token-in/token-out endpoint.
* models.py: `GET /v1/models` (the base model, then the loaded LoRA adapters), `POST /tokenize`,
  `POST /detokenize`.
* lora.py: `POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter` (adapters.py; a request
  whose `model` is an adapter's name is computed with it).
* weights.py: `POST /pause`, `POST /resume`, `GET /is_paused`, `POST /collective_rpc`,
  `POST /update_weight_version`, `GET /weight_info`, `POST /reset_prefix_cache`.
* health.py: `GET /health` (200, empty body), `GET /version`, `GET /metrics` (Prometheus text).

With `api_token` set (`--api-token`, TANDEM_API_TOKEN) every route but `GET /health` needs
`Authorization: Bearer <token>` (shared/token_guard.py); 401 otherwise, in vLLM's error shape.

Their shapes were checked against vLLM's source (entrypoints/serve/dev/*/api_router.py and the
OpenAI protocol models; vLLM 0.33 with VLLM_SERVER_DEV_MODE=1). They read the engine and the
served model through deps.py.

Errors -> `{"error": {"message", "type", "param", "code"}}`; request validation errors are
400 (as in vLLM), an unknown model id is 404; a server fault is 500 (errors.py).

Deliberate differences: a stream is sent once its answer is generated (vLLM's chunks, but all
at the end; streaming.py), no `echo`, and the initial weight-version label comes from
settings (`weight_version`, default "0"; vLLM's is "default").
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI

from services.inference import errors
from services.inference.adapters import Adapters, Limits
from services.inference.config import InferenceSettings
from services.inference.deps import ServedModel
from services.inference.engine import Engine
from services.inference.metrics import InferenceMetrics
from services.inference.routes import completions, generate, health, lora, models, weights
from shared.token_guard import TokenGuard

log = logging.getLogger("tandem.inference.server")


def create_app(settings: InferenceSettings, engine: Engine | None = None) -> FastAPI:
    """The CPU server app. Pass `engine` to serve an already-loaded engine (it is then also
    started and closed by the app's lifespan)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if settings.torch_threads:
            import torch

            torch.set_num_threads(settings.torch_threads)
        eng = engine
        if eng is None:
            eng = await asyncio.to_thread(
                Engine.load, settings.model,
                max_model_len=settings.max_model_len, max_num_seqs=settings.max_num_seqs,
                weight_version=settings.weight_version, seed=settings.seed,
                metrics=InferenceMetrics(settings.model_id),
            )
        if settings.enable_lora is not False and eng.adapters is None:  # unset: on (adapters.py)
            eng.adapters = Adapters(eng, Limits(settings.max_lora_rank, settings.max_loras))
        app.state.engine = eng
        await eng.start()
        log.info("serving %s on CPU (max_model_len %d)", app.state.served_model.id, eng.max_model_len)
        try:
            yield
        finally:
            await eng.close()

    app = FastAPI(title="Tandem CPU inference (vLLM-compatible)", lifespan=lifespan)
    app.state.served_model = ServedModel(id=settings.model_id, created=int(time.time()))
    errors.install(app)
    for module in (completions, generate, models, lora, health, weights):
        app.include_router(module.router)
    # Every route but /health takes the run's token when one is set: /pause or /collective_rpc
    # from anyone else would stop or rewrite the run (docs/operations.md, Security).
    app.add_middleware(TokenGuard, token=settings.api_token, shape="openai", service="the inference server")
    return app
