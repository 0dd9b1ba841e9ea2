"""Tandem's shared contract: wire types, settings, codec and the sampler client.

Importing this package must stay cheap and must never import torch or vllm: the
sampler, the trainer, the dashboard tooling and user scripts all depend on it.
"""

from shared.wire import (
    Batch,
    BatchStats,
    EvalAccepted,
    EvalRequest,
    EvalResult,
    Sample,
    ServerVersion,
    WeightsVersion,
    WeightsVersionRequest,
)

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
