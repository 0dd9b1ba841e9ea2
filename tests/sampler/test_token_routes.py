"""Issue 41, closed by default: with `api_token` every sampler route but GET /health and GET
/metrics needs the run's token, the dashboard's browser login keeps it in a cookie, the
sampler sends it to its inference servers, and `tandem sampler` refuses to listen beyond
loopback without one.

The routes walked are read from the app (`app.routes`, through included routers and the
static mount) and from its OpenAPI schema, each asked with every HTTP method, so a route
added later is checked without touching this file.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from services.inference.standin import create_standin_app
from services.sampler.config import SamplerSettings
from shared.token_guard import dashboard_url
from tests.support.route_walk import (
    METHODS, WRONG, app_routes, check_closed, concrete, every_method, schema_routes,
)
from tests.support.servers import REPO, ServiceProcess, UvicornThread, free_port

TOKEN = "run-token-41"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# The documented open doors (docs/sampler-api.md): the health check and Prometheus's scrape.
OPEN = {"/health", "/metrics"}
# Today's routes, as a floor: the walk reads the app, and must find at least these.
MINIMUM = {"/", "/static/dashboard.js", "/docs", "/redoc", "/openapi.json", "/dashboard/data", "/status",
           "/batch", "/weights_version", "/inference_servers", "/eval", "/eval/{eval_id}", "/auth",
           "/v1/models", "/inference/v1/generate", "/health", "/metrics"}
HTML = {"Accept": "text/html,application/xhtml+xml"}


def _app(sampler: UvicornThread):
    return sampler.server.config.app


def test_every_sampler_route_but_health_and_metrics_needs_the_token(make_sampler):
    sampler = make_sampler(api_token=TOKEN)
    with httpx.Client(base_url=sampler.url, timeout=30) as http:
        assert http.get("/openapi.json").status_code == 401
        schema = http.get("/openapi.json", headers=AUTH)
        assert schema.status_code == 200, schema.text
        declared = app_routes(_app(sampler))
        in_schema = schema_routes(schema.json())
        # The walk over app.routes sees every route the schema has (so it cannot miss a
        # router), and the routes outside the schema (dashboard, docs, static files) too.
        assert in_schema <= declared, in_schema - declared
        paths = {path for _, path in declared | in_schema} | {"/static/dashboard.js"}
        assert MINIMUM <= paths | {"/static/dashboard.js"}, MINIMUM - paths
        assert {"/", "/docs", "/openapi.json", "/dashboard/data"} <= {p for _, p in declared}

        # Every method on every path but the open ones, plus paths that route nowhere: 401
        # without the token and with a wrong one, before any route (or 404/405) answers.
        walk = every_method(paths - OPEN) | every_method({"/no/such/route", "/static/no-such-file.js", "/health/"})
        leaks = check_closed(http, walk)
        assert leaks == [], "answered without the run's token:\n" + "\n".join(leaks)

        # The 401 says what is needed, in FastAPI's shape.
        denied = http.post("/weights_version", json={"version": 1}, headers={"Authorization": f"Bearer {WRONG}"})
        assert denied.status_code == 401
        assert denied.headers["www-authenticate"] == "Bearer"
        assert "TANDEM_API_TOKEN" in denied.json()["detail"]

        # With the token, the same requests reach their routes: none is refused, none fails.
        for method, path in sorted(declared):
            response = http.request(method, concrete(path), headers=AUTH, params={"timeout": 0})
            assert response.status_code != 401 and response.status_code < 500, (method, path, response.status_code,
                                                                                 response.text[:200])
        assert http.get("/auth", headers=AUTH).status_code == 204
        assert http.get("/static/dashboard.js", headers=AUTH).status_code == 200

        # The open doors answer anyone, on GET; other methods there reach no route.
        assert http.get("/health").status_code == 200
        metrics = http.get("/metrics")
        assert metrics.status_code == 200 and "tandem_sampler" in metrics.text
        for path in OPEN:
            for method in set(METHODS) - {"GET", "HEAD", "OPTIONS"}:
                assert http.request(method, path).status_code in (401, 405), (method, path)


def test_a_route_added_later_is_closed_too(make_sampler):
    """Closed by default: a route added to the app after create_app (no dependency, no
    decorator of the guard's) answers 401 without the token, and the walk finds it."""
    sampler = make_sampler(api_token=TOKEN)
    app = _app(sampler)

    async def later() -> dict[str, str]:
        return {"secret": "run data"}

    app.add_api_route("/later/{item}", later, methods=["GET", "POST"])
    assert {("GET", "/later/{item}"), ("POST", "/later/{item}")} <= app_routes(app)
    with httpx.Client(base_url=sampler.url, timeout=30) as http:
        assert check_closed(http, {("GET", "/later/{item}"), ("POST", "/later/{item}")}) == []
        assert http.get("/later/x1", headers=AUTH).json() == {"secret": "run data"}


def test_the_token_is_a_bearer_header_only(make_sampler):
    sampler = make_sampler(api_token=TOKEN)
    with httpx.Client(base_url=sampler.url, timeout=30) as http:
        assert http.get("/status", headers={"Authorization": f"bearer {TOKEN}"}).status_code == 200
        assert http.get("/status", headers={"Authorization": f"Bearer  {TOKEN}"}).status_code == 200
        for header in (f"Basic {TOKEN}", TOKEN, f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", "Bearer"):
            assert http.get("/status", headers={"Authorization": header}).status_code == 401, header
        # `?token=` is the dashboard page's login, not a way to call the API.
        assert http.get("/status", params={"token": TOKEN}).status_code == 401
        assert http.get("/dashboard/data", params={"token": TOKEN}).status_code == 401
        assert http.post("/weights_version", params={"token": TOKEN}, json={"version": 1}).status_code == 401
        # A trainer's key under another header name does not open it either.
        assert http.get("/status", headers={"X-Api-Key": TOKEN}).status_code == 401


def test_metrics_token_guards_metrics_and_opens_nothing_else(make_sampler):
    sampler = make_sampler(api_token=TOKEN, metrics_token="scrape-41")
    with httpx.Client(base_url=sampler.url, timeout=30) as http:
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers={"Authorization": f"Bearer {WRONG}"}).status_code == 401
        for token in ("scrape-41", TOKEN):
            response = http.get("/metrics", headers={"Authorization": f"Bearer {token}"})
            assert response.status_code == 200 and "tandem_sampler" in response.text, token
        # The scrape token is for /metrics alone.
        for path in ("/status", "/dashboard/data", "/batch"):
            assert http.get(path, headers={"Authorization": "Bearer scrape-41"}).status_code == 401, path
        assert http.get("/health").status_code == 200


def test_metrics_token_alone_still_guards_metrics(make_sampler):
    """docs/sampler-api.md, GET /metrics: "With `metrics_token` set it needs Authorization:
    Bearer with that token (or the run's), else 401" -- also on a sampler without a run token."""
    sampler = make_sampler(metrics_token="scrape-41")
    with httpx.Client(base_url=sampler.url, timeout=30) as http:
        assert http.get("/status").status_code == 200  # no run token: the rest is open
        assert http.get("/metrics", headers={"Authorization": "Bearer scrape-41"}).status_code == 200
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers={"Authorization": f"Bearer {WRONG}"}).status_code == 401


def test_dashboard_login_keeps_the_token_in_a_cookie_for_reads_only(make_sampler, caplog):
    caplog.set_level(logging.INFO, logger="tandem.sampler")
    sampler = make_sampler(api_token=TOKEN)
    port = sampler.port
    # The sampler logs the link a person opens.
    assert f"dashboard: http://127.0.0.1:{port}/?token={TOKEN}" in caplog.text
    cookie_name = f"tandem_token_{port}"
    with httpx.Client(base_url=sampler.url, timeout=30, follow_redirects=False) as http:
        # A browser without the token gets the page that says how to get in.
        page = http.get("/", headers=HTML)
        assert page.status_code == 401
        assert page.headers["content-type"].startswith("text/html")
        assert "needs its run token" in page.text and 'name="token"' in page.text
        assert "has not been given the token yet" in page.text
        # A client that is not a browser gets the JSON 401.
        assert http.get("/").json()["detail"]
        # A wrong token on the login: the page again, no cookie.
        wrong = http.get("/", params={"token": WRONG}, headers=HTML)
        assert wrong.status_code == 401 and "not this run's token" in wrong.text
        assert "set-cookie" not in wrong.headers

        # The right one: 303 to the same page without the token, the cookie set.
        login = http.get("/", params={"token": TOKEN, "interval": "200"}, headers=HTML)
        assert login.status_code == 303
        assert login.headers["location"] == "/?interval=200"
        assert TOKEN not in login.headers["location"]
        set_cookie = login.headers["set-cookie"]
        assert set_cookie.startswith(f"{cookie_name}={TOKEN};")
        attributes = {part.strip() for part in set_cookie.split(";")[1:]}
        assert {"HttpOnly", "SameSite=Strict", "Path=/"} <= attributes, set_cookie
        assert login.headers["cache-control"] == "no-store"

    cookie = {"Cookie": f"{cookie_name}={TOKEN}"}
    with httpx.Client(base_url=sampler.url, timeout=30) as http:
        dashboard = http.get("/", headers={**HTML, **cookie})
        assert dashboard.status_code == 200 and "dashboard.js" in dashboard.text
        for path in ("/status", "/dashboard/data", "/static/dashboard.js", "/weights_version"):
            assert http.get(path, headers=cookie).status_code == 200, path
        # The cookie reads; it never changes the run (a page elsewhere could make the browser send it).
        assert http.post("/weights_version", json={"version": 1}, headers=cookie).status_code == 401
        assert http.post("/eval", json={"num_examples": 1}, headers=cookie).status_code == 401
        assert http.delete("/inference_servers", params={"url": "http://x"}, headers=cookie).status_code == 401
        assert http.get("/weights_version", headers=AUTH).json()["version"] == 0
        # Another port's cookie, or a stale token, opens nothing; the page says why.
        assert http.get("/status", headers={"Cookie": f"tandem_token_{port + 1}={TOKEN}"}).status_code == 401
        stale = http.get("/", headers={**HTML, "Cookie": f"{cookie_name}={WRONG}"})
        assert stale.status_code == 401 and "no longer this run's" in stale.text


def test_the_sampler_sends_its_token_to_its_inference_servers(make_sampler):
    guarded = UvicornThread(create_standin_app(api_token=TOKEN)).start()
    try:
        # The stand-in is closed to anyone without the token...
        assert httpx.post(guarded.url + "/v1/completions", json={"prompt": "1", "max_tokens": 2}).status_code == 401
        sampler = make_sampler(api_token=TOKEN, inference_urls=[guarded.url])
        # ...and the sampler behind it builds batches: every call it made carried the token.
        batch = httpx.get(sampler.url + "/batch", params={"step": 0, "timeout": 30}, headers=AUTH, timeout=40)
        assert batch.status_code == 200, batch.text[:300]
        assert len(batch.json()["samples"]) == 16
        stats = httpx.get(guarded.url + "/_standin/stats", headers=AUTH, timeout=10)
        assert stats.status_code == 200 and stats.json()["requests"] >= 4, stats.text[:300]
        # The weight sync too (pause, collective_rpc, update_weight_version, resume).
        synced = httpx.post(sampler.url + "/weights_version", json={"version": 1, "checkpoint_path": "/ckpt/step-0"},
                            headers=AUTH, timeout=30)
        assert synced.status_code == 200, synced.text[:300]
        assert [server["version"] for server in synced.json()["servers"]] == [1]
        stats = httpx.get(guarded.url + "/_standin/stats", headers=AUTH, timeout=10).json()
        assert stats == {**stats, "reloads": ["/ckpt/step-0"], "version": "1", "paused": False}
        batch = httpx.get(sampler.url + "/batch", params={"step": 1, "timeout": 30}, headers=AUTH, timeout=40)
        assert batch.status_code == 200, batch.text[:300]
    finally:
        guarded.stop()


def test_an_inference_server_that_refuses_the_token_shows_as_down_with_the_reason(make_sampler):
    """A run whose inference server has another token: the server is never put in rotation,
    and /status says why (the 401), rather than the run just producing nothing."""
    guarded = UvicornThread(create_standin_app(api_token="the-server-token")).start()
    try:
        sampler = make_sampler(api_token=TOKEN, inference_urls=[guarded.url])
        deadline = time.monotonic() + 15
        while True:
            [server] = httpx.get(sampler.url + "/status", headers=AUTH, timeout=10).json()["inference_servers"]
            if server["state"] == "down" or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert server["state"] == "down" and not server["in_rotation"], server
        assert "401" in server["reason"] and "TANDEM_API_TOKEN" in server["reason"], server["reason"]
        assert httpx.get(sampler.url + "/batch", params={"step": 0, "timeout": 0.5}, headers=AUTH,
                         timeout=10).status_code == 204
        stats = httpx.get(guarded.url + "/_standin/stats", headers={"Authorization": "Bearer the-server-token"})
        assert stats.json()["requests"] == 0  # nothing was generated past the guard
    finally:
        guarded.stop()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "0.0.0.0", "::"])
def test_the_printed_dashboard_link_is_a_url_a_browser_opens(host):
    """The link the sampler logs for each loopback host it may listen on (and the wildcards):
    a URL with a host, the port and the token, which httpx (as a browser) can parse."""
    settings = SamplerSettings(host=host, port=8123, inference_urls=["http://127.0.0.1:9"], api_token="a b&c")
    url = dashboard_url(settings.self_url, settings.api_token)
    parts = urlsplit(url)
    assert parts.scheme == "http" and parts.port == 8123 and parts.path == "/", url
    assert parts.hostname in ("127.0.0.1", "localhost", "::1"), url
    assert parse_qs(parts.query) == {"token": ["a b&c"]}
    assert httpx.URL(url).port == 8123


def _env_without_token() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("TANDEM_API_TOKEN", "TANDEM_INSECURE_NO_TOKEN")}


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env=env or _env_without_token(), timeout=60)


def _assert_refused(result: subprocess.CompletedProcess, prog: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    line = lines[0]
    assert line.startswith(f"{prog}: ") and "TANDEM_API_TOKEN" in line and "--insecure-no-token" in line, line


def test_sampler_refuses_a_public_host_without_a_token(tmp_path: Path):
    common = ["--port", str(free_port()), "--run-dir", str(tmp_path / "run"),
              "--inference-urls", "http://127.0.0.1:9"]
    for host in ("0.0.0.0", "::", "10.1.2.3"):
        result = _cli("sampler", "--host", host, *common)
        _assert_refused(result, "tandem sampler")
        assert host in result.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_sampler_on_a_public_host_with_a_token_or_knowingly_open(tmp_path: Path, redis_url: str, standin,
                                                                  namespace: str):
    """Both get past the refusal and serve: with TANDEM_API_TOKEN closed (and the dashboard
    link printed), with --insecure-no-token open (and a warning saying so)."""
    started = []
    for name, extra, env in (("token", [], {**_env_without_token(), "TANDEM_API_TOKEN": TOKEN}),
                             ("open", ["--insecure-no-token"], _env_without_token())):
        port = free_port()
        argv = [sys.executable, "-m", "services.cli", "sampler", "--host", "0.0.0.0", "--port", str(port),
                "--run-dir", str(tmp_path / name), "--redis-url", redis_url, "--namespace", f"{namespace}{name}",
                "--inference-urls", standin.url, "--env", "tests.support.envs:CountEnv",
                "--prompts-per-step", "2", "--num-generations", "2", "--max-tokens", "4", *extra]
        proc = ServiceProcess(argv, name=f"sampler ({name})", log_path=tmp_path / f"{name}.log", env=env,
                              ready_url=f"http://127.0.0.1:{port}/health")
        started.append((name, proc, f"http://127.0.0.1:{port}"))
    try:
        for name, proc, url in started:
            proc.wait_ready(90)
        (_, closed, closed_url), (_, opened, open_url) = started
        assert httpx.get(closed_url + "/status", timeout=10).status_code == 401
        assert httpx.get(closed_url + "/status", headers=AUTH, timeout=10).status_code == 200
        assert f"dashboard: {closed_url}/?token={TOKEN}" in closed.log_tail(20000)
        assert httpx.get(open_url + "/status", timeout=10).status_code == 200
        assert "no api_token" in opened.log_tail(20000)
    finally:
        for _, proc, _ in started:
            proc.terminate()
