"""shared/token_guard.py on its own: TokenGuard around a tiny Starlette app served for real
(uvicorn on a free port, real HTTP), and the helpers the entrypoints use (is_loopback, refusal,
bearer_headers, dashboard_url, VllmTokenGuard)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse
from starlette.routing import Route

from shared import token_guard
from shared.token_guard import OPT_OUT_FLAG, TOKEN_ENV, TokenGuard, VllmTokenGuard
from tests.support.servers import UvicornThread

TOKEN = "guard-token"
HTML = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def page(request: Request) -> HTMLResponse:
    return HTMLResponse(f"<p>the page {request.url.query}</p>")


async def data(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


async def change(request: Request) -> JSONResponse:
    return JSONResponse({"changed": True})


async def health(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


def tiny_app() -> Starlette:
    return Starlette(routes=[
        Route("/", page), Route("/data", data), Route("/change", change, methods=["POST", "PUT", "DELETE"]),
        Route("/health", health), Route("/metrics", health), Route("/v1/models", data),
    ])


@pytest.fixture
def serve() -> Iterator[Callable[..., UvicornThread]]:
    """serve(app) -> a running UvicornThread; all stopped at the end."""
    started: list[UvicornThread] = []

    def start(app: Any) -> UvicornThread:
        server = UvicornThread(app).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def guarded(serve: Callable[..., UvicornThread], token: str | None = TOKEN, **kwargs: Any) -> UvicornThread:
    kwargs.setdefault("open_paths", {"/health": None, "/metrics": "scrape"})
    kwargs.setdefault("browser_paths", ("/",))
    return serve(TokenGuard(tiny_app(), token, **kwargs))


def cookie_for(server: UvicornThread, value: str) -> dict[str, str]:
    return {"Cookie": f"tandem_token_{server.port}={value}"}


def test_bearer_right_wrong_missing(serve):
    server = guarded(serve, service="the tiny app")
    with httpx.Client(base_url=server.url, timeout=10) as http:
        for method, path in (("GET", "/data"), ("POST", "/change"), ("DELETE", "/change"), ("GET", "/v1/models")):
            missing = http.request(method, path)
            assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
            assert "the tiny app needs 'Authorization: Bearer <token>'" in missing.json()["detail"]
            wrong = http.request(method, path, headers=bearer("guard-tokeN"))
            assert wrong.status_code == 401 and "not this run's" in wrong.json()["detail"]
            assert http.request(method, path, headers=bearer(TOKEN)).status_code == 200
        assert http.get("/data", headers={"Authorization": f"BEARER {TOKEN}"}).status_code == 200
        assert http.get("/data", headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401
        assert http.get("/data", headers=bearer(TOKEN + TOKEN)).status_code == 401
        # A path nothing routes is refused before the router's 404.
        assert http.get("/nowhere").status_code == 401
        assert http.get("/nowhere", headers=bearer(TOKEN)).status_code == 404


def test_the_cookie_is_taken_for_get_and_head_only(serve):
    server = guarded(serve)
    cookie = cookie_for(server, TOKEN)
    with httpx.Client(base_url=server.url, timeout=10) as http:
        assert http.get("/data", headers=cookie).status_code == 200
        assert http.head("/data", headers=cookie).status_code == 200
        assert http.get("/", headers={**cookie, **HTML}).status_code == 200
        for method in ("POST", "PUT", "DELETE"):
            assert http.request(method, "/change", headers=cookie).status_code == 401, method
        # Among other cookies, too; but not under another port's name, nor with a wrong value.
        assert http.get("/data", headers={"Cookie": f"a=1; tandem_token_{server.port}={TOKEN}; b=2"}).status_code == 200
        assert http.get("/data", headers={"Cookie": f"tandem_token_{server.port + 1}={TOKEN}"}).status_code == 401
        assert http.get("/data", headers=cookie_for(server, "guard-tokeN")).status_code == 401
        # A wrong bearer is not rescued by a right cookie.
        assert http.get("/data", headers={**cookie, **bearer("nope")}).status_code == 401


def test_login_sets_the_cookie_and_drops_the_token_from_the_address(serve):
    server = guarded(serve)
    with httpx.Client(base_url=server.url, timeout=10, follow_redirects=False) as http:
        login = http.get("/", params={"token": TOKEN}, headers=HTML)
        http.cookies.clear()  # each request below says which cookie it sends
        assert login.status_code == 303
        assert login.headers["location"] == "/"
        name, _, rest = login.headers["set-cookie"].partition("=")
        value, *attributes = [part.strip() for part in rest.split(";")]
        assert name == f"tandem_token_{server.port}" and value == TOKEN
        assert {"Path=/", "HttpOnly", "SameSite=Strict"} <= set(attributes)
        assert login.headers["cache-control"] == "no-store"
        # Other parameters stay; only the token leaves.
        kept = http.get("/", params={"interval": "200", "token": TOKEN, "x": "a b"})
        http.cookies.clear()
        location = urlsplit(kept.headers["location"])
        assert kept.status_code == 303 and location.path == "/"
        assert parse_qs(location.query) == {"interval": ["200"], "x": ["a b"]}
        # The cookie opens the page (a browser follows the redirect with it).
        after = http.get(kept.headers["location"], headers={**HTML, "Cookie": f"{name}={value}"})
        assert after.status_code == 200 and "the page" in after.text and "interval=200" in after.text

        # A wrong token: the how-to-get-in page, no cookie.
        wrong = http.get("/", params={"token": "nope"}, headers=HTML)
        assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
        assert wrong.headers["content-type"].startswith("text/html")
        assert "needs its run token" in wrong.text and "That token is not this run's token." in wrong.text
        assert '<form method="get" action="/">' in wrong.text and 'name="token"' in wrong.text
        # No token yet, or a stale one: the page says which.
        fresh = http.get("/", headers=HTML)
        assert fresh.status_code == 401 and "has not been given the token yet" in fresh.text
        stale = http.get("/", headers={**HTML, **cookie_for(server, "old-token")})
        assert stale.status_code == 401 and "no longer this run's" in stale.text
        # Not a browser: the JSON 401, not the page.
        assert http.get("/").json()["detail"]
        # The login is for the browser pages alone, and for reads alone.
        assert http.get("/data", params={"token": TOKEN}, headers=HTML).status_code == 401
        assert http.get("/data", headers=HTML).headers["content-type"] == "application/json"
        assert http.post("/", params={"token": TOKEN}).status_code == 401


@pytest.mark.parametrize("token", ["p@ss word;=é,\"%2F+&?", "a=b; Path=/evil"])
def test_a_token_of_any_characters_survives_the_login_cookie(serve, token):
    server = guarded(serve, token=token)
    with httpx.Client(base_url=server.url, timeout=10, follow_redirects=False) as http:
        login = http.get("/", params={"token": token}, headers=HTML)
        http.cookies.clear()  # each request below says which cookie it sends
        assert login.status_code == 303, login.text[:200]
        set_cookie = login.headers["set-cookie"]
        name, _, rest = set_cookie.partition("=")
        value, *attributes = [part.strip() for part in rest.split(";")]
        # One name=value pair and the guard's own attributes: nothing of the token leaks out as one.
        assert set(attributes) == {"Path=/", "HttpOnly", "SameSite=Strict"}, set_cookie
        assert " " not in value and "," not in value
        assert http.get("/data", headers={"Cookie": f"{name}={value}"}).status_code == 200
        assert http.get("/data", headers={"Cookie": f"{name}={value}x"}).status_code == 401


def test_open_paths_and_a_path_token_of_its_own(serve):
    server = guarded(serve)
    with httpx.Client(base_url=server.url, timeout=10) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/health", headers=bearer("anything")).status_code == 200
        assert http.get("/health/").status_code == 401  # the exact path only
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers=bearer("nope")).status_code == 401
        assert http.get("/metrics", headers=bearer("scrape")).status_code == 200
        assert http.get("/metrics", headers=bearer(TOKEN)).status_code == 200
        assert http.get("/metrics", headers=cookie_for(server, "scrape")).status_code == 401
        # The path's own token opens that path alone.
        assert http.get("/data", headers=bearer("scrape")).status_code == 401


@pytest.mark.parametrize("token", [None, ""])
def test_without_a_token_everything_is_open(serve, token):
    server = guarded(serve, token=token)
    with httpx.Client(base_url=server.url, timeout=10, follow_redirects=False) as http:
        assert http.get("/data").status_code == 200
        assert http.post("/change").status_code == 200
        # A path with a token of its own keeps it when the run has none.
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers=bearer("scrape")).status_code == 200
        assert http.get("/", params={"token": "x"}, headers=HTML).status_code == 200  # no login to do


def test_openai_shape(serve):
    server = guarded(serve, shape="openai", service="this vLLM server", open_paths={"/health": None})
    response = httpx.post(server.url + "/change", timeout=10)
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["code"] == 401 and error["type"] == "Unauthorized" and error["param"] is None
    assert error["message"].startswith("this vLLM server needs") and TOKEN_ENV in error["message"]
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 401  # only what is named is open


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("", False), ("10.0.0.5", False), ("192.168.1.2", False),
    ("example.com", False), ("localhost.example.com", False), ("127.0.0.1.nip.io", False),
])
def test_is_loopback(host, loopback):
    assert token_guard.is_loopback(host) is loopback


def test_refusal():
    assert token_guard.refusal("the sampler", "127.0.0.1", None, False) is None
    assert token_guard.refusal("the sampler", "0.0.0.0", "t", False) is None
    assert token_guard.refusal("the sampler", "0.0.0.0", None, True) is None
    for token in (None, ""):
        message = token_guard.refusal("the sampler", "0.0.0.0", token, False)
        assert message is not None and "\n" not in message
        assert message.startswith("the sampler refuses to listen on 0.0.0.0 without a token")
        assert TOKEN_ENV in message and OPT_OUT_FLAG in message


def test_bearer_headers_and_dashboard_url():
    assert token_guard.bearer_headers(None) == {} and token_guard.bearer_headers("") == {}
    assert token_guard.bearer_headers("t") == {"Authorization": "Bearer t"}
    assert token_guard.dashboard_url("http://127.0.0.1:8100", None) == "http://127.0.0.1:8100/"
    assert token_guard.dashboard_url("http://127.0.0.1:8100/", "abc") == "http://127.0.0.1:8100/?token=abc"
    odd = "a b&c=d#e"
    url = token_guard.dashboard_url("http://h:1", odd)
    assert urlsplit(url).fragment == "" and parse_qs(urlsplit(url).query) == {"token": [odd]}


def test_vllm_guard_refuses_to_build_without_the_token(serve, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(RuntimeError, match=TOKEN_ENV):
        VllmTokenGuard(tiny_app())
    monkeypatch.setenv(TOKEN_ENV, "")
    with pytest.raises(RuntimeError, match=TOKEN_ENV):
        VllmTokenGuard(tiny_app())
    # With it, as vLLM builds it (the app alone): everything but /health closed, vLLM's shape.
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    server = serve(VllmTokenGuard(tiny_app()))
    with httpx.Client(base_url=server.url, timeout=10) as http:
        assert http.get("/health").status_code == 200
        for path in ("/v1/models", "/metrics", "/data"):
            response = http.get(path)
            assert response.status_code == 401 and response.json()["error"]["code"] == 401, path
            assert http.get(path, headers=bearer(TOKEN)).status_code == 200, path


def behind_prefix(app: Any, prefix: str) -> Any:
    """As uvicorn's --root-path serves an app: the prefix in `root_path`, and in `path` too."""

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope = {**scope, "root_path": prefix, "path": prefix + scope["path"]}
        await app(scope, receive, send)

    return asgi


def test_behind_a_proxy_prefix_the_open_paths_and_the_login_keep_their_names(serve):
    guard = TokenGuard(tiny_app(), TOKEN, open_paths={"/health": None}, browser_paths=("/",))
    server = serve(behind_prefix(guard, "/tandem"))
    with httpx.Client(base_url=server.url, timeout=10, follow_redirects=False) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/data").status_code == 401
        page = http.get("/", headers=HTML)
        assert page.status_code == 401 and 'action="/tandem/"' in page.text
        login = http.get("/", params={"token": TOKEN, "interval": "200"}, headers=HTML)
        assert login.status_code == 303
        assert login.headers["location"] == "/tandem/?interval=200"
