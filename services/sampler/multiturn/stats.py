"""What multi-turn environments did since the sampler started, per environment: turns,
tool calls and their failures, trajectories retried and groups dropped after environment
faults (GET /status `environments`, /metrics `tandem_sampler_env_*`, the dashboard)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FIELDS = ("trajectories", "turns", "tool_calls", "tool_errors", "tool_timeouts",
          "env_errors", "trajectory_retries", "groups_dropped")


@dataclass
class EnvCounts:
    trajectories: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0      # tool calls that raised, were malformed or named no tool
    tool_timeouts: int = 0    # tool calls that passed their timeout
    env_errors: int = 0       # environment turns or rewards that raised or timed out
    trajectory_retries: int = 0
    groups_dropped: int = 0   # groups whose trajectory failed every retry (slot refilled)
    last_error: str | None = None


@dataclass
class EnvStats:
    """One per sampler, shared by every environment's Rollouts."""

    by_env: dict[str, EnvCounts] = field(default_factory=dict)

    def of(self, env: str) -> EnvCounts:
        counts = self.by_env.get(env)
        if counts is None:
            counts = self.by_env[env] = EnvCounts()
        return counts

    def snapshot(self) -> dict[str, Any]:
        return {env: {**{name: getattr(c, name) for name in FIELDS}, "last_error": c.last_error}
                for env, c in sorted(self.by_env.items())}
