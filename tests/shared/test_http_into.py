"""shared/http_into.py: a GET whose 200 body is received straight into the caller's buffer
(what SamplerClient's batch fetch uses), against a real sampler and against a raw socket
server that answers in each framing HTTP/1.1 allows, or breaks off."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import AsyncIterator, Callable

import httpx
import numpy as np
import pytest

from shared.chunks import FRAMES, alloc
from shared.client import SamplerClient
from shared.http_client import HttpClient, TransportError
from shared import http_into
from shared.http_into import get_into, request_bytes
from shared.recv_buffers import RecvBuffers
from tests.support.servers import refused_port


async def _raw_server(answer: Callable[[bytes], list[bytes]]) -> tuple[asyncio.AbstractServer, str, list[bytes]]:
    """A server that reads one request head and writes `answer(head)`'s pieces, then closes."""
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        heads.append(head)
        for piece in answer(head):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.01)  # the answer arrives in several reads
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", heads


@pytest.fixture
async def raw() -> AsyncIterator[Callable]:
    servers = []

    async def make(answer: Callable[[bytes], list[bytes]]) -> tuple[str, list[bytes]]:
        server, url, heads = await _raw_server(answer)
        servers.append(server)
        return url, heads

    yield make
    for server in servers:
        server.close()


async def test_a_200_of_known_length_lands_in_the_callers_buffer_whatever_the_reads(raw):
    body = bytes(range(256)) * 5000
    url, heads = await raw(lambda head: [b"HTTP/1.1 200 OK\r\nContent-Type: x/y\r\nContent-Length: "
                                         + str(len(body)).encode() + b"\r\n\r\n" + body[:7], body[7:1000], body[1000:]])
    made: list[bytearray] = []

    def into(n: int) -> bytearray:
        made.append(bytearray(n))
        return made[-1]

    status, got, content_type = await get_into(url + "/batch", params={"step": 3, "rank": 1},
                                               headers={"Authorization": "Bearer t"}, timeout=10,
                                               connect_timeout=5, into=into)
    assert (status, content_type) == (200, "x/y")
    assert got is made[0] and bytes(got) == body
    assert heads[0].startswith(b"GET /batch?step=3&rank=1 HTTP/1.1\r\n")
    assert b"Authorization: Bearer t\r\n" in heads[0] and b"Connection: close\r\n" in heads[0]


@pytest.mark.parametrize("framing", ["chunked", "until-close", "length"])
async def test_other_answers_come_back_as_bytes_in_every_framing(raw, framing):
    detail = b'{"detail": "batch 3 was trimmed"}'
    head = b"HTTP/1.1 410 Gone\r\nContent-Type: application/json\r\n"
    pieces = {
        "chunked": [head + b"Transfer-Encoding: chunked\r\n\r\n", b"%x\r\n" % 10 + detail[:10] + b"\r\n",
                    b"%x\r\n" % (len(detail) - 10) + detail[10:] + b"\r\n0\r\n\r\n"],
        "until-close": [head + b"\r\n", detail],
        "length": [head + b"Content-Length: %d\r\n\r\n" % len(detail), detail],
    }[framing]
    url, _ = await raw(lambda _: pieces)
    status, got, content_type = await get_into(url + "/batch", timeout=10, connect_timeout=5, into=alloc)
    assert (status, bytes(got), content_type) == (410, detail, "application/json")


async def test_a_chunked_200_is_not_received_in_place_but_whole(raw):
    url, _ = await raw(lambda _: [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"])
    status, got, _ = await get_into(url, timeout=10, connect_timeout=5, into=alloc)
    assert (status, bytes(got)) == (200, b"abc")


async def test_a_body_cut_short_a_refused_connection_and_garbage_are_transport_errors(raw):
    http = HttpClient(max_connections=2, timeout=10)
    try:
        short, _ = await raw(lambda _: [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", b"x" * 40])
        with pytest.raises(TransportError, match="closed the body after 40 of 100 bytes"):
            await http.request("GET", short + "/batch", into=alloc)
        garbage, _ = await raw(lambda _: [b"SMTP ready\r\n\r\n"])
        with pytest.raises(TransportError, match="not HTTP/1.1"):
            await http.request("GET", garbage + "/batch", into=alloc)
        silent, _ = await raw(lambda _: [])
        with pytest.raises(TransportError, match="closed the connection before a whole answer"):
            await http.request("GET", silent + "/batch", into=alloc)
        with refused_port() as port:
            with pytest.raises(TransportError, match="^ConnectError"):
                await http.request("GET", f"http://127.0.0.1:{port}/batch", into=alloc)
        stalled, _ = await raw(lambda _: [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"] + [b""] * 100)
        with pytest.raises(TransportError, match="^TimeoutError: no answer .* within 0.3s"):
            await http.request("GET", stalled + "/batch", into=alloc, timeout=0.3)
    finally:
        await http.aclose()


def test_a_header_with_a_line_break_is_refused():
    with pytest.raises(ValueError, match="line break"):
        request_bytes("http://h/batch", None, {"X-A": "1\r\nX-B: 2"})


async def test_the_client_receives_bodies_byte_identical_to_the_sampler_s(make_sampler):
    """Whole batch and shares (whole chunks and re-encoded edges) through the in-place path equal
    what another HTTP client receives; JSON and msgpack still go through aiohttp."""
    # 64 samples of ~6.5 KB in chunks of about 64 KiB: share edges (every 8 or 16 samples) cut chunks.
    sampler = make_sampler(prompts_per_step=16, num_generations=4, max_tokens=450, temperature=0.0,
                           batch_chunk_bytes=64 << 10, max_staleness=0, max_poll_timeout=5)
    async with SamplerClient(sampler.url, poll_timeout=5) as client, \
            httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        await client.get_batch_arrays(0, timeout=60)
        for rank, world_size in ((0, 1), (0, 4), (1, 4), (3, 8), (7, 8)):
            content_type, body = await client.get_batch_body(0, rank, world_size, timeout=10)
            reference = await http.get("/batch", params={"step": 0, "rank": rank, "world_size": world_size},
                                       headers={"Accept": FRAMES})
            assert content_type == FRAMES == reference.headers["content-type"]
            assert not isinstance(body, bytes)  # the buffer `alloc` made, received in place
            assert bytes(body) == reference.content, (rank, world_size)
        for encoding in ("json", "msgpack"):
            async with SamplerClient(sampler.url, encoding=encoding, poll_timeout=5) as other:
                assert (await other.get_batch_raw(0, 1, 4))["rank"] == 1


async def test_a_buffer_that_cannot_be_made_is_the_callers_error_not_a_transport_one(raw):
    url, _ = await raw(lambda _: [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nabcde"])

    def into(n: int) -> bytearray:
        raise MemoryError(f"no room for {n} bytes")

    with pytest.raises(MemoryError, match="no room for 5 bytes"):
        await get_into(url, timeout=10, connect_timeout=5, into=into)


async def test_a_body_dropped_by_the_caller_is_free_at_once_without_the_cyclic_collector(raw):
    """Nothing of the exchange keeps the body alive once the caller drops it: a pooled buffer is
    back in its pool at once (a parser <-> protocol cycle held it until a gc pass)."""
    body = b"z" * (3 << 20)
    url, _ = await raw(lambda _: [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body), body])
    pool = RecvBuffers()
    gc.disable()
    try:
        _, got, _ = await get_into(url, timeout=10, connect_timeout=5, into=pool.take)
        assert bytes(got) == body and pool.free_bytes == 0
        del got
        assert pool.free_bytes >= len(body)
    finally:
        gc.enable()


@pytest.fixture
def body_threads(monkeypatch) -> list[threading.Thread]:
    """Every thread get_into starts to receive the rest of a body (the threshold lowered to
    1 MiB, so that the bodies here take that path)."""
    started: list[threading.Thread] = []

    class Recorded(threading.Thread):
        def start(self) -> None:
            started.append(self)
            super().start()

    monkeypatch.setattr(http_into, "THREAD_BYTES", 1 << 20)
    monkeypatch.setattr(http_into.threading, "Thread", Recorded)
    return started


def _head(length: int) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: x/y\r\nContent-Length: %d\r\n\r\n" % length


async def test_the_rest_of_a_large_body_is_received_by_a_thread_in_place(raw, body_threads):
    body = np.random.default_rng(0).integers(0, 256, 6 << 20, dtype=np.uint8).tobytes()
    url, _ = await raw(lambda _: [_head(len(body)) + body[:1000], body[1000:3 << 20], body[3 << 20:]])
    pool = RecvBuffers()
    status, got, _ = await get_into(url, timeout=10, connect_timeout=5, into=pool.take)
    assert status == 200 and bytes(got) == body and not isinstance(got, bytes)
    assert [t.name for t in body_threads] == ["http-into-body"]
    body_threads[0].join(5)
    assert not body_threads[0].is_alive()


async def test_a_short_rest_stays_on_the_event_loop(raw, body_threads):
    body = b"s" * (1 << 20)  # the rest after the head's read is under the threshold
    url, _ = await raw(lambda _: [_head(len(body)) + body[:10], body[10:]])
    _, got, _ = await get_into(url, timeout=10, connect_timeout=5, into=alloc)
    assert bytes(got) == body and body_threads == []


async def test_a_body_cut_short_or_stalled_in_the_thread_is_a_transport_error_and_the_thread_ends(raw, body_threads):
    http = HttpClient(max_connections=2, timeout=10)
    length, sent = 8 << 20, 5 << 20
    try:
        short, _ = await raw(lambda _: [_head(length) + b"c" * 100, b"c" * (sent - 100)])
        with pytest.raises(TransportError, match=f"closed the body after {sent} of {length} bytes"):
            await http.request("GET", short + "/batch", into=alloc)
        stalled, _ = await raw(lambda _: [_head(length) + b"c" * 100, b"c" * (sent - 100)] + [b""] * 200)
        started = time.monotonic()
        with pytest.raises(TransportError, match="^TimeoutError: no answer .* within 0.5s"):
            await http.request("GET", stalled + "/batch", into=alloc, timeout=0.5)
        assert time.monotonic() - started < 1.5
    finally:
        await http.aclose()
    assert len(body_threads) == 2
    for thread in body_threads:  # the stalled one is woken by the cancellation, not the server's close
        thread.join(0.5)
        assert not thread.is_alive()
