"""`tandem sampler`: parse settings, check them, then import and serve the app."""

from __future__ import annotations

import logging
import sys
from typing import Any

from services.sampler.config import SamplerSettings
from shared.settings import SettingsError, load


KEEP_ALIVE_S = 75


def main(argv: list[str] | None = None, prog: str = "tandem sampler") -> int:
    try:
        settings = load(SamplerSettings, argv, prog=prog)
    except SettingsError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    refused = settings.listen_refusal("the sampler")
    if refused:
        print(f"{prog}: {refused}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.log_level != "debug":
        # A line per HTTP request and per verifiers rollout (hundreds a second in a verifiers
        # run: its clients log each call at INFO) would bury the sampler's own lines.
        for name in ("httpx", "httpx2", "verifiers", "mcp"):
            logging.getLogger(name).setLevel(logging.WARNING)

    import uvicorn

    from services.sampler.observability import gc_tuning
    from services.sampler.app import create_app
    from services.sampler.rollouts.envs import load_environment
    from services.sampler.building.strategies import load_strategy

    try:
        strategy = load_strategy(settings)
        env = load_environment(settings.env, **settings.env_args)
    except (ValueError, TypeError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    app = create_app(settings, env, strategy)
    if settings.rollout_log:
        # Its modules (pyarrow and pandas, ~0.3 s) now, not in a worker thread that competes for
        # the GIL with the first batches (it took ~1 s of wall time there) and then still needs
        # its own freeze.
        from services.sampler.observability.rollout_log import load_modules

        load_modules()
    # Everything imported and built so far lives as long as the process: out of the collector's way.
    gc_tuning.enable()

    class SamplerServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            closing = getattr(app.state, "begin_closing", None)
            if closing is not None:
                closing()
            super().handle_exit(sig, frame)

    # Idle connections are kept longer than clients keep theirs (httpx: 5 s, uvicorn's default
    # too): with equal timeouts a client reuses a connection the server is closing at that
    # moment and its request fails ("Server disconnected"), which verifiers' client does not retry.
    config = uvicorn.Config(_refusal_in_one_line(app), host=settings.host, port=settings.port,
                            log_level=settings.log_level, timeout_graceful_shutdown=10,
                            timeout_keep_alive=KEEP_ALIVE_S)
    try:
        SamplerServer(config).run()
    except SystemExit:
        # uvicorn exits 3 when the start-up fails; one refused (e.g. a namespace holding
        # another run) is reported like a bad setting instead.
        refused = getattr(app.state, "refused", None)
        if refused is None:
            raise
        print(f"{prog}: {refused}", file=sys.stderr)
        return 2
    return 0


def _refusal_in_one_line(app: Any) -> Any:
    """The app, except that a start-up refused with SettingsError does not make uvicorn log a
    traceback: the entrypoint prints the refusal's one line."""

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        async def quiet_send(message: Any) -> None:
            if message["type"] == "lifespan.startup.failed" and getattr(app.state, "refused", None) is not None:
                message = {**message, "message": ""}
            await send(message)

        await app(scope, receive, quiet_send if scope["type"] == "lifespan" else send)

    return asgi


if __name__ == "__main__":
    sys.exit(main())
