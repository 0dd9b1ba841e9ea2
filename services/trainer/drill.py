"""The trainer's pause points for the kill drills (tests/reliability/test_trainer_kills.py,
`make stress --drill trainer`); the mechanism is shared/drill.py, switched on by
TANDEM_TRAINER_DRILL_PAUSE. The number is the step.

Points, in the order a step passes them: `fetched` (batch N received, nothing trained),
`trained` (the optimizer step applied, nothing copied aside), `snapshot` (version N+1's
snapshot taken, nothing written, its publication not started), `checkpoint` (a checkpoint of
step N is due, nothing of it written: version N is the newest the sampler has),
`checkpointed` (checkpoint step-N committed, version N+1 neither written nor announced); then,
inside the background publication (services/trainer/publication.py) while step N+1 trains:
`written` (version N+1 on disk, not announced), `probed` (its probe computed from the
snapshot, not announced), `published` (version N+1 announced, step N's metrics line not
written). A drill paused in the background holds the trainer at step N+1's end, where it
waits for that publication.
"""

from __future__ import annotations

from collections.abc import Mapping

from shared.drill import Drill

POINTS = ("fetched", "trained", "snapshot", "checkpoint", "checkpointed", "written", "probed", "published")

__all__ = ["POINTS", "Drill", "from_env"]


def from_env(environ: Mapping[str, str]) -> Drill:
    return Drill.from_env(environ, POINTS, "TANDEM_TRAINER_DRILL_PAUSE")
