"""Which trajectory a model call belongs to: the link between verifiers' rollouts and the
sampler's inference pool.

verifiers' training client sends each turn to the sampler's `POST /inference/v1/generate`
with the rollout's trace id as `X-Session-ID`. The trajectory that runs the rollout opens a
`Session` under that id the moment verifiers mints the trace (before any model call), so the
route knows for every call: the weights version the trajectory needs (the pool's version
gate), the seed of each turn, the sampling parameters training requires, and where to write
down what came back (the weight versions of the tokens, and which tokens had no logprob).
A call under an id nobody opened (a verifiers eval pointed at the sampler from outside) is
served at any version, as it asks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Call:
    """One model call: what was sent, what came back."""

    prompt_ids: list[int]
    completion_ids: list[int]
    versions: list[int]
    masked: list[int]  # completion positions without a logprob (never trained on)
    finish_reason: str


@dataclass
class Session:
    min_version: int
    seed: int
    label: str
    # Sampling parameters that override the request's (temperature, nucleus): the trainer
    # computes its probabilities with the sampler's, so the samples must be drawn with them.
    sampling: dict[str, Any] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    # The inference failure that ended a call, if one did: it is the pool's, not the
    # environment's, and the trajectory re-raises it instead of retrying it as an env fault.
    inference_error: BaseException | None = None


class Sessions:
    def __init__(self) -> None:
        self._open: dict[str, Session] = {}

    def open(self, session_id: str, session: Session) -> None:
        self._open[session_id] = session

    def get(self, session_id: str | None) -> Session | None:
        return self._open.get(session_id) if session_id else None

    def close(self, session_id: str) -> Session | None:
        return self._open.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._open)
