"""Start a real CPU inference server in-process, for tests, benchmarks and the demo.

    from services.inference.testing import start_server, running_server

    handle = start_server(model_dir, port=0, startup_timeout=60.0, **settings)
    handle.url        # "http://127.0.0.1:<port>"  (no /v1 suffix)
    handle.base_url   # handle.url + "/v1", for the openai SDK
    handle.engine     # the live Engine (stats, weight_version, ...)
    handle.stop()     # graceful shutdown; idempotent

    with running_server(model_dir, **settings) as handle: ...
    async with arunning_server(model_dir, **settings) as handle: ...   # from async code

`settings` are `InferenceSettings` fields (max_num_seqs, weight_version, seed, max_model_len,
served_model_name, ...). The server is a real uvicorn.Server on its own thread and event loop,
bound to a free port picked by the OS (port=0) before start, so there is no port race. Start-up
blocks until the app answers /health, or raises after `startup_timeout` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


@dataclass
class ServerHandle:
    url: str
    app: Any
    server: Any
    thread: threading.Thread
    _stopped: bool = field(default=False, repr=False)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def engine(self):
        return self.app.state.engine

    def stop(self, timeout: float = 30.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"inference server at {self.url} did not shut down within {timeout} s")


def start_server(model: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 0,
                 startup_timeout: float = 60.0, log_level: str = "warning", **settings: Any) -> ServerHandle:
    import uvicorn

    from services.inference.config import InferenceSettings
    from services.inference.server import create_app

    cfg = InferenceSettings(model=str(Path(model)), host=host, port=port, log_level=log_level, **settings)
    app = create_app(cfg)
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # accepted connections inherit it. Without it every JSON answer (headers and body in two
    # writes) waited ~40 ms for the client's delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5))
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            asyncio.run(server.serve(sockets=[sock]))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by the readiness wait below
            errors.append(exc)
        finally:
            sock.close()

    thread = threading.Thread(target=serve, name=f"tandem-inference-{bound_port}", daemon=True)
    thread.start()
    url = f"http://{host}:{bound_port}"
    handle = ServerHandle(url=url, app=app, server=server, thread=thread)
    deadline = time.monotonic() + startup_timeout
    while True:
        if errors or not thread.is_alive():
            raise RuntimeError(f"inference server for {model} failed to start: {errors[0] if errors else 'exited'}")
        if server.started:
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    return handle
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            handle.stop()
            raise TimeoutError(f"inference server for {model} at {url} not healthy within {startup_timeout} s")
        time.sleep(0.05)


@contextlib.contextmanager
def running_server(model: str | os.PathLike, **kwargs: Any) -> Iterator[ServerHandle]:
    handle = start_server(model, **kwargs)
    try:
        yield handle
    finally:
        handle.stop()


@contextlib.asynccontextmanager
async def arunning_server(model: str | os.PathLike, **kwargs: Any) -> AsyncIterator[ServerHandle]:
    handle = await asyncio.to_thread(start_server, model, **kwargs)
    try:
        yield handle
    finally:
        await asyncio.to_thread(handle.stop)
