"""The harness's calls to verifiers' interception server in-process
(services/sampler/rollouts/vf/local_interception.py): the server's own handlers answer them as
they answer the same request over HTTP; only rollouts whose model calls stay in-process
take that path."""

from __future__ import annotations

import aiohttp
import pytest
from pydantic_core import to_json
from verifiers.v1.interception.server import InterceptionServer

from services.sampler.rollouts.vf import local_interception
from services.sampler.rollouts.vf.harness import _HttpRoute

pytestmark = pytest.mark.timeout(60)


async def test_a_refused_request_is_answered_alike_over_http_and_in_process():
    server = InterceptionServer()
    async with server, aiohttp.ClientSession() as http:
        over_http = _HttpRoute(http, "no-such-rollout")
        local = local_interception.LocalRoute(server, "no-such-rollout", timeout=30.0)
        requests = [
            ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
            ("/tool", {"tool_call_id": "c1", "name": "add", "arguments": {"a": 1}}),
            ("/v1/no-such-route", {}),
        ]
        for path, body in requests:
            url = server.base_url + path
            answered = await over_http.post(url, to_json(body))
            assert await local.post(url, to_json(body)) == answered
            assert answered[0] in (401, 404), answered
        with pytest.raises(ValueError, match="not on the interception server"):
            await local.post("http://127.0.0.1:1/v1/chat/completions", b"{}")


async def test_only_a_held_server_is_routed_to_and_only_for_its_rollouts():
    server = InterceptionServer()
    async with server:
        endpoint = server.base_url + "/v1"
        assert local_interception.route(endpoint, "no-such-rollout", 30.0) is None  # not held
        with local_interception.held(server):
            # Held, but the bearer is no rollout's: over HTTP, which answers 401 for it.
            assert local_interception.route(endpoint, "no-such-rollout", 30.0) is None
            assert local_interception.route("http://127.0.0.1:1/v1", "no-such-rollout", 30.0) is None
        assert local_interception._held == {}
        with local_interception.held(None):  # an env without an interception: nothing held
            assert local_interception._held == {}
