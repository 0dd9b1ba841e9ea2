"""Stop a run whose samples do not come from the weights the trainer thinks they come from.

`behaviour_mismatch` (learner.py) is the mean over loss tokens of |log pi_old - log pi_behaviour|:
the trainer's logprob of each sampled token before this step's update against the logprob the
inference server reported when it sampled it. On a correct setup it is rounding (~1e-4 nats with the
CPU server at version 0) plus, for samples from an older version, the policy's drift over those
versions (`tandem demo`, learning rate 1e-3 with max_staleness 1: mean 0.03 nats over 150 steps,
single steps up to 0.2, at most 2 steps in a row above 0.1). A value that stays large means the
servers compute something else: weights that stayed stale after a reload, another dtype, another
model. Training then goes on quietly (the importance weights are truncated) but learns from the
wrong distribution, so the guard warns at every step above `max_behaviour_mismatch` and, after
`behaviour_mismatch_patience` such steps in a row, raises `BehaviourMismatchError`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

log = logging.getLogger("tandem.trainer.mismatch")

WHAT_IT_MEANS = (
    "the trainer's logprobs of the sampled tokens differ from the ones the inference servers reported: either "
    "the servers compute with other weights than the trainer's (left stale after a reload, another dtype, "
    "another model; see docs/vllm.md, and the probe result of each server in the sampler's GET "
    "/weights_version), or the policy moved far since stale samples were generated (a high learning rate "
    "with max_staleness >= 1)"
)
HOW_TO_DISABLE = "max_behaviour_mismatch=0 (--max-behaviour-mismatch 0) disables this check"


class BehaviourMismatchError(RuntimeError):
    """behaviour_mismatch stayed above max_behaviour_mismatch for behaviour_mismatch_patience steps."""

    def __init__(self, message: str, *, value: float, threshold: float, steps: list[int]):
        super().__init__(message)
        self.value = value
        self.threshold = threshold
        self.steps = steps


class MismatchGuard:
    """`observe(step, value)` once per step, with the same (all-rank) value on every rank, so
    every rank raises at the same step. `threshold` 0 disables it. `on_warning(record)` receives
    the metrics-log record of each step above the threshold; `announce` logs the warnings
    (rank 0 only, so a multi-rank run warns once)."""

    def __init__(self, threshold: float, patience: int, *, on_warning: Callable[[dict[str, Any]], None] | None = None,
                 announce: bool = True):
        if threshold < 0:
            raise ValueError("threshold must be >= 0 (0 disables)")
        if patience < 1:
            raise ValueError("patience must be >= 1")
        self.threshold = threshold
        self.patience = patience
        self.on_warning = on_warning
        self.announce = announce
        self.above: list[int] = []  # the consecutive steps above the threshold, up to now

    @property
    def enabled(self) -> bool:
        return self.threshold > 0

    def observe(self, step: int, value: float | None) -> None:
        if not self.enabled or value is None:
            return
        # NaN or inf: the logprobs themselves are broken, which is no better than a mismatch.
        if math.isfinite(value) and value <= self.threshold:
            self.above = []
            return
        self.above.append(step)
        count = len(self.above)
        stopping = count >= self.patience
        message = (f"behaviour_mismatch {value:.4g} nats > max_behaviour_mismatch {self.threshold:g} at step {step} "
                   f"({count} of {self.patience} steps in a row): {WHAT_IT_MEANS}. "
                   + ("Stopping." if stopping else f"The run stops after {self.patience} such steps in a row; "
                      f"{HOW_TO_DISABLE}."))
        if self.announce:
            log.warning(message)
        if self.on_warning is not None:
            self.on_warning({"event": "behaviour_mismatch", "step": step, "behaviour_mismatch": value,
                             "threshold": self.threshold, "consecutive": count, "patience": self.patience,
                             "stopping": stopping})
        if stopping:
            raise BehaviourMismatchError(
                f"behaviour_mismatch was above max_behaviour_mismatch ({self.threshold:g} nats) for {count} "
                f"consecutive steps (steps {self.above[0]}..{step}; last value {value:.4g} nats): {WHAT_IT_MEANS}. "
                "Check that every inference server loads the trainer's checkpoints (the probe results in the "
                "sampler's GET /weights_version and its log), that the servers run the model the trainer "
                "started from, in the dtype the trainer saves, and, on vLLM's CPU build, Tandem's reload fix "
                f"(docs/vllm.md). The checkpoint of step {step} was written: a restart resumes from it. "
                f"{HOW_TO_DISABLE}.",
                value=value, threshold=self.threshold, steps=list(self.above),
            )
