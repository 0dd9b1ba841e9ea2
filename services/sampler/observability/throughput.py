"""Throughput history: the completion and token counters sampled once a second.

The dashboard's throughput chart (`series`) and the "recent" rates of /status
(`recent_rates`) come from it.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.sampler.rollouts.rollout import Rollouts

HISTORY_SECONDS = 600
RATE_WINDOW = 30.0  # seconds behind the "recent" throughput of /status


class ThroughputHistory:
    def __init__(self, rollouts: Rollouts):
        self.rollouts = rollouts
        # (unix time, completions, tokens) once a second.
        self.history: collections.deque[tuple[float, int, int]] = collections.deque(maxlen=HISTORY_SECONDS)

    def sample(self) -> None:
        self.history.append((time.time(), self.rollouts.completions_done, self.rollouts.tokens_done))

    async def run(self, interval: float = 1.0) -> None:
        """Background task: sample the throughput counters every `interval` seconds."""
        while True:
            self.sample()
            await asyncio.sleep(interval)

    def series(self, smooth: float = 5.0) -> list[dict[str, float]]:
        """Completions/s and tokens/s over the history, each a rate over the last `smooth` seconds."""
        points = list(self.history)
        out = []
        j = 0
        for t, c, k in points:
            while j < len(points) and points[j][0] < t - smooth:
                j += 1
            t0, c0, k0 = points[j]
            dt = t - t0
            if dt > 0:
                out.append({"t": t, "completions_per_second": (c - c0) / dt, "tokens_per_second": (k - k0) / dt})
        return out

    def recent_rates(self) -> dict[str, float | None]:
        points = list(self.history)
        if len(points) < 2:
            return {"recent_completions_per_second": None, "recent_tokens_per_second": None,
                    "recent_window_seconds": None}
        now = self.rollouts.completions_done, self.rollouts.tokens_done
        t_now = time.time()
        first = next((p for p in points if p[0] >= t_now - RATE_WINDOW), points[0])
        dt = max(t_now - first[0], 1e-6)
        return {"recent_completions_per_second": (now[0] - first[1]) / dt,
                "recent_tokens_per_second": (now[1] - first[2]) / dt,
                "recent_window_seconds": dt}
