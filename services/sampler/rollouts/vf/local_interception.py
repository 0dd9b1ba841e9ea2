"""The harness's calls to verifiers' interception server, in-process: the tandem-chat harness
(vf/harness.py) hands each model call to the server's own route handler instead of POSTing it
to the server's port in the same process.

Over HTTP a verifiers turn went through aiohttp twice in this event loop: the harness's
client (request writing, response parsing, its connection pool) and the interception
server's protocol (parsing, the handler task, response writing): about a third of the
sampler's CPU per verifiers turn (bench/results/verifiers.md). The handler itself (verifiers'
checks, hooks, trace graph, training client) is the work a turn needs; the rest was framing
between two ends that share an event loop.

verifiers' interception server is an aiohttp app the env's `serving()` holds for the
sampler's lifetime (vf/environment.py registers it here, `held`). For a harness endpoint one
of its servers answers, `route` returns a `LocalRoute` that calls the handler aiohttp would
call for that path (read from the app's router: verifiers' handler with its retry and
idempotency bookkeeping) with a `LocalRequest`, which carries what the handler reads: path,
headers, body, and per-request state. The handler runs in a task of its own, as it does
under aiohttp: verifiers adopts the task serving a rollout's call and cancels it when the
rollout is released, which must be that task, not the harness's.

Only a rollout whose training client is in-process too (`LocalTrainClientConfig`: the
sampler's `vf_client = in_process`, the default) takes this path; with `vf_client = http`
both hops are HTTP, as for a harness outside the sampler, and the two give the same samples
(tests/vf/test_vf_in_process.py).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

from services.sampler.rollouts.vf.local_client import LocalTrainClientConfig

Handler = Callable[[Any], Awaitable[Any]]

# The interceptions the sampler's verifiers environments hold (Env.serving), by id: a pool
# (`.servers`) or one server. Few, and each lives as long as its environment serves.
_held: dict[int, Any] = {}
# Per server: its POST handlers by path, read once from its app's router.
_handlers: weakref.WeakKeyDictionary[Any, dict[str, Handler]] = weakref.WeakKeyDictionary()


@contextmanager
def held(interception: Any) -> Iterator[None]:
    """While inside, harness calls to `interception`'s servers may stay in-process."""
    if interception is None:
        yield
        return
    _held[id(interception)] = interception
    try:
        yield
    finally:
        _held.pop(id(interception), None)


def _servers(interception: Any) -> list[Any]:
    servers = getattr(interception, "servers", None)  # the pools (verifiers.v1.interception.pool)
    return list(servers) if servers is not None else [interception]


def route(endpoint: str, secret: str, timeout: float) -> LocalRoute | None:
    """The in-process route for a harness whose model endpoint is `endpoint` (`<server>/v1`)
    and whose rollout's bearer is `secret`, or None: the endpoint is no held server's, or the
    rollout's model calls go over HTTP (`vf_client = http`)."""
    base = endpoint.rstrip("/").removesuffix("/v1")
    for interception in list(_held.values()):
        for server in _servers(interception):
            if server.base_url != base:
                continue
            session = server.sessions.get(secret)
            if session is None or not isinstance(session.ctx.client, LocalTrainClientConfig):
                return None
            return LocalRoute(server, secret, timeout)
    return None


class LocalRequest(dict):
    """What verifiers' interception handlers read of an `aiohttp.web.Request` (verifiers 0.4.0:
    `handle_request`, `handle_tool`): `path`, `headers`, `read()`, `content_length`, and the
    request as a mapping of per-request state (aiohttp's Request is one too)."""

    def __init__(self, path: str, headers: CIMultiDictProxy[str], body: bytes):
        super().__init__()
        self.method = "POST"
        self.path = path
        self.headers = headers
        self.content_length = len(body)
        self._read_bytes: bytes | None = body  # aiohttp's cache of the body; the handler clears it

    async def read(self) -> bytes:
        body = self._read_bytes
        if body is None:
            raise RuntimeError("the request body was released before it was read")
        return body

    def __hash__(self) -> int:  # identity, as aiohttp's Request (a dict is unhashable)
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


class CallCancelled(Exception):
    """The interception server cancelled the call's handler (its rollout was released), while
    the harness itself was not cancelled: over HTTP the connection would have dropped."""


class LocalRoute:
    """One rollout's calls to the interception server `server`, in-process."""

    def __init__(self, server: Any, secret: str, timeout: float):
        self._server = server
        self._base = server.base_url
        self._headers = CIMultiDictProxy(CIMultiDict({"Authorization": f"Bearer {secret}",
                                                      "Content-Type": "application/json"}))
        self._timeout = timeout

    def _handler(self, path: str) -> Handler | None:
        handlers = _handlers.get(self._server)
        if handlers is None:
            runner = self._server.runner
            if runner is None:
                raise RuntimeError("the interception server has stopped")
            handlers = _handlers[self._server] = {
                r.resource.canonical: r.handler for r in runner.app.router.routes()
                if r.method == "POST" and r.resource is not None}
        return handlers.get(path)

    async def post(self, url: str, body: bytes) -> tuple[int, bytes]:
        """POST `body` (JSON) to `url` on the server: the answer's status and body."""
        if not url.startswith(self._base + "/"):
            raise ValueError(f"{url!r} is not on the interception server {self._base}")
        path = url[len(self._base):]
        handler = self._handler(path)
        if handler is None:
            return 404, b"404: Not Found"  # aiohttp's answer for a path no route has
        # As aiohttp's ClientTimeout(total=...) bounds the HTTP call; awaiting the task directly
        # cancels it with the harness, as a dropped connection would have ended it.
        async with asyncio.timeout(self._timeout):
            task = asyncio.get_running_loop().create_task(handler(LocalRequest(path, self._headers, body)))
            try:
                response = await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
                raise CallCancelled(f"the interception server cancelled POST {path}") from None
        payload = response.body
        if not isinstance(payload, bytes | bytearray):
            raise TypeError(f"POST {path} answered a {type(response).__name__}, not a whole body")
        return response.status, bytes(payload)
