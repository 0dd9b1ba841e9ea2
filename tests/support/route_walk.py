"""Walk every route of a live Tandem server and check that the run's token closes it.

The list of routes is derived from the app itself (`app_routes`: every route of `app.routes`,
through included routers and mounts) and from its OpenAPI schema (`schema_routes`), never
written down by hand, so a route added later is walked too. `concrete` fills path parameters
with a value, `check_closed` asks each route without a token and with a wrong one and
collects every answer that is not a 401.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import httpx

WRONG = "not-the-run-token"
# Every method a route might answer; a path is asked with each, so a method added to a path
# later is covered as well (anything the guard lets through would answer 405 or worse).
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
_PARAM = re.compile(r"\{([^}:]+)(?::[^}]*)?\}")


def _walk(routes: Iterable[Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    for route in routes:
        # FastAPI >= 0.16x keeps an included router as one route holding the original router.
        original = getattr(route, "original_router", None)
        if original is not None:
            context = getattr(route, "include_context", None)
            yield from _walk(original.routes, prefix + (getattr(context, "prefix", "") or ""))
            continue
        path = getattr(route, "path", None)
        if path is None:
            raise AssertionError(f"a route this walk cannot read: {route!r}; teach tests/support/route_walk.py")
        inner = getattr(route, "routes", None)
        methods = getattr(route, "methods", None)
        if methods is None:
            # A mount (StaticFiles, a sub-app): a file or path beneath it.
            if inner:
                yield from _walk(inner, prefix + path)
            yield "GET", prefix + path.rstrip("/") + "/anything.js"
            continue
        for method in methods:
            yield method.upper(), prefix + path


def app_routes(app: Any) -> set[tuple[str, str]]:
    """(method, path template) of every route the app serves, schema or not."""
    return set(_walk(app.routes))


def schema_routes(schema: dict[str, Any]) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, ops in schema["paths"].items() for method in ops
            if method.upper() in METHODS}


def concrete(path: str) -> str:
    """A path template with a value in each parameter: `/eval/{eval_id}` -> `/eval/x1`."""
    return _PARAM.sub(lambda m: "x1", path)


def check_closed(client: httpx.Client, routes: Iterable[tuple[str, str]], *, token_header: str = "Authorization",
                 wrong: str = WRONG) -> list[str]:
    """Ask every route without a token and with a wrong one; return what did not answer 401."""
    leaks = []
    for method, path in sorted(routes):
        url = concrete(path)
        for label, headers in (("no token", {}), ("wrong token", {token_header: f"Bearer {wrong}"})):
            response = client.request(method, url, headers=headers)
            if response.status_code != 401:
                leaks.append(f"{method} {url} ({label}): {response.status_code} {response.text[:120]!r}")
    return leaks


def every_method(paths: Iterable[str]) -> set[tuple[str, str]]:
    return {(method, path) for path in paths for method in METHODS}
