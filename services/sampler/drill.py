"""Pause points for the restart drills (tests/reliability/test_redis_moments.py, `make stress`).

Inert unless the sampler's environment sets TANDEM_DRILL_PAUSE, a comma-separated list of
`point:number` (for example `sealed:3,published:4`), and TANDEM_DRILL_DIR. When the sampler
reaches a listed point for that step (or version), it creates the file
`TANDEM_DRILL_DIR/<point>-<number>` and waits until the drill deletes it: the drill knows
exactly where the sampler stands while it kills Redis. Each point pauses once.

Points: `claimed` (a step's claim taken, nothing generated yet), `built` (the batch packed,
not yet sealed), `sealed` (Redis acknowledged the seal, nothing else done yet), `publishing`
(POST /weights_version: servers synced, the version not yet written) and `published` (the
version written, the answer not yet sent).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("tandem.sampler.drill")

POINTS = ("claimed", "built", "sealed", "publishing", "published")


class Drill:
    def __init__(self, pauses: set[tuple[str, int]] | None = None, directory: Path | None = None):
        self.pauses = set(pauses or ())
        self.directory = directory

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Drill:
        spec = environ.get("TANDEM_DRILL_PAUSE", "").strip()
        if not spec:
            return cls()
        directory = Path(environ.get("TANDEM_DRILL_DIR") or ".")
        pauses = set()
        for item in spec.split(","):
            point, _, number = item.strip().partition(":")
            if point not in POINTS or not number.isdigit():
                raise ValueError(f"TANDEM_DRILL_PAUSE item {item!r}: expected <point>:<number>, point one of {POINTS}")
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
