"""The sampler's pause points for the restart drills (tests/reliability/test_redis_moments.py,
`make stress`); the mechanism is shared/drill.py, switched on by TANDEM_DRILL_PAUSE.

Points: `claimed` (a step's claim taken, nothing generated yet), `built` (the batch packed,
not yet sealed), `writing` (its first chunk stored, the others not yet), `staged` (all its
chunks stored, the seal script not yet run), `sealed` (Redis acknowledged the seal, nothing else done yet), `publishing`
(POST /weights_version: servers synced, the version not yet written) and `published` (the
version written, the answer not yet sent).
"""

from __future__ import annotations

from collections.abc import Mapping

from shared.drill import Drill

POINTS = ("claimed", "built", "writing", "staged", "sealed", "publishing", "published")

__all__ = ["POINTS", "Drill", "from_env"]


def from_env(environ: Mapping[str, str]) -> Drill:
    return Drill.from_env(environ, POINTS, "TANDEM_DRILL_PAUSE")
