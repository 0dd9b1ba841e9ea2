"""Tandem's harness for verifiers environments: the agent's chat loop, run in the sampler's
own event loop.

verifiers runs a seat's agent program through a harness. The stock ones start a program per
rollout (a `uv`-bootstrapped script, or a container), which costs a process and an install
per trajectory: at GRPO's thousands of trajectories a step that is most of the time spent.
This one is the loop itself, in-process: send the conversation to the rollout's model
endpoint (verifiers' interception server, which records the trace), run the tool calls the
answer makes on the task's MCP tool servers, send the results back, until an answer makes
no tool call. Every model call still goes through the interception endpoint, which is what
verifiers asks of a harness, so traces, limits, `@stop`s and request hooks all apply.

When the rollout's interception server is one the sampler holds and its model calls stay
in-process (`vf_client = in_process`), the calls to that server stay in-process too
(vf/local_interception.py: its route handlers, called without HTTP); otherwise they are
HTTP requests to the endpoint, as from a program outside the sampler.

It asks for non-streamed completions: the interception server generates a training turn
whole either way, so streaming would only add framing. Registered with verifiers under the id
`tandem-chat` (the top-level `tandem_chat` package, since verifiers imports harnesses by id).
"""

from __future__ import annotations

import asyncio
import json
import weakref
from contextlib import AsyncExitStack
from typing import Any, ClassVar, Protocol

import aiohttp
from pydantic_core import from_json, to_json
from verifiers.v1.clients import ModelContext
from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harness import Harness
from verifiers.v1.harnesses.utils.compaction import CONTEXT_OVERFLOW_MARKERS
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp
from verifiers.v1.runtimes import ProgramResult, Runtime
from verifiers.v1.task import TaskData
from verifiers.v1.trace import Trace

from services.sampler.rollouts.vf import local_interception

HARNESS_ID = "tandem-chat"


class TandemChatConfig(HarnessConfig):
    id: str = HARNESS_ID
    request_timeout: float = 600.0
    """Seconds one model call may take (a call waits through weight syncs)."""


class _Stopped(Exception):
    """The rollout refused a turn (a limit or a `@stop`): the trace says why; not a failure."""


class TandemChatHarness(Harness[TandemChatConfig]):
    APPENDS_SYSTEM_PROMPT = True   # the system prompt stays a system message
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True         # a user turn relaunches the loop on the conversation so far
    SUPPORTS_TOOL_INTERCEPTION = True
    EXECUTES_CODE = False          # it runs no code; tools are the task's servers
    NEEDS_CONTAINER = False

    # Shared by every instance: verifiers builds a new agent, and so a new harness object, for
    # every episode, so anything kept on `self` would last one episode.
    # MCP server set -> its tools as chat `tools` (_tool_schemas); the oldest go first.
    _tools_by_servers: ClassVar[dict[tuple, list[dict[str, Any]]]] = {}
    # One HTTP session per event loop for every rollout's model calls: its connections to the
    # interception server stay open between turns, and it is built once. aiohttp, not httpx:
    # httpx's pool checks every idle connection at each request, which with a connection per
    # rollout in flight cost more than the requests (make bench verifiers).
    _clients: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession]] = \
        weakref.WeakKeyDictionary()

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None or client.closed:
            client = self._clients[loop] = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.config.request_timeout),
                connector=aiohttp.TCPConnector(limit=0))
        return client

    @classmethod
    async def close_clients(cls) -> None:
        """Close the running loop's client (the sampler's shutdown, vf/environment.py)."""
        client = cls._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.close()

    async def launch(self, ctx: ModelContext, trace: Trace, runtime: Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: TaskData,
                     tool_interception_url: str | None = None) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages += [message_to_wire(m) for m in prompt]
        server = (local_interception.route(endpoint, secret, self.config.request_timeout)
                  or _HttpRoute(self._client(), secret))
        async with AsyncExitStack() as stack:
            tools = await self._tool_schemas(mcp_urls)
            mcp = _LazyTools(mcp_urls, self.config.tool_timeout, stack)
            try:
                while True:
                    message = await self._complete(server, endpoint, ctx.model, messages, tools)
                    messages.append(message)
                    calls = message.get("tool_calls") or []
                    if not calls:
                        break
                    for call in calls:
                        messages.append(await self._tool_message(server, call, mcp, tool_interception_url))
            except _Stopped:
                pass
            except _ModelCallFailed as exc:
                return ProgramResult(exit_code=1, stdout="", stderr=str(exc))
        return ProgramResult(exit_code=0, stdout="", stderr="")

    async def _tool_schemas(self, mcp_urls: dict[str, str]) -> list[dict[str, Any]]:
        """The tools the rollout's MCP servers offer, as chat `tools`. Listed once per set of
        servers: a taskset's shared servers are the same for every rollout, and opening an MCP
        client costs tens of milliseconds of the event loop."""
        if not mcp_urls:
            return []
        key = tuple(sorted(mcp_urls.items()))
        cache = self._tools_by_servers
        if key not in cache:
            async with AsyncExitStack() as stack:
                tools, _, _ = await connect_mcp(_servers_config(mcp_urls, self.config.tool_timeout), stack)
            if len(cache) >= TOOL_LISTS_KEPT:
                cache.pop(next(iter(cache)))
            cache[key] = tools
        return cache[key]

    async def _complete(self, server: _Route, endpoint: str, model: str, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "messages": messages}
        if tools:
            body["tools"] = tools
        status, raw = await server.post(f"{endpoint.rstrip('/')}/chat/completions", to_json(body))
        if status < 400:
            message = from_json(raw)["choices"][0]["message"]
            return {k: v for k, v in message.items() if v is not None}
        text = raw.decode("utf-8", "replace")
        if status == 400 and "rollout stopped" in text:
            raise _Stopped()
        if status in (400, 413) and any(m in text.casefold() for m in CONTEXT_OVERFLOW_MARKERS):
            # The context is full: the conversation ends here, as a budget, not a failure (the
            # sample's finish_reason says "length", vf/traces.py).
            raise _Stopped()
        raise _ModelCallFailed(f"model call answered {status}: {text[:500]}")

    async def _tool_message(self, server: _Route, call: dict[str, Any], mcp: _LazyTools,
                            gate_url: str | None) -> dict[str, Any]:
        """The `tool` message answering `call`: its result, or an error the model can act on."""
        name = call["function"]["name"]
        reply = {"role": "tool", "tool_call_id": call.get("id", ""), "name": name}
        try:
            arguments = json.loads(call["function"].get("arguments") or "{}")
        except ValueError as exc:
            return {**reply, "content": f"error: the arguments are not valid JSON ({exc}); send a JSON object"}
        if not isinstance(arguments, dict):
            return {**reply, "content": "error: the arguments must be a JSON object"}
        if gate_url:
            # The rollout's tool gate: a request hook may deny the call and give its result.
            status, raw = await server.post(gate_url, to_json({"tool_call_id": call.get("id"), "name": name,
                                                             "arguments": arguments}))
            if status >= 400:
                raise RuntimeError(f"the tool gate answered {status}: {raw[:500].decode('utf-8', 'replace')}")
            verdict = from_json(raw)
            if verdict["action"] == "stop":
                raise _Stopped()
            if verdict["action"] == "deny":
                return verdict["message"]
        try:
            dispatch, servers = await mcp.connected()
            if name not in dispatch:
                return {**reply, "content": f"error: there is no tool named {name!r}; the tools are "
                                            f"{', '.join(sorted(dispatch)) or 'none'}"}
            content = await call_mcp(servers, dispatch, name, arguments)
        except Exception as exc:  # noqa: BLE001 - a failing tool is an answer the model reads
            content = f"error: the tool failed: {type(exc).__name__}: {exc}"
        return {**reply, "content": content}


class _ModelCallFailed(Exception):
    pass


class _Route(Protocol):
    async def post(self, url: str, body: bytes) -> tuple[int, bytes]: ...


class _HttpRoute:
    """A rollout's calls to its interception server over HTTP (the endpoint is not one the
    sampler holds, or `vf_client = http`)."""

    def __init__(self, http: aiohttp.ClientSession, secret: str):
        self._http = http
        self._headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}

    async def post(self, url: str, body: bytes) -> tuple[int, bytes]:
        async with self._http.post(url, data=body, headers=self._headers) as response:
            return response.status, await response.read()


TOOL_LISTS_KEPT = 64


def _servers_config(mcp_urls: dict[str, str], timeout: float) -> dict[str, Any]:
    return {"mcpServers": {name: {"url": url, "timeout": timeout} for name, url in mcp_urls.items()}}


class _LazyTools:
    """MCP connections of one segment, opened at its first tool call (most turns make none)."""

    def __init__(self, mcp_urls: dict[str, str], timeout: float, stack: AsyncExitStack):
        self._config = _servers_config(mcp_urls, timeout)
        self._stack = stack
        self._connected: tuple[dict, dict] | None = None

    async def connected(self) -> tuple[dict, dict]:
        if self._connected is None:
            _, dispatch, servers = await connect_mcp(self._config, self._stack)
            self._connected = (dispatch, servers)
        return self._connected
