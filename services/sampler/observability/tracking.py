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

from typing import Any

from shared.tracking import Reporter

NOT_REPORTED = frozenset({"step", "generation_started_at", "sealed_at", "policy_versions"})


def batch_metrics(stats: dict[str, Any]) -> dict[str, Any]:
    """What one sealed batch's stats report (the reporter keeps the numbers)."""
    return {k: v for k, v in stats.items() if k not in NOT_REPORTED}


class BatchReporter:
    """Producer hook: each sealed batch's stats to the reporter, at the batch's step. Cheap on
    the event loop: the reporter only queues them."""

    def __init__(self, reporter: Reporter):
        self.reporter = reporter

    def on_sealed(self, payload: dict[str, Any]) -> None:
        self.reporter.log(batch_metrics(payload["stats"]), payload["step"])
