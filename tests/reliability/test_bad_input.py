"""Bad input against a live sampler process: fuzzing from its own OpenAPI schema (read and
called with the run's token, which every route but /health and /metrics needs), bearer-token
auth on every mutating operation, 413 for oversized bodies, hostile values the schema allows,
and a dashboard that shows model output as text.

The mutating operations are discovered from GET /openapi.json (every non-GET operation),
so an endpoint added later is covered without editing this file.
"""

from __future__ import annotations

import json

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from services.sampler.api.routes.dashboard import STATIC
from tests.reliability.support import Cleanup, kill_embedded_redis, stop_process, wait_for
from tests.support.servers import start_sampler_process, start_standin

TOKEN = "reliability-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_BODY = 4096


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A sampler process with api_token and a small body limit, on a stand-in."""
    cleanup = Cleanup()
    try:
        standin = start_standin()
        cleanup.add(standin.stop)
        run_dir = tmp_path_factory.mktemp("fuzz") / "sampler"
        cleanup.add(lambda: kill_embedded_redis(run_dir))
        sampler = start_sampler_process(run_dir, inference_urls=[standin.url], env="tests.support.envs:CountEnv",
                                        prompts_per_step=2, num_generations=2, max_tokens=4, api_token=TOKEN,
                                        max_body_bytes=MAX_BODY, max_poll_timeout=0.5, eval_examples=2,
                                        eval_concurrency=2)
        cleanup.add(lambda: stop_process(sampler))
        schema = httpx.get(f"{sampler.url}/openapi.json", timeout=10, headers=AUTH)
        assert schema.status_code == 200, (schema.status_code, schema.text[:200])
        schema_doc = schema.json()
        yield {"sampler": sampler, "url": sampler.url, "standin": standin, "schema": schema_doc}
    finally:
        cleanup.run()


def _operations(schema_doc: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method.upper(), path, op) for path, item in schema_doc["paths"].items()
            for method, op in item.items() if method in ("get", "post", "put", "patch", "delete")]


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "abc123", path)


def _valid_body(op: dict[str, Any]) -> dict[str, Any] | None:
    """A minimal body the operation accepts (so that only auth can refuse it)."""
    if "requestBody" not in op:
        return None
    return {"version": 0} if "weights" in op.get("operationId", "") else {}


def test_fuzzing_from_the_schema_finds_no_server_error(live: dict[str, Any]) -> None:
    """Schemathesis cases (valid and invalid) for every operation in GET /openapi.json: no 5xx.

    Driven through Hypothesis directly rather than schemathesis' pytest plugin, whose lazy
    fixture loader does not work with pytest 9; the cases and bounds are the same.
    """
    # The schema is guarded like every route but /health and /metrics: it is read with the token.
    loaded = schemathesis.openapi.from_url(f"{live['url']}/openapi.json", headers=AUTH, timeout=10)
    operations = [result.ok() for result in loaded.get_all_operations()]
    labels = {op.label for op in operations}
    assert {"GET /batch", "POST /weights_version", "POST /eval", "GET /eval/{eval_id}", "GET /status"} <= labels
    calls: dict[str, int] = {}
    seen: list[int] = []
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=30, deadline=None, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck), database=None)
        def no_server_error(case: Any) -> None:
            # Authorized, so that the fuzzer reaches the handlers behind the bearer check.
            response = case.call(headers=AUTH, timeout=15)
            seen.append(response.status_code)
            # Never the token guard's 401: every case reaches the routes (or the fuzzing proves nothing).
            assert response.status_code != 401, (case.method, case.formatted_path, response.text[:300])
            assert response.status_code < 500, (
                f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:500]}\n"
                f"query={case.query} body={case.body!r}"
            )

        no_server_error()
        calls[operation.label] = len(seen)
        seen.clear()
        assert live["sampler"].popen.poll() is None, f"the sampler died fuzzing {operation.label}"
    assert all(calls.get(label, 0) >= 1 for label in labels), calls


def test_every_mutating_operation_requires_the_token(live: dict[str, Any]) -> None:
    url = live["url"]
    mutating = [(m, p, op) for m, p, op in _operations(live["schema"]) if m != "GET"]
    assert {(m, p) for m, p, _ in mutating} >= {("POST", "/weights_version"), ("POST", "/eval")}
    with httpx.Client(base_url=url, timeout=15) as http:
        for method, path, op in mutating:
            body = _valid_body(op)
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                            {"Authorization": f"Basic {TOKEN}"}):
                response = http.request(method, _concrete(path), json=body, headers=headers)
                assert response.status_code == 401, (method, path, headers, response.status_code, response.text)
                assert response.headers.get("www-authenticate", "").lower().startswith("bearer")
            allowed = http.request(method, _concrete(path), json=body, headers=AUTH)
            assert allowed.status_code not in (401, 403) and allowed.status_code < 500, \
                (method, path, allowed.status_code, allowed.text)
        # Reads are closed too (every route but /health and /metrics): /status takes the token.
        assert http.get("/status").status_code == 401
        assert http.get("/status", headers=AUTH).status_code == 200
        assert http.get("/health").status_code == 200


def test_non_finite_numbers_in_bodies_are_422_not_500(live: dict[str, Any]) -> None:
    """Python's JSON reader takes NaN and Infinity; the 422 that echoes them must still encode."""
    url = live["url"]
    with_body = [(m, p, op) for m, p, op in _operations(live["schema"]) if m != "GET"]
    with httpx.Client(base_url=url, timeout=15) as http:
        for method, path, op in with_body:
            valid = _valid_body(op) or {}
            bodies = ['{"junk": NaN}', '{"version": Infinity, "junk": -Infinity}']
            bodies += [json.dumps({**valid, key: 0}).replace(f'"{key}": 0', f'"{key}": NaN')
                       for key in valid]
            for body in bodies:
                response = http.request(method, _concrete(path), content=body,
                                        headers={**AUTH, "content-type": "application/json"})
                assert 400 <= response.status_code < 500, (method, path, body, response.status_code, response.text)
        assert http.get("/health").status_code == 200


def test_oversized_bodies_are_413_on_every_operation_that_takes_one(live: dict[str, Any]) -> None:
    url = live["url"]
    with_body = [(m, p) for m, p, op in _operations(live["schema"]) if m != "GET"]
    assert with_body
    big = b'{"version": 1, "checkpoint_path": "' + b"x" * (MAX_BODY * 4) + b'"}'

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit must count what streams in
        for start in range(0, len(big), 1000):
            yield big[start:start + 1000]

    with httpx.Client(base_url=url, timeout=15) as http:
        for method, path in with_body:
            for streamed in (False, True):
                for headers in (AUTH, {}):
                    response = http.request(method, _concrete(path), content=chunked() if streamed else big,
                                            headers={**headers, "content-type": "application/json"})
                    # The run token is checked before anything else (TokenGuard is the outermost
                    # layer): without it 401, declared length or not; with it, the body limit.
                    expected = {413} if headers else {401}
                    assert response.status_code in expected, (method, path, streamed, response.status_code,
                                                              response.text[:200])
                    if response.status_code == 413:
                        assert str(MAX_BODY) in response.json()["detail"]
        assert http.get("/health").status_code == 200


def test_hostile_values_the_schema_allows(tmp_path: Path, cleanup: Cleanup) -> None:
    standin = start_standin()  # a fresh sampler: the fuzzer may have published any version up to 2**53
    cleanup.add(standin.stop)
    run_dir = tmp_path / "sampler"
    cleanup.add(lambda: kill_embedded_redis(run_dir))
    sampler = start_sampler_process(run_dir, inference_urls=[standin.url], env="tests.support.envs:CountEnv",
                                    prompts_per_step=2, num_generations=2, max_tokens=4, api_token=TOKEN)
    cleanup.add(lambda: stop_process(sampler))
    url, live = sampler.url, {"sampler": sampler}
    with httpx.Client(base_url=url, timeout=30, headers=AUTH) as http:
        # An eval's env is a name, never an import path: os:abort used to kill the sampler.
        for env in ("os:abort", "sys:exit", "subprocess:Popen", "no.such.module:Env"):
            response = http.post("/eval", json={"env": env, "num_examples": 1})
            assert response.status_code == 422, (env, response.status_code, response.text)
            assert env in response.json()["detail"]
        assert live["sampler"].popen.poll() is None
        # Versions beyond what Redis's Lua numbers hold exactly are refused, not stored mangled.
        for version in (2**53 + 1, 2**63, 10**30):
            response = http.post("/weights_version", json={"version": version})
            assert response.status_code == 422, (version, response.text)
        assert http.get("/weights_version").status_code == 200
        # A big jump in the published version: the producer must not build every step in between.
        published = http.get("/weights_version").json()["version"]
        jump = published + 5000
        before = httpx.get(f"{standin.url}/_standin/stats").json()["requests"]
        assert http.post("/weights_version", json={"version": jump}).status_code == 200
        batch = wait_for(lambda: (r := http.get("/batch", params={"step": jump, "timeout": 0.5})).status_code == 200
                         and r, 20, f"batch {jump}")
        assert batch.json()["step"] == jump
        generated = httpx.get(f"{standin.url}/_standin/stats").json()["requests"] - before
        assert generated <= 2 * 4, f"{generated} generation requests after a version jump of 5000 steps"
        status = http.get("/status").json()
        assert status["steps"]["next_step"] >= jump


# -- the dashboard: model output is data, never markup ------------------------------------

HTML_SINKS = re.compile(r"\.(innerHTML|outerHTML)\s*[+]?=|insertAdjacentHTML|document\.write|\beval\(|new Function\(|"
                        r"createContextualFragment|setAttribute\(\s*['\"]on|\.srcdoc\s*=|DOMParser")


def test_dashboard_scripts_never_build_html_from_data() -> None:
    scripts = sorted(Path(STATIC).glob("*.js"))
    assert scripts, f"no scripts under {STATIC}"
    found = []
    for script in scripts:
        for number, line in enumerate(script.read_text().splitlines(), 1):
            code = line.split("//", 1)[0]
            if HTML_SINKS.search(code):
                found.append(f"{script.name}:{number}: {line.strip()}")
    assert not found, "HTML sinks in the dashboard (model output must go through textContent):\n" + "\n".join(found)
    html = (Path(STATIC) / "index.html").read_text()
    assert not re.search(r"\son[a-z]+\s*=", html), "inline event handlers in index.html"


HOSTILE = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script><b id="injected">x</b>'


def test_dashboard_renders_a_hostile_completion_as_text(tmp_path: Path, cleanup: Cleanup) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no Chromium (make test installs Debian's chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

    standin = start_standin()
    cleanup.add(standin.stop)
    assert httpx.post(f"{standin.url}/_standin/configure", json={"reply": HOSTILE}).status_code == 200
    run_dir = tmp_path / "sampler"
    cleanup.add(lambda: kill_embedded_redis(run_dir))
    sampler = start_sampler_process(run_dir, inference_urls=[standin.url], env="tests.support.envs:CountEnv",
                                    prompts_per_step=2, num_generations=2, max_tokens=len(HOSTILE) + 8)
    cleanup.add(lambda: stop_process(sampler))
    batch = httpx.get(f"{sampler.url}/batch", params={"step": 0, "timeout": 30}, timeout=40).json()
    # The stand-in's tokens are bytes: every completion is the hostile text.
    assert all(bytes(s["completion_token_ids"]).decode() == HOSTILE for s in batch["samples"])

    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=chromium, headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"])
        try:
            page = context.new_page()
            page.goto(f"{sampler.url}/?interval=200")
            page.wait_for_selector("#rollouts tbody tr td.completion", timeout=20000)
            shown = page.locator("#rollouts tbody tr td.completion").first.text_content()
            assert HOSTILE[:40] in shown, shown
            assert page.evaluate("window.__pwned") is None
            assert page.locator("#injected, #rollouts img, #rollouts script").count() == 0
        finally:
            context.close()

