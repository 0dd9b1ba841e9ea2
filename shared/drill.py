"""Pause points for the restart drills (`make stress`, tests/reliability): a process stops at
an exact moment so that a drill can kill it (or its Redis) there.

Inert unless the process's environment sets the drill variable (TANDEM_DRILL_PAUSE for the
sampler, TANDEM_TRAINER_DRILL_PAUSE for the trainer) to a comma-separated list of
`point:number` (for example `sealed:3,published:4`), and TANDEM_DRILL_DIR. When the process
reaches a listed point for that number (a step or a version), it creates the file
`TANDEM_DRILL_DIR/<point>-<number>` and waits until the drill deletes it: the drill knows
exactly where the process stands. Each point pauses once. Each service names its points
(services/sampler/building/drill.py, services/trainer/drill.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

log = logging.getLogger("tandem.drill")


class Drill:
    def __init__(self, pauses: set[tuple[str, int]] | None = None, directory: Path | None = None):
        self.pauses = set(pauses or ())
        self.directory = directory

    @classmethod
    def from_env(cls, environ: Mapping[str, str], points: Iterable[str], variable: str) -> Drill:
        spec = environ.get(variable, "").strip()
        if not spec:
            return cls()
        points = tuple(points)
        directory = Path(environ.get("TANDEM_DRILL_DIR") or ".")
        pauses = set()
        for item in spec.split(","):
            point, _, number = item.strip().partition(":")
            if point not in points or not number.isdigit():
                raise ValueError(f"{variable} item {item!r}: expected <point>:<number>, point one of {points}")
            pauses.add((point, int(number)))
        directory.mkdir(parents=True, exist_ok=True)
        return cls(pauses, directory)

    async def point(self, name: str, number: int) -> None:
        if (name, number) not in self.pauses or self.directory is None:
            return
        self.pauses.discard((name, number))
        marker = self.directory / f"{name}-{number}"
        marker.touch()
        log.warning("drill: paused at %s %d until %s is removed", name, number, marker)
        while marker.exists():
            await asyncio.sleep(0.01)
        log.warning("drill: resumed after %s %d", name, number)
