"""A GET whose 200 body the event loop receives straight into the caller's buffer.

What the batch hand-off needs from HTTP (`SamplerClient.get_batch_body`): gigabytes in one
body, which must end up in one buffer. aiohttp hands a body over as bytes objects (the
loop's read buffer copied into bytes, pieces joined, then copied into the caller's buffer):
receiving 1 GiB from the sampler cost the client ~1.3 s of CPU on the 2-core machine while
the sampler spent ~0.2 s sending it, so the receiving side was the hand-off's bottleneck.
Here the protocol is an `asyncio.BufferedProtocol` whose buffer, once the head says 200
and gives a Content-Length, is the body's own (`into(length)`): the loop `recv_into`s it,
and the kernel's copy out of the socket is the only one.

Scope, kept small on purpose: plain `http://` (HttpClient sends https through aiohttp), one
connection per request (`Connection: close`; a long-poll is connected before its batch is
sealed, so the connection costs the hand-off no latency), the head parsed by httptools
(uvicorn's parser, a dependency already), and every framing HTTP/1.1 allows for the bodies
that are not the fast path (errors, chunked, until-close), which are small.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode, urlsplit

import httptools

# What one read takes while the head (and any body that is not received in place) is parsed.
_HEAD_READ = 1 << 16


class ResponseError(Exception):
    """The connection ended, or the server answered something that is not HTTP, before the
    response was complete (HttpClient turns it into its TransportError)."""


class _Exchange(asyncio.BufferedProtocol):
    """One request's response: parsed by httptools until its head is complete; then a 200 of
    known length is received in place (`view`), anything else goes on through the parser."""

    def __init__(self, into: Callable[[int], Any] | None, url: str):
        self.into, self.url = into, url
        self.parser = httptools.HttpResponseParser(self)
        self.scratch = bytearray(_HEAD_READ)
        self.headers: dict[str, str] = {}
        self.head_done = False
        self.view: memoryview | None = None  # the body's buffer once it is received in place
        self.body: Any = None
        self.got = 0
        self.pieces: list[bytes] = []
        # The answer is kept here, not as the future's result, so that `release` can let go of it:
        # the transport holds this protocol until the loop's next turn.
        self.answer: tuple[int, Any, str | None] | None = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Set once a body is being received in place (`view`): the rest may go to a thread.
        self.in_place: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # --- asyncio -------------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> Any:
        if self.view is not None and self.got < len(self.view):
            return self.view[self.got:]
        return self.scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self.done.done() or self.parser is None:
            return
        if self.view is not None:
            self.got += nbytes
            if self.got == len(self.view):
                self._finish(self.body)
            return
        try:
            self.parser.feed_data(memoryview(self.scratch)[:nbytes])
        except httptools.HttpParserCallbackError as exc:  # raised by a callback here (`into`: MemoryError)
            self._fail(exc.__context__ if isinstance(exc.__context__, Exception) else exc)
        except httptools.HttpParserError as exc:
            self._fail(ResponseError(f"{self.url} answered something that is not HTTP/1.1: {exc}"))

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost decides whether the body was whole

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done.done():
            return
        if self.head_done and self.view is None and self._until_close():
            self._finish(b"".join(self.pieces))  # a body framed by the connection's end
        elif self.view is not None:
            self._fail(ResponseError(f"{self.url} closed the body after {self.got} of {len(self.view)} bytes"))
        else:
            why = f": {exc}" if exc else ""
            self._fail(ResponseError(f"{self.url} closed the connection before a whole answer{why}"))

    # --- httptools callbacks -----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.head_done = True
        length = self.headers.get("content-length")
        status = self.parser.get_status_code()
        if self.into is not None and status == 200 and length is not None and not self._chunked():
            self.body = self.into(int(length))
            self.view = memoryview(self.body).cast("B")
            if not len(self.view):
                self._finish(self.body)
            elif not self.in_place.done():
                self.in_place.set_result(None)

    def on_body(self, data: bytes) -> None:
        if self.view is None:
            self.pieces.append(data)
            return
        # Body bytes that came in the same read as the head; the rest arrives in place.
        end = min(self.got + len(data), len(self.view))
        self.view[self.got:end] = data[:end - self.got]
        self.got = end
        if self.got == len(self.view):
            self._finish(self.body)

    def on_message_complete(self) -> None:
        if self.view is None:
            self._finish(b"".join(self.pieces))

    # --- the outcome ---------------------------------------------------------------------

    def _chunked(self) -> bool:
        return "chunked" in self.headers.get("transfer-encoding", "").lower()

    def _until_close(self) -> bool:
        return "content-length" not in self.headers and not self._chunked()

    def _finish(self, body: Any) -> None:
        if not self.done.done():
            self.answer = (self.parser.get_status_code(), body, self.headers.get("content-type"))
            self.done.set_result(None)

    def _fail(self, exc: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(exc)

    def release(self) -> None:
        """Drop the parser (it refers back to this protocol: a cycle that only the cyclic GC would
        free, holding the body's buffer until then) and the views of the body."""
        self.parser = self.view = self.body = self.answer = None  # type: ignore[assignment]
        self.pieces = []


def request_bytes(url: str, params: dict[str, Any] | None, headers: dict[str, str]) -> bytes:
    """The GET request's bytes (`Connection: close`: one request per connection)."""
    parts = urlsplit(url)
    target = parts.path or "/"
    query = "&".join(q for q in (parts.query, urlencode(params or {})) if q)
    if query:
        target += "?" + query
    lines = [f"GET {target} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close", "Accept-Encoding: identity"]
    lines += [f"{name}: {value}" for name, value in headers.items()
              if name.lower() not in ("host", "connection", "accept-encoding", "content-length")]
    for line in lines:
        if "\r" in line or "\n" in line:
            raise ValueError(f"a request header holds a line break: {line!r}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def get_into(url: str, *, params: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
                   timeout: float, connect_timeout: float,
                   into: Callable[[int], Any] | None) -> tuple[int, Any, str | None]:
    """(status, body, content type) of a GET of `url` (http:// only). A 200 with a
    Content-Length is received into `into(length)`; other bodies are bytes. TimeoutError past
    `timeout` seconds in all; OSError when the connection fails; ResponseError when it ends
    before the answer does."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"get_into takes http:// URLs, not {url!r}")
    data = request_bytes(url, params, headers or {})
    loop = asyncio.get_running_loop()
    exchange = _Exchange(into, url)
    async with asyncio.timeout(timeout):
        async with asyncio.timeout(connect_timeout):
            transport, _ = await loop.create_connection(lambda: exchange, parts.hostname, parts.port or 80)
        try:
            transport.write(data)
            await asyncio.wait([exchange.done, exchange.in_place], return_when=asyncio.FIRST_COMPLETED)
            if not exchange.done.done():
                await _rest_in_a_thread(transport, exchange)
            await exchange.done
            answer = exchange.answer
            assert answer is not None
            return answer
        finally:
            # An answer received whole leaves nothing unread; any other end drops the connection.
            if exchange.done.done() and not exchange.done.cancelled() and exchange.done.exception() is None:
                transport.close()
            else:
                transport.abort()
            exchange.release()  # the body goes back (a pooled buffer: to its pool) as soon as the caller drops it


# A body with at least this much left once its head is in is received by a thread of its own.
THREAD_BYTES = 4 << 20


async def _rest_in_a_thread(transport: asyncio.Transport, exchange: _Exchange) -> None:
    """Receive the rest of an in-place body with one blocking `recv_into(MSG_WAITALL)` on a
    thread of its own, the transport's reading paused meanwhile. The event loop otherwise
    wakes for every ~160 KB the socket holds (3,300 `recv_into` calls for 512 MiB, each an
    epoll round and a protocol callback); one call that returns when the body is complete
    leaves the event loop free and took less time on the 2-core machine (512 MiB over bare
    loopback sockets: median 172 against 179 ms; a 1 GiB batch from the sampler in the hand-off
    bench: 397-401 against 434-470 ms). A no-op (the loop goes on receiving) for a short rest, or
    while the request is still being written (the socket is switched to blocking for the
    thread: the loop must not write to it meanwhile)."""
    sock = transport.get_extra_info("socket")
    view = exchange.view
    if (view is None or len(view) - exchange.got < THREAD_BYTES or sock is None or transport.get_write_buffer_size()
            or not hasattr(socket, "MSG_WAITALL")):
        return
    transport.pause_reading()
    own = socket.socket(fileno=os.dup(sock.fileno()))
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[tuple[int, BaseException | None]] = loop.create_future()
    start = exchange.got

    def receive() -> None:
        got, error = start, None
        try:
            own.setblocking(True)  # shared with the transport's descriptor: set back below
            while got < len(view):
                n = own.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
                if not n:
                    raise ResponseError(f"{exchange.url} closed the body after {got} of {len(view)} bytes")
                got += n
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            error = exc
        finally:
            own.setblocking(False)
            own.close()
        try:
            loop.call_soon_threadsafe(lambda: finished.done() or finished.set_result((got, error)))
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=receive, name="http-into-body", daemon=True).start()
    try:
        got, error = await asyncio.shield(finished)
    except asyncio.CancelledError:
        try:
            own.shutdown(socket.SHUT_RDWR)  # the thread's recv returns at once; the connection is dropped
        except OSError:  # the thread had finished (and closed its descriptor) meanwhile
            pass
        raise
    exchange.got = got
    if error is not None:
        exchange._fail(error if isinstance(error, Exception) else ResponseError(repr(error)))
    else:
        exchange._finish(exchange.body)
