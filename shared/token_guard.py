"""The run token at the door of every Tandem server: one ASGI middleware, standard library only.

Three servers load it (docs/operations.md, "Security"):

* the sampler, with its `api_token`, and the dashboard's browser login (a cookie, below);
* Tandem's CPU inference server, with its `api_token`;
* vLLM, through its `--middleware` option (`VllmTokenGuard`, the token from `TANDEM_API_TOKEN`):
  vLLM's own `--api-key` guards only `/v1`, `/v2`, `/inference` and `/cohere`, not the dev-mode
  routes (`/pause`, `/collective_rpc`, ...) that Tandem turns on. It runs in vLLM's interpreter
  (.venv-vllm, or the official image with this file mounted), hence no import beyond the
  standard library.

Invariants:
* Closed by default: every path is guarded except those named open (`/health`, and the
  sampler's `/metrics` unless a metrics token is set). A route added later is guarded too.
* A token is `Authorization: Bearer <token>`, compared in constant time (hmac.compare_digest).
* A browser's cookie (`tandem_token_<port>`) is accepted for GET and HEAD only, so a page on
  another site cannot make a logged-in browser change the run (the cookie is also SameSite=Strict).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlencode

TOKEN_ENV = "TANDEM_API_TOKEN"
OPT_OUT_FLAG = "--insecure-no-token"
COOKIE_PREFIX = "tandem_token_"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname or a wildcard: reachable from elsewhere


def refusal(service: str, host: str, token: str | None, insecure: bool) -> str | None:
    """Why `service` must not listen on `host` as asked, or None when it may."""
    if token or insecure or is_loopback(host):
        return None
    return (f"{service} refuses to listen on {host} without a token: anyone who reaches that address could "
            f"read and steer the run. Set {TOKEN_ENV} (the run's token, shared by every Tandem process), "
            f"or pass {OPT_OUT_FLAG} to run open knowingly")


def bearer_headers(token: str | None) -> dict[str, str]:
    """The header a client sends with the run's token; none without one."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def dashboard_url(base_url: str, token: str | None) -> str:
    """The dashboard's address as printed for a person: with the token, which the page then
    keeps in a cookie (as Jupyter's printed URL does)."""
    return f"{base_url.rstrip('/')}/" + (f"?{urlencode({'token': token})}" if token else "")


def token_matches(given: str, token: str) -> bool:
    return hmac.compare_digest(given.encode(), token.encode())


def bearer(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, given = value.decode("latin-1").partition(" ")
            return given.strip() if scheme.lower() == "bearer" else None
    return None


def _cookie(headers: Iterable[tuple[bytes, bytes]], name: str) -> str | None:
    for header, value in headers:
        if header == b"cookie":
            for part in value.decode("latin-1").split(";"):
                key, _, val = part.strip().partition("=")
                if key == name:
                    return unquote(val)
    return None


def _accepts_html(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    return any(name == b"accept" and b"text/html" in value for name, value in headers)


LOGIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Tandem: token needed</title>
<style>body{{font:15px/1.5 system-ui,sans-serif;max-width:40em;margin:4em auto;padding:0 1em;color:#222}}
code{{background:#f2f2f2;padding:0 .3em}}input{{font:inherit;width:24em}}</style></head>
<body><h1>This Tandem sampler needs its run token</h1>
<p id="why">{why}</p>
<p>Open the dashboard with the link the sampler printed when it started
(<code>dashboard: http://&hellip;/?token=&hellip;</code>, in the output of <code>tandem demo</code> or
<code>tandem sampler</code>, or <code>docker compose logs sampler</code>): the browser keeps the token
from then on.</p>
<p>Or paste the run's token (<code>TANDEM_API_TOKEN</code>) here:</p>
<form method="get" action="{action}"><input name="token" type="password" autocomplete="off"
aria-label="run token"> <button type="submit">Open the dashboard</button></form>
</body></html>
"""


class TokenGuard:
    """Answers 401 to a request without the run's token, except on the open paths.

    `token`: the run's token; None or "" lets everything through (a loopback service started
    without one, which the entrypoints allow). `open_paths`: path -> None (open to all) or a
    token of its own that is accepted beside the run's (the sampler's optional metrics token).
    `browser_paths`: HTML pages a person opens (the dashboard): `?token=` there sets the
    cookie and redirects to the same page without it, and a browser without the token gets a
    page that says how to get in. `shape`: the JSON error body, "detail" (FastAPI's) or
    "openai" (vLLM's `{"error": {...}}`).
    """

    def __init__(self, app: Any, token: str | None = None, *, open_paths: Mapping[str, str | None] | None = None,
                 browser_paths: Iterable[str] = (), shape: str = "detail", service: str = "this server"):
        self.app = app
        self.token = token or None
        self.open_paths = dict(open_paths if open_paths is not None else {"/health": None})
        self.browser_paths = frozenset(browser_paths)
        self.shape = shape
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = self._route_path(scope)
        headers = scope.get("headers", [])
        given = bearer(headers)
        if path in self.open_paths:
            # A path with a token of its own keeps it even when the run has none.
            own = self.open_paths[path]
            if own is None or (given is not None and any(token_matches(given, t) for t in (own, self.token) if t)):
                await self.app(scope, receive, send)
                return
            await self._deny(scope, send, "this endpoint needs 'Authorization: Bearer <token>' with its own token "
                             "or the run's token")
            return
        if self.token is None:
            await self.app(scope, receive, send)
            return
        if given is not None:
            if token_matches(given, self.token):
                await self.app(scope, receive, send)
                return
            await self._deny(scope, send, f"the token given is not this run's: {self.service} needs "
                             f"'Authorization: Bearer <token>' with the run's token ({TOKEN_ENV})")
            return
        method = scope.get("method", "GET")
        if scope["type"] == "http" and method in ("GET", "HEAD"):
            page = scope.get("root_path", "") + path  # the page's address as the browser sees it
            if path in self.browser_paths:
                query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
                if "token" in query:
                    await self._login(scope, send, page, query)
                    return
            cookie = _cookie(headers, self._cookie_name(scope))
            if cookie is not None and token_matches(cookie, self.token):
                await self.app(scope, receive, send)
                return
            if path in self.browser_paths and _accepts_html(headers):
                why = ("The token this browser kept is no longer this run's (was the sampler restarted with a new one?)."
                       if cookie is not None else "This browser has not been given the token yet.")
                await self._page(send, LOGIN_PAGE.format(why=why, action=page))
                return
        await self._deny(scope, send, f"{self.service} needs 'Authorization: Bearer <token>' with the run's token "
                         f"({TOKEN_ENV})")

    @staticmethod
    def _route_path(scope: Scope) -> str:
        """The path as the app's routes name it: behind a proxy's prefix (`root_path`) the
        server may put the prefix into `path` too."""
        path, root = scope.get("path", ""), scope.get("root_path", "")
        if root and path.startswith(root):
            return path[len(root):] or "/"
        return path

    @staticmethod
    def _cookie_name(scope: Scope) -> str:
        # Cookies are not kept per port: two samplers on one host keep a token each.
        server = scope.get("server") or ("", 0)
        return f"{COOKIE_PREFIX}{server[1] or 0}"

    async def _login(self, scope: Scope, send: Send, page: str, query: dict[str, list[str]]) -> None:
        given = query.pop("token")[-1]
        if not token_matches(given, self.token):
            await self._page(send, LOGIN_PAGE.format(why="That token is not this run's token.", action=page))
            return
        # The token leaves the address bar (and the history) at once; the cookie carries it on.
        rest = urlencode(query, doseq=True)
        location = page + (f"?{rest}" if rest else "")
        cookie = f"{self._cookie_name(scope)}={quote(given, safe='')}; Path=/; HttpOnly; SameSite=Strict"
        await _respond(send, 303, [(b"location", location.encode("latin-1")), (b"set-cookie", cookie.encode("latin-1")),
                                   (b"cache-control", b"no-store")])

    @staticmethod
    async def _page(send: Send, html: str) -> None:
        """The 401 page a browser without the run's token sees."""
        await _respond(send, 401, [(b"content-type", b"text/html; charset=utf-8"), (b"cache-control", b"no-store")],
                       html.encode())

    async def _deny(self, scope: Scope, send: Send, message: str) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if self.shape == "openai":
            payload: dict[str, Any] = {"error": {"message": message, "type": "Unauthorized", "param": None, "code": 401}}
        else:
            payload = {"detail": message}
        await _respond(send, 401, [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
                       json.dumps(payload).encode())


async def _respond(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes = b"") -> None:
    """One whole answer from the guard itself: the app behind it never sees the request."""
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class VllmTokenGuard(TokenGuard):
    """For `vllm serve --middleware shared.token_guard.VllmTokenGuard`: vLLM builds it with the
    app alone, so the token comes from TANDEM_API_TOKEN, which the launcher sets. Without one
    it refuses to build, so a server meant to be guarded never starts open."""

    def __init__(self, app: Any):
        token = os.environ.get(TOKEN_ENV, "")
        if not token:
            raise RuntimeError(f"VllmTokenGuard needs {TOKEN_ENV}: the launcher sets it with the run's token")
        super().__init__(app, token, open_paths={"/health": None}, shape="openai", service="this vLLM server")
