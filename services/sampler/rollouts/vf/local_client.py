"""verifiers' training client, in-process: the sampler's own verifiers environments reach the
inference pool without an HTTP round trip to the sampler itself.

verifiers' interception server renders each model call with its `TrainClient`, which sends
the token ids through the openai SDK (httpx) to a `/inference/v1/generate` endpoint: for the
sampler's own environments, the sampler's route (routes/generate.py), in the same process.
That hop (the SDK, httpx's pool checking every kept connection for expiry at each request,
the sampler's HTTP server stack) was ~40% of the event loop's CPU per verifiers turn
(bench/results/verifiers.md). Here `TrainClient` stays verifiers' own (rendering, bridging,
parsing, errors), and only the object it sends through changes: `InProcessGenerate` answers
`post(".../inference/v1/generate")` and `get("/models")` as the openai SDK would (the same
body bytes, the same exception types and messages for an error status) by calling what the
route calls (vf/generate.generate_tokens).

verifiers builds its client from the rollout's client config (`resolve_client`, called by
name in its interception server), and a config is data (the server keys its clients by the
config's JSON). So the config names the endpoint (`in_process`, an id in this module's
registry) and `install()` wraps that one name, `verifiers.v1.interception.server.resolve_client`,
to build a `LocalTrainClient` for such a config and hand every other config to verifiers.
The config keeps the sampler's URL and token: verifiers relays a harness's `GET /v1/models`
to `base_url` over HTTP, and the route stays for everyone else.
"""

from __future__ import annotations

import asyncio
import json
import uuid
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import httpx
import openai
from verifiers.v1.clients.train import ElasticRendererPool, TrainClient
from verifiers.v1.configs.client import TrainClientConfig

from services.sampler.rollouts.vf.generate import ROUTE, SESSION_HEADER, generate_tokens
from services.sampler.rollouts.vf.sessions import Sessions

if TYPE_CHECKING:
    from services.sampler.rollouts.rollout import Rollouts



class LocalTrainClientConfig(TrainClientConfig):
    """A `TrainClientConfig` whose generate calls stay in this process."""

    in_process: str
    """The id of the sampler's endpoint in this process (`Endpoint.id`)."""


class Endpoint:
    """What an in-process call needs from the sampler: the rollouts whose pool serves it (and
    whose counters it moves) and the open sessions. Registered under a fresh id for as long as
    something holds it (the environment that made it, the clients built for it)."""

    def __init__(self, rollouts: Rollouts, sessions: Sessions):
        self.rollouts = rollouts
        self.sessions = sessions
        self.id = uuid.uuid4().hex
        _endpoints[self.id] = self


_endpoints: weakref.WeakValueDictionary[str, Endpoint] = weakref.WeakValueDictionary()


def _status_error(status: int, text: str, url: str) -> openai.APIStatusError:
    """The exception the openai SDK raises for an answer of `status` with body `text`
    (openai 2.x: `_make_status_error_from_response` and `AsyncOpenAI._make_status_error`)."""
    response = httpx.Response(status, text=text, request=httpx.Request("POST", url))
    body: Any = text.strip()
    try:
        body = json.loads(body)
        message = f"Error code: {status} - {body}"
    except ValueError:
        message = body or f"Error code: {status}"
    data = body.get("error", body) if isinstance(body, Mapping) else body
    kinds = {400: openai.BadRequestError, 401: openai.AuthenticationError, 403: openai.PermissionDeniedError,
             404: openai.NotFoundError, 409: openai.ConflictError, 422: openai.UnprocessableEntityError,
             429: openai.RateLimitError}
    kind = kinds.get(status) or (openai.InternalServerError if status >= 500 else openai.APIStatusError)
    return kind(message, response=response, body=data)


def _dumps(payload: Any) -> str:
    # As Starlette's JSONResponse writes a route's answer, so the bytes the client parses are
    # the bytes the route would have sent.
    return json.dumps(payload, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


class InProcessGenerate:
    """The part of `openai.AsyncOpenAI` that `renderers.client.generate` uses (`base_url`,
    `get("/models")`, `post(<base>/inference/v1/generate)`), served by `generate_tokens`."""

    def __init__(self, endpoint: Endpoint, base_url: str, timeout: float | None):
        self._endpoint = endpoint
        # As the SDK keeps it (with a trailing slash): renderers keys its context-length cache by it.
        self.base_url = httpx.URL(base_url.rstrip("/") + "/")
        self._timeout = timeout
        # Built once: parsing a URL costs httpx ~25 us, twice a call (its Request, and the join).
        self._url = str(self.base_url.join(ROUTE))
        self._request = httpx.Request("POST", self._url)

    async def get(self, path: str, *, cast_to: Any = None, **_: Any) -> Any:
        if path.strip("/") != "models":
            raise NotImplementedError(f"the in-process client serves GET /models, not {path!r}")
        # routes/generate.py's GET /v1/models; a failure raises, as the SDK would for its 503.
        return {"object": "list", "data": [await self._endpoint.rollouts.served_model()]}

    async def post(self, path: str, *, cast_to: Any = None, body: Any = None, options: Any = None,
                   **_: Any) -> httpx.Response:
        if not str(path).endswith(ROUTE):
            raise NotImplementedError(f"the in-process client serves POST {ROUTE}, not {path!r}")
        headers = (options or {}).get("headers") or {}
        session_id = next((v for k, v in headers.items() if k.lower() == SESSION_HEADER), None)
        try:
            async with asyncio.timeout(self._timeout):
                status, answer = await generate_tokens(self._endpoint.rollouts, self._endpoint.sessions, body,
                                                       session_id)
        except TimeoutError:
            # The SDK's read timeout on the HTTP path (no retries: verifiers sets max_retries 0).
            raise openai.APITimeoutError(request=self._request) from None
        try:
            text = _dumps(answer)
        except ValueError:
            status, text = 500, "Internal Server Error"  # what the route's server answers then
        if status != 200:
            raise _status_error(status, text, self._url)
        return httpx.Response(status, content=text.encode(), request=self._request)

    async def close(self) -> None:
        pass


class LocalTrainClient(TrainClient):
    """verifiers' `TrainClient` sending through `InProcessGenerate` instead of the openai SDK."""

    def __init__(self, config: LocalTrainClientConfig) -> None:
        # TrainClient.__init__ (verifiers 0.4.0) but for the SDK client it builds.
        endpoint = _endpoints.get(config.in_process)
        if endpoint is None:
            raise RuntimeError(f"no in-process generate endpoint {config.in_process!r} (its sampler app is gone)")
        self.config = config
        self.client = InProcessGenerate(endpoint, config.base_url, config.timeout.read)
        if config.renderer_model_name is not None:
            ElasticRendererPool(config.renderer_model_name, config.renderer, multiplex=config.multiplex).warm()


def install() -> None:
    """Have verifiers' interception server build a `LocalTrainClient` for a
    `LocalTrainClientConfig` (idempotent; every other config goes to verifiers' own)."""
    from verifiers.v1.interception import server

    current = server.resolve_client
    if getattr(current, "tandem_in_process", False):
        return

    def resolve_client(config: Any) -> Any:
        if isinstance(config, LocalTrainClientConfig):
            return LocalTrainClient(config)
        return current(config)

    resolve_client.tandem_in_process = True  # type: ignore[attr-defined]
    resolve_client.wrapped = current  # type: ignore[attr-defined]
    server.resolve_client = resolve_client
