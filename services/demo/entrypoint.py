"""`tandem demo`: parse DemoSettings, run the demo, map the outcome to an exit status.

Exit status: 0 when training finished and every child stopped; 1 when a child died
(its log tail is printed), a wait timed out or the run_dir cannot be used; 2 for
invalid settings; 128 + signal number after SIGINT (Ctrl-C) or SIGTERM, once every
child has been stopped.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from typing import Any

from services.demo.config import DemoSettings
from shared.settings import SettingsError, load


def _raise_interrupted(signum: int, frame: Any) -> None:
    from services.demo.demo import Interrupted

    raise Interrupted(signum)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    prog = prog or "tandem demo"
    try:
        settings = load(DemoSettings, argv, prog)
    except SettingsError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    from services.demo.demo import DemoError, Interrupted, run_demo
    from services.demo.processes import ChildDied

    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        summary = run_demo(settings)
    except Interrupted as exc:
        print(f"\n{prog}: {exc}; every child process has been stopped", file=sys.stderr)
        return 128 + exc.signum
    except ChildDied as exc:
        print(f"\n{prog}: {exc}", file=sys.stderr)
        return 1
    except (DemoError, TimeoutError) as exc:
        print(f"\n{prog}: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if summary.get("processes_left") else 0


if __name__ == "__main__":
    sys.exit(main())
