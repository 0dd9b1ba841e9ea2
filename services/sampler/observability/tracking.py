"""The sampler's batch stats mirrored to W&B / TensorBoard (`report_to`, shared/tracking.py).

Every sealed batch's stats (the `stats` of its body, the batch_stats stream that GET /status
and the dashboard read) are reported at the batch's step, which is the trainer step that trains
on it, so the sampler's curves line up with the trainer's. The names are the stats' own
(`reward_mean`, `staleness_mean`, `generation_seconds`, a strategy's counters...), nested ones
flattened (`rewards_mean/<reward function>`, `finish_reasons/length`), except:

* `step`: the x-axis;
* `generation_started_at`, `sealed_at`: wall-clock stamps, not measurements
  (`generation_seconds` is their difference);
* `policy_versions`: sample counts keyed by version number, a new name at every version
  (`staleness_mean` / `staleness_max` say the same as curves).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from shared.tracking import Reporter

NOT_REPORTED = frozenset({"step", "generation_started_at", "sealed_at", "policy_versions"})


def batch_metrics(stats: dict[str, Any]) -> dict[str, Any]:
    """What one sealed batch's stats report (the reporter keeps the numbers)."""
    return {k: v for k, v in stats.items() if k not in NOT_REPORTED}


class BatchReporter:
    """Producer hook: each sealed batch's stats to the reporter, at the batch's step, in step order.

    Batches are built concurrently and may seal out of order (batch 1 before batch 0), and
    TensorBoard reads a step lower than one it has seen as a restart, dropping the later points
    from its charts. So a batch waits while a lower step is still being built here
    (`building`: the producer's steps in flight) and goes out with it; one whose lower step was
    dropped instead goes out with the next seal, or at `flush` (shutdown). Cheap on the event
    loop: the reporter only queues them."""

    def __init__(self, reporter: Reporter, building: Callable[[], Collection[int]]):
        self.reporter = reporter
        self.building = building
        self.held: dict[int, dict[str, Any]] = {}

    def on_sealed(self, payload: dict[str, Any]) -> None:
        self.held[payload["step"]] = batch_metrics(payload["stats"])
        # A step sealing now is still among those in flight until its hooks are done.
        unsealed = min((s for s in self.building() if s not in self.held), default=None)
        for step in sorted(self.held):
            if unsealed is not None and step > unsealed:
                break
            self.reporter.log(self.held.pop(step), step)

    def flush(self) -> None:
        for step in sorted(self.held):
            self.reporter.log(self.held.pop(step), step)
