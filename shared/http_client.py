"""A thin async HTTP client (aiohttp underneath) for Tandem's service-to-service traffic.

Two hot paths use it: the sampler's inference traffic (thousands of small JSON requests a
second) and the trainer's batch hand-off (`SamplerClient`, megabytes per request). Against
the stand-in at 64 concurrent requests of n = 16, httpx spent 9-13 ms of client CPU per
request (its pool scans and polls every idle connection on each request), aiohttp about
1 ms; a 1 MiB `GET /batch` took httpx 3.6-6.6 ms and aiohttp 1.6 ms on the same sampler
(2-core VM). It gives callers three things: `request()` returning a `Reply` (status, content
type, body, `.json()` via orjson), one exception type for every transport failure
(`TransportError`: refused, reset, dropped, timed out), and a session created inside the
running event loop.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from shared.http_into import ResponseError, get_into


class TransportError(Exception):
    """The request did not get an HTTP answer: connection refused or dropped, or a timeout."""


@dataclass
class Reply:
    status_code: int
    content: Any  # bytes, or the buffer `request(into=...)` made
    content_type: str | None = None

    def json(self) -> Any:
        return orjson.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")


class HttpClient:
    def __init__(self, *, max_connections: int, timeout: float, connect_timeout: float = 10.0,
                 headers: dict[str, str] | None = None):
        self.max_connections = max_connections
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.headers = headers or {}
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=self.connect_timeout),
                headers=self.headers,
                json_serialize=lambda obj: orjson.dumps(obj).decode(),
            )
        return self._session

    async def request(self, method: str, url: str, *, json: Any = None, params: dict[str, Any] | None = None,
                      headers: dict[str, str] | None = None, timeout: float | None = None,
                      into: Callable[[int], Any] | None = None) -> Reply:
        """`into(n)`: for a 200 answer of known length n, a writable buffer of n bytes the body
        is received into: by the event loop itself for a plain http:// GET (shared/http_into.py:
        the kernel's copy is the only one), else from aiohttp's reads (no joining of pieces)."""
        if into is not None and method == "GET" and url.startswith("http://"):
            return await self._get_into(url, params, headers, timeout, into)
        session = self._get_session()
        kwargs: dict[str, Any] = {"headers": dict(headers or {})}
        if json is not None:
            kwargs["data"] = orjson.dumps(json)
            kwargs["headers"]["content-type"] = "application/json"
        if params:
            kwargs["params"] = {k: str(v) for k, v in params.items()}
        if timeout is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, self.connect_timeout))
        try:
            async with session.request(method, url, **kwargs) as response:
                length = response.content_length
                if into is None or response.status != 200 or length is None:
                    body = await response.read()
                else:
                    body = await _read_into(response, into(length), length, url)
                return Reply(response.status, body, response.headers.get("content-type"))
        except asyncio.TimeoutError as exc:
            raise TransportError(f"TimeoutError: no answer from {url} within {timeout or self.timeout}s") from exc
        except aiohttp.ClientConnectorError as exc:
            raise TransportError(f"ConnectError: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc

    async def _get_into(self, url: str, params: dict[str, Any] | None, headers: dict[str, str] | None,
                        timeout: float | None, into: Callable[[int], Any]) -> Reply:
        """A GET whose 200 body the loop receives into `into(length)` (shared/http_into.py): the
        batch hand-off's path, one copy instead of aiohttp's several."""
        total = timeout or self.timeout
        try:
            status, body, content_type = await get_into(
                url, params={k: str(v) for k, v in (params or {}).items()}, headers={**self.headers, **(headers or {})},
                timeout=total, connect_timeout=min(total, self.connect_timeout), into=into)
        except TimeoutError as exc:
            raise TransportError(f"TimeoutError: no answer from {url} within {total}s") from exc
        except (OSError, ResponseError) as exc:
            # The names aiohttp's errors give (the retry loop's log lines read the same either way).
            kind = "ConnectError" if isinstance(exc, (ConnectionRefusedError, socket.gaierror)) else type(exc).__name__
            raise TransportError(f"{kind}: {exc}") from exc
        return Reply(status, body, content_type)

    async def get(self, url: str, *, timeout: float | None = None) -> Reply:
        return await self.request("GET", url, timeout=timeout)

    async def post(self, url: str, *, json: Any = None, timeout: float | None = None) -> Reply:
        return await self.request("POST", url, json=json, timeout=timeout)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _read_into(response: aiohttp.ClientResponse, buffer: Any, length: int, url: str) -> Any:
    view, at = memoryview(buffer), 0
    async for piece in response.content.iter_any():
        end = at + len(piece)
        if end > length:
            raise TransportError(f"{url} sent more than its Content-Length of {length} bytes")
        view[at:end] = piece
        at = end
    if at != length:
        raise TransportError(f"{url} closed the body after {at} of {length} bytes")
    return buffer
