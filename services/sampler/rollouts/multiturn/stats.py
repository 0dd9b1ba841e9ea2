"""What multi-turn (and verifiers) environments did since the sampler started, per environment: turns,
tool calls and their failures, trajectories retried and groups dropped after environment
faults, verifiers traces that forked (GET /status `environments`, /metrics `tandem_sampler_env_*`, the dashboard)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


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
    forks: int = 0            # verifiers traces that forked into branches (vf/traces.py)
    last_error: str | None = None


# The counters (every field but last_error), as /metrics names them.
FIELDS = tuple(f.name for f in fields(EnvCounts) if f.name != "last_error")


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
        return {env: asdict(counts) for env, counts in sorted(self.by_env.items())}
