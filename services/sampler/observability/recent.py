"""Recent rollouts for the dashboard: a bounded ring of sealed samples, text truncated."""

from __future__ import annotations

import collections
from typing import Any

RECENT_ROLLOUTS = 200
TEXT_LIMIT = 2000  # characters of prompt/completion kept per rollout for the dashboard


class RecentRollouts:
    def __init__(self, size: int = RECENT_ROLLOUTS):
        self.ring: collections.deque[dict[str, Any]] = collections.deque(maxlen=size)

    def on_sealed(self, payload: dict[str, Any]) -> None:
        """Producer hook: keep the batch's last samples."""
        step, samples = payload["step"], payload["samples"]
        # Only the last `maxlen` samples stay in the ring: build entries for those alone.
        recent = samples[-self.ring.maxlen:] if self.ring.maxlen is not None else samples
        for s in recent:
            self.ring.append({
                "step": step,
                "prompt_id": s["prompt_id"],
                "group_id": s["group_id"],
                "prompt": _clip(s.get("prompt_text")),
                "completion": _clip(s.get("completion_text")),
                "reward": s["reward"],
                "rewards": s.get("rewards", {}),
                "advantage": s.get("advantage"),
                "policy_version": s["policy_version"],
                "finish_reason": s.get("finish_reason"),
                "tokens": len(s["completion_token_ids"]),
            })

    def latest(self, count: int) -> list[dict[str, Any]]:
        """The last `count` rollouts, newest first."""
        return list(self.ring)[-count:][::-1] if count else []


def _clip(text: str | None) -> str:
    if not text:
        return ""
    return text if len(text) <= TEXT_LIMIT else text[:TEXT_LIMIT] + "…"
