"""Group-relative advantages, computed in the sampler so the trainer gets ready samples.

* `grpo`: (r - mean) / (std + eps), std with Bessel's correction as in the GRPO paper's
  reference implementations; a group whose rewards are all equal gets zeros.
* `no_std`: r - mean (Dr. GRPO: dividing by std over-weights easy and hard prompts).
* `rloo`: r_i minus the mean of the *other* rewards in the group (leave-one-out baseline),
  which equals n/(n-1) * (r_i - mean).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

EPS = 1e-6


def group_advantages(rewards: Sequence[float], mode: str = "grpo") -> list[float]:
    n = len(rewards)
    if n == 0:
        return []
    mean = sum(rewards) / n
    centred = [r - mean for r in rewards]
    if mode == "no_std":
        return centred
    if mode == "rloo":
        if n < 2:
            return [0.0] * n
        return [c * n / (n - 1) for c in centred]
    if mode == "grpo":
        if n < 2:
            return [0.0] * n
        std = math.sqrt(sum(c * c for c in centred) / (n - 1))
        return [c / (std + EPS) for c in centred]
    raise ValueError(f"unknown advantage mode {mode!r}: use grpo, no_std or rloo")
