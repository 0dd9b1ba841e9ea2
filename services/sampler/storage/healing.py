"""What the sampler repaired on its own: steps rebuilt or restored, versions written back.

Normally empty. Each entry says which step (or version) was missing, how it was healed and
why; `/status` (steps.healed) shows the counts and the latest entries, `/metrics` the counts
(`tandem_sampler_steps_healed_total{how}`).

How:
* `rebuilt`: an unsealed step behind the run's frontier that nobody was building (its build
  was lost with a crashed task or a Redis restart that dropped its seal) was generated again;
* `taken_over`: another replica's claim on the step lapsed without a seal, and this replica
  generated it;
* `restored`: a restarted Redis had lost a batch this process had sealed; its bytes, still
  in memory, were written back, so a re-read returns what was served before;
* `version_restored`: a restarted Redis had lost the version this process published; it was
  published again.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any

HOWS = ("rebuilt", "taken_over", "restored", "version_restored")


class HealLog:
    def __init__(self, keep: int = 32):
        self.counts: Counter[str] = Counter({how: 0 for how in HOWS})
        self.recent: deque[dict[str, Any]] = deque(maxlen=keep)

    def record(self, how: str, *, step: int | None = None, version: int | None = None, why: str) -> None:
        assert how in HOWS, how
        self.counts[how] += 1
        self.recent.append({"how": how, "step": step, "version": version, "why": why, "at": time.time()})

    def snapshot(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "recent": list(self.recent)}
