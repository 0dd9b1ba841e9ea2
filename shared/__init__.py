"""Tandem's shared contract: wire types, settings, codec and the sampler client.

Importing this package must stay cheap and must never import torch or vllm: the
sampler, the trainer, the dashboard tooling and user scripts all depend on it. The wire
types below load on first use, so that a module of the standard library alone
(shared/token_guard.py, which vLLM's interpreter imports) pulls in nothing else.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "Batch",
    "BatchStats",
    "EvalAccepted",
    "EvalRequest",
    "EvalResult",
    "Sample",
    "ServerVersion",
    "WeightsVersion",
    "WeightsVersionRequest",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from shared import wire

        return getattr(wire, name)
    raise AttributeError(f"module 'shared' has no attribute {name!r}")
