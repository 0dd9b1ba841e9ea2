"""Issue 41, closed by default, for the inference servers: with `api_token` Tandem's CPU server
(the tiny model) and the stand-in answer 401 in vLLM's error shape on every route but
GET /health, so nobody without the run's token can pause, rewrite or relabel the weights, or
spend the compute; `tandem inference` refuses to listen beyond loopback without a token.

The routes walked are read from each app (`app.routes`) and its OpenAPI schema, every HTTP
method on each, so a route added later is checked too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.inference.standin import create_standin_app
from services.inference.testing import ServerHandle, start_server
from tests.support.route_walk import WRONG, app_routes, check_closed, every_method, schema_routes
from tests.support.servers import REPO, ServiceProcess, UvicornThread, free_port

TOKEN = "inference-token-41"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# The doors that change or spend a run: each must be shut without the token.
DANGEROUS = [("POST", "/pause"), ("POST", "/resume"), ("POST", "/collective_rpc"), ("POST", "/update_weight_version"),
             ("POST", "/v1/completions"), ("POST", "/inference/v1/generate"), ("POST", "/reset_prefix_cache")]
COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def guarded(tiny_model: Path) -> Iterator[ServerHandle]:
    handle = start_server(tiny_model, served_model_name="tiny", api_token=TOKEN)
    yield handle
    handle.stop()


@pytest.fixture
def guarded_standin() -> Iterator[UvicornThread]:
    server = UvicornThread(create_standin_app(api_token=TOKEN)).start()
    yield server
    server.stop()


def _walk_all_but_health(url: str, app) -> None:
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/openapi.json").status_code == 401
        schema = http.get("/openapi.json", headers=AUTH)
        assert schema.status_code == 200, schema.text
        declared = app_routes(app)
        in_schema = schema_routes(schema.json())
        assert in_schema <= declared, in_schema - declared
        paths = {path for _, path in declared}
        assert {"/v1/completions", "/pause", "/collective_rpc", "/update_weight_version", "/docs"} <= paths
        walk = every_method(paths - {"/health"}) | every_method({"/no/such/route", "/health/"})
        leaks = check_closed(http, walk)
        assert leaks == [], "answered without the run's token:\n" + "\n".join(leaks)
        # In vLLM's error shape, saying what is needed.
        denied = http.post("/v1/completions", json=COMPLETION, headers={"Authorization": f"Bearer {WRONG}"})
        assert denied.status_code == 401 and denied.headers["www-authenticate"] == "Bearer"
        error = denied.json()["error"]
        assert error["code"] == 401 and error["type"] == "Unauthorized" and "TANDEM_API_TOKEN" in error["message"]
        # GET /health stays open: the sampler's and Docker's health checks take no token.
        assert http.get("/health").status_code == 200
        # No login page and no cookie on an inference server: `?token=` and a cookie open nothing.
        assert http.get("/v1/models", params={"token": TOKEN}).status_code == 401
        assert http.get("/", params={"token": TOKEN}, headers={"Accept": "text/html"}).status_code == 401


def test_cpu_server_guards_every_route_but_health(guarded: ServerHandle):
    _walk_all_but_health(guarded.url, guarded.app)
    with httpx.Client(base_url=guarded.url, timeout=60) as http:
        for method, path in DANGEROUS:
            assert http.request(method, path, json={}).status_code == 401, path
        # Refused means not done: the engine is not paused, the version not relabelled.
        assert http.post("/pause", params={"mode": "abort"}).status_code == 401
        assert http.post("/update_weight_version", json={"new_version": "7"}).status_code == 401
        assert http.get("/is_paused", headers=AUTH).json() == {"is_paused": False}
        assert http.get("/weight_info", headers=AUTH).json()["weight_version"] != "7"
        # With the token the same doors work.
        completion = http.post("/v1/completions", json=COMPLETION, headers=AUTH)
        assert completion.status_code == 200 and completion.json()["choices"], completion.text[:300]
        assert http.post("/pause", params={"mode": "abort"}, headers=AUTH).json() == {"status": "paused"}
        assert http.get("/is_paused", headers=AUTH).json() == {"is_paused": True}
        assert http.post("/resume", headers=AUTH).status_code == 200
        assert http.get("/is_paused", headers=AUTH).json() == {"is_paused": False}
        for path in ("/metrics", "/version", "/v1/models"):
            assert http.get(path, headers=AUTH).status_code == 200, path


def test_standin_guards_every_route_but_health(guarded_standin: UvicornThread):
    _walk_all_but_health(guarded_standin.url, guarded_standin.server.config.app)
    with httpx.Client(base_url=guarded_standin.url, timeout=30) as http:
        for method, path in [*DANGEROUS, ("POST", "/_standin/configure"), ("POST", "/_standin/fail")]:
            assert http.request(method, path, json={}).status_code == 401, path
        assert http.get("/_standin/stats", headers=AUTH).json()["paused"] is False
        assert http.post("/pause", headers=AUTH).status_code == 200
        assert http.get("/_standin/stats", headers=AUTH).json()["paused"] is True
        assert http.post("/resume", headers=AUTH).status_code == 200
        completion = http.post("/v1/completions", json={"prompt": "1", "max_tokens": 2}, headers=AUTH)
        assert completion.status_code == 200, completion.text[:300]


def test_standin_process_takes_its_token_from_the_flag_or_the_environment(tmp_path: Path):
    started = []
    for name, extra, env in (("flag", ["--api-token", TOKEN], _env_without_token()),
                             ("env", [], {**_env_without_token(), "TANDEM_API_TOKEN": TOKEN})):
        port = free_port()
        proc = ServiceProcess([sys.executable, "-m", "services.inference.standin", "--port", str(port), *extra],
                              name=f"stand-in ({name})", log_path=tmp_path / f"{name}.log", env=env,
                              ready_url=f"http://127.0.0.1:{port}/health")
        started.append((proc, f"http://127.0.0.1:{port}"))
    try:
        for proc, url in started:
            proc.wait_ready(60)
            assert httpx.post(url + "/pause", timeout=10).status_code == 401
            assert httpx.get(url + "/weight_info", timeout=10).status_code == 401
            assert httpx.get(url + "/weight_info", headers=AUTH, timeout=10).status_code == 200
    finally:
        for proc, _ in started:
            proc.terminate()


def _env_without_token() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("TANDEM_API_TOKEN", "TANDEM_INSECURE_NO_TOKEN")}


def _inference(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "inference", *args], cwd=REPO, capture_output=True,
                          text=True, env=env, timeout=60)


def test_inference_refuses_a_public_host_without_a_token(tiny_model: Path, tmp_path: Path):
    for host in ("0.0.0.0", "::"):
        result = _inference("--host", host, "--port", str(free_port()), "--model", str(tiny_model),
                            env=_env_without_token())
        assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert lines[0].startswith("tandem inference: "), lines[0]
        assert "TANDEM_API_TOKEN" in lines[0] and "--insecure-no-token" in lines[0] and host in lines[0]

    # With --insecure-no-token, or with the run's token in the environment, the check passes:
    # the next check (the model directory, before torch is imported) is the one that answers.
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    for extra, env in ((["--insecure-no-token"], _env_without_token()),
                       ([], {**_env_without_token(), "TANDEM_API_TOKEN": TOKEN}),
                       (["--api-token", TOKEN], _env_without_token())):
        result = _inference("--host", "0.0.0.0", "--port", str(free_port()), "--model", str(not_a_model), *extra,
                            env=env)
        assert result.returncode == 2, result.stderr
        assert "not a Hugging Face model directory" in result.stderr and "TANDEM_API_TOKEN" not in result.stderr, (
            extra, result.stderr)


def test_inference_on_a_public_host_with_the_token_from_the_environment(tiny_model: Path, tmp_path: Path):
    """`tandem demo` hands the token to its inference server as TANDEM_API_TOKEN: started that
    way on 0.0.0.0, the real server gets past the refusal, becomes healthy and is closed."""
    port = free_port()
    argv = [sys.executable, "-m", "services.cli", "inference", "--host", "0.0.0.0", "--port", str(port),
            "--model", str(tiny_model), "--served-model-name", "tiny", "--log-level", "warning"]
    proc = ServiceProcess(argv, name="inference", log_path=tmp_path / "inference.log",
                          env={**_env_without_token(), "TANDEM_API_TOKEN": TOKEN},
                          ready_url=f"http://127.0.0.1:{port}/health")
    try:
        proc.wait_ready(90)
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        assert httpx.post(url + "/pause", timeout=10).status_code == 401
        assert httpx.get(url + "/v1/models", headers=AUTH, timeout=10).status_code == 200
    finally:
        proc.terminate()
    assert proc.popen.returncode is not None
