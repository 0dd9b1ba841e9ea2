"""The trainer's pause points for the kill drills (tests/reliability/test_trainer_kills.py,
`make stress --drill trainer`); the mechanism is shared/drill.py, switched on by
TANDEM_TRAINER_DRILL_PAUSE. The number is the step.

Points, in the order a step passes them: `fetched` (batch N received, nothing trained),
`trained` (the optimizer step applied, nothing written), `written` (version N+1 written to
disk, not announced), `checkpoint` (a checkpoint of step N is due, nothing of it written:
version N is the newest the sampler has), `checkpointed` (checkpoint step-N committed,
version N+1 not announced, no metrics line), `published` (version N+1 announced, its metrics
line not written).
"""

from __future__ import annotations

from collections.abc import Mapping

from shared.drill import Drill

POINTS = ("fetched", "trained", "written", "checkpoint", "checkpointed", "published")

__all__ = ["POINTS", "Drill", "from_env"]


def from_env(environ: Mapping[str, str]) -> Drill:
    return Drill.from_env(environ, POINTS, "TANDEM_TRAINER_DRILL_PAUSE")
