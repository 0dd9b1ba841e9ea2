"""The CPU inference server: a FastAPI app that speaks the subset of vLLM's HTTP API that
Tandem uses (docs/inference-api.md), so the sampler cannot tell it from `vllm serve`.

`create_app(settings)` builds the app; its lifespan loads the model into an `Engine`
(batched generation, see engine.py) and closes it on shutdown. Nothing happens at import.

Endpoint shapes, checked against vLLM's source (entrypoints/serve/dev/*/api_router.py and the
OpenAI protocol models; vLLM 0.33 with VLLM_SERVER_DEV_MODE=1):

* `GET /health` -> 200, empty body.  `GET /v1/models` -> `{"object": "list", "data": [{"id",
  "object": "model", "created", "owned_by": "vllm", "root", "parent": null, "max_model_len",
  "permission": [...]}]}`.
* `POST /tokenize` -> `{"count", "max_model_len", "tokens", "token_strs"}`; `POST /detokenize`
  -> `{"prompt"}`.
* `POST /pause?mode=abort|wait|keep` (default abort, as vLLM) -> `{"status": "paused"}`;
  `POST /resume` -> `{"status": "resumed"}`; `GET /is_paused` -> `{"is_paused": bool}`.
* `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": dir}}` ->
  `{"results": [null]}` (one entry per worker; the CPU server has one). The same with
  `"method": "tandem_reload_weights"` -> `{"results": [{"weights_path", "seconds", "repacked": [],
  "reprocessed": 0}]}`, the answer of Tandem's vLLM worker extension (vllm_ext.py), so a sampler
  may call that name on every Tandem server. Other methods: 400.
* `POST /v1/completions` with `prompt_logprobs: k` -> `choices[i].prompt_logprobs` in vLLM's
  shape (protocol.py).
* `POST /update_weight_version {"new_version": str}` -> `{"success": true, "new_version": str}`;
  `GET /weight_info` -> `{"weight_version": str}`.
* `POST /reset_prefix_cache` -> `{"success": true}` (the CPU engine keeps no prefix cache).
* `GET /metrics` -> Prometheus text.
* Errors -> `{"error": {"message", "type", "param", "code"}}`; request validation errors are
  400 (as in vLLM), an unknown model id is 404; a server fault is 500.

Deliberate differences: no streaming (`stream: true` is a 400), no `echo`, and the initial
weight-version label comes from settings (`weight_version`, default "0"; vLLM's is "default").
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.inference import protocol as P
from services.inference.config import InferenceSettings
from services.inference.engine import Engine, RequestError
from services.inference.metrics import InferenceMetrics
from services.inference.vllm_ext import RELOAD_METHOD

log = logging.getLogger("tandem.inference.server")

DISCONNECT_POLL_S = 1.0


def _engine(request: Request) -> Engine:
    return request.app.state.engine


def _error(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(P.error_body(message, status, param), status_code=status)


def _check_model(request: Request, model: str | None) -> None:
    served = request.app.state.model_id
    if model is not None and model != served:
        raise RequestError(f"The model `{model}` does not exist.", status=404, param="model")


def _unsupported(req: P._Request) -> None:
    if req.stream:
        raise RequestError("stream=true is not supported by the CPU inference server", param="stream")


async def _unless_disconnected(request: Request, coro) -> Any:
    """Run `coro`; cancel it (aborting its sequences) if the client goes away meanwhile."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                return Response(status_code=499)
    finally:
        if not task.done():
            task.cancel()


def _piece(tokenizer):
    cache: dict[int, str] = {}

    def piece(token_id: int) -> str:
        if token_id not in cache:
            cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
        return cache[token_id]

    return piece


def _render_chat(tokenizer, messages: list[P.ChatMessage], add_generation_prompt: bool,
                 continue_final_message: bool, extra: dict[str, Any] | None) -> list[int]:
    convo = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            convo, tokenize=False, add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, **(extra or {}),
        )
    except Exception as exc:  # noqa: BLE001 - jinja errors or no template: the request's or the model's fault
        raise RequestError(f"could not apply the chat template: {exc}", param="messages") from None
    # The template already wrote every special token the model expects.
    return tokenizer.encode(text, add_special_tokens=False)


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
        app.state.engine = eng
        await eng.start()
        log.info("serving %s on CPU (max_model_len %d)", app.state.model_id, eng.max_model_len)
        try:
            yield
        finally:
            await eng.close()

    app = FastAPI(title="Tandem CPU inference (vLLM-compatible)", lifespan=lifespan)
    app.state.model_id = settings.model_id
    app.state.created = int(time.time())

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError):
        return _error(exc.message, exc.status, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        parts = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        return _error("; ".join(parts) or "invalid request", 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return _error(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):
        log.exception("internal error")
        return _error(f"internal server error: {exc}", 500)

    # ------------------------------------------------------------------ generation

    @app.post("/v1/completions")
    async def completions(req: P.CompletionRequest, request: Request):
        _check_model(request, req.model)
        _unsupported(req)
        if req.echo:
            raise RequestError("echo=true is not supported by the CPU inference server", param="echo")
        eng = _engine(request)
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts = [eng.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]  # type: ignore[arg-type]
        elif prompt:
            prompts = [eng.tokenizer.encode(p, add_special_tokens=req.add_special_tokens) if isinstance(p, str)
                       else list(p) for p in prompt]
        else:
            raise RequestError("prompt is empty", param="prompt")
        params = []
        for ids in prompts:
            max_tokens = req.max_tokens if req.max_tokens is not None else eng.max_model_len - len(ids)
            sp = req.sampling(max_tokens, req.logprobs)
            eng.validate(ids, sp)
            params.append(sp)

        async def run():
            return await asyncio.gather(*(eng.generate(ids, sp, req.n) for ids, sp in zip(prompts, params)))

        result = await _unless_disconnected(request, run())
        if isinstance(result, Response):
            return result
        piece = _piece(eng.tokenizer)
        choices, completion_tokens = [], 0
        for i, (ids, outs) in enumerate(zip(prompts, result)):
            for j, out in enumerate(outs):
                choices.append(P.completion_choice(i * req.n + j, out, ids, req, piece))
                completion_tokens += len(out.token_ids)
        prompt_tokens = sum(len(ids) for ids in prompts)
        return P.completion_response(request.app.state.model_id, choices, prompt_tokens, completion_tokens)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: P.ChatCompletionRequest, request: Request):
        _check_model(request, req.model)
        _unsupported(req)
        eng = _engine(request)
        ids = _render_chat(eng.tokenizer, req.messages, req.add_generation_prompt,
                           req.continue_final_message, req.chat_template_kwargs)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = limit if limit is not None else eng.max_model_len - len(ids)
        top = (req.top_logprobs or 0) if req.logprobs else None
        sp = req.sampling(max_tokens, top)
        eng.validate(ids, sp)
        outs = await _unless_disconnected(request, eng.generate(ids, sp, req.n))
        if isinstance(outs, Response):
            return outs
        piece = _piece(eng.tokenizer)
        choices = [P.chat_choice(j, out, req, piece) for j, out in enumerate(outs)]
        return P.chat_response(request.app.state.model_id, choices, outs, ids, req)

    # ------------------------------------------------------------------ model info

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": "tandem-cpu"}

    @app.get("/v1/models")
    async def models(request: Request):
        eng = _engine(request)
        created = request.app.state.created
        return {"object": "list", "data": [{
            "id": request.app.state.model_id, "object": "model", "created": created, "owned_by": "vllm",
            "root": str(eng.model_path), "parent": None, "max_model_len": eng.max_model_len,
            "permission": [{"id": f"modelperm-{created}", "object": "model_permission", "created": created,
                            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                            "organization": "*", "group": None, "is_blocking": False}],
        }]}

    @app.post("/tokenize")
    async def tokenize(req: P.TokenizeRequest, request: Request):
        _check_model(request, req.model)
        eng = _engine(request)
        if req.messages is not None:
            ids = _render_chat(eng.tokenizer, req.messages, req.add_generation_prompt,
                               req.continue_final_message, None)
        elif req.prompt is not None:
            ids = eng.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise RequestError("give either prompt or messages", param="prompt")
        strs = eng.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": eng.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(req: P.DetokenizeRequest, request: Request):
        _check_model(request, req.model)
        eng = _engine(request)
        bad = [t for t in req.tokens if not 0 <= t < eng.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is out of vocabulary", param="tokens")
        return {"prompt": eng.tokenizer.decode(req.tokens)}

    @app.get("/metrics")
    async def metrics(request: Request):
        body = _engine(request).metrics.render()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    # ------------------------------------------------------------------ weight updates

    @app.post("/pause")
    async def pause(request: Request, mode: str = Query("abort"),
                    wait_for_inflight_requests: bool = Query(False), clear_cache: bool = Query(True)):
        # clear_cache is accepted for vLLM compatibility; there is no prefix cache to clear.
        if wait_for_inflight_requests:
            mode = "wait"
        await _engine(request).pause(mode)  # type: ignore[arg-type]
        return {"status": "paused"}

    @app.post("/resume")
    async def resume(request: Request):
        await _engine(request).resume()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused(request: Request):
        return {"is_paused": _engine(request).is_paused}

    @app.post("/collective_rpc")
    async def collective_rpc(req: P.CollectiveRpcRequest, request: Request):
        if req.method not in ("reload_weights", RELOAD_METHOD):
            raise RequestError(
                f"collective_rpc method {req.method!r} is not supported by the CPU inference server; "
                f"supported: reload_weights, {RELOAD_METHOD}", param="method",
            )
        path = req.kwargs.get("weights_path")
        if path is not None and not isinstance(path, str):
            raise RequestError("kwargs.weights_path must be a string path", param="weights_path")
        eng = _engine(request)
        started = time.perf_counter()
        await eng.reload_weights(path)
        if req.method == "reload_weights":
            return {"results": [None]}
        # The CPU engine multiplies by its parameters directly: there is nothing to repack.
        return {"results": [{"weights_path": str(path or eng.model_path),
                             "seconds": round(time.perf_counter() - started, 4),
                             "repacked": [], "reprocessed": 0}]}

    @app.post("/update_weight_version")
    async def update_weight_version(req: P.UpdateWeightVersionRequest, request: Request):
        _engine(request).set_weight_version(req.new_version)
        return {"success": True, "new_version": req.new_version}

    @app.get("/weight_info")
    async def weight_info(request: Request):
        return {"weight_version": _engine(request).weight_version}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = Query(False), reset_external: bool = Query(False)):
        return {"success": True}

    return app
