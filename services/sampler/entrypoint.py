"""`tandem sampler`: parse settings, check them, then import and serve the app."""

from __future__ import annotations

import logging
import sys

from services.sampler.config import SamplerSettings
from shared.settings import SettingsError, load


def main(argv: list[str] | None = None, prog: str = "tandem sampler") -> int:
    try:
        settings = load(SamplerSettings, argv, prog=prog)
    except SettingsError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn

    from services.sampler.app import create_app
    from services.sampler.envs import load_environment
    from services.sampler.strategies import load_strategy

    try:
        strategy = load_strategy(settings)
        env = load_environment(settings.env, **settings.env_args)
    except (ValueError, TypeError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    app = create_app(settings, env, strategy)

    class SamplerServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            closing = getattr(app.state, "begin_closing", None)
            if closing is not None:
                closing()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=10)
    SamplerServer(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
