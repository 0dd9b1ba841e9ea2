"""Group-relative advantages, computed in the sampler so the trainer gets ready samples.

* `grpo`: (r - mean) / (std + eps), std with Bessel's correction as in the GRPO paper's
  reference implementations; a group whose rewards are all equal gets zeros.
* `no_std`: r - mean (Dr. GRPO: dividing by std over-weights easy and hard prompts).
* `rloo`: r_i minus the mean of the *other* rewards in the group (leave-one-out baseline),
  which equals n/(n-1) * (r_i - mean).

Advantages are always finite: a non-finite reward (or rewards so large that the arithmetic
overflows) raises `NonFiniteAdvantages` instead of returning NaN or inf. The sampler
screens rewards before it gets here (`Rollouts.group` drops such a group), so this is the
last guard, not the policy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

EPS = 1e-6


class NonFiniteAdvantages(ValueError):
    """The rewards of a group give no finite advantages (a reward is NaN or infinite, or the
    rewards are too large to subtract)."""


def group_advantages(rewards: Sequence[float], mode: str = "grpo") -> list[float]:
    advantages = _advantages(rewards, mode)
    if not (all(map(math.isfinite, rewards)) and all(map(math.isfinite, advantages))):
        raise NonFiniteAdvantages(
            f"no finite {mode} advantages for rewards {list(rewards)!r}: every reward must be a finite number "
            f"small enough to subtract"
        )
    return advantages


def _advantages(rewards: Sequence[float], mode: str) -> list[float]:
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
        # Scaled by the largest deviation, so squaring cannot overflow for huge rewards.
        scale = max(map(abs, centred))
        if scale == 0.0:
            return [0.0] * n
        std = scale * math.sqrt(sum((c / scale) ** 2 for c in centred) / (n - 1))
        return [c / (std + EPS) for c in centred]
    raise ValueError(f"unknown advantage mode {mode!r}: use grpo, no_std or rloo")
