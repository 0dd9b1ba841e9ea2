"""One step's numbers: the learning rate, this rank's sums over its share of the batch (added
up over the ranks), and the step record that becomes a line of `trainer_metrics.jsonl`, the
metrics sent with the version, and the record a checkpoint carries.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from services.trainer.config import TrainerSettings
from shared import codec, contract
from shared.wire import MAX_METRICS, Batch


def learning_rate(settings: TrainerSettings, step: int) -> float:
    """Constant after a linear warm-up; a pure function of the step, so resume needs no state."""
    if settings.warmup_steps and step < settings.warmup_steps:
        return settings.learning_rate * (step + 1) / settings.warmup_steps
    return settings.learning_rate



def batch_digest(batch: Batch) -> str:
    """A short fingerprint of this rank's share: equal digests = the same training data."""
    h = hashlib.sha256()
    for smp in batch.samples:
        h.update(json.dumps([smp.prompt_id, codec.plain(smp.prompt_token_ids),
                             codec.plain(smp.completion_token_ids), smp.advantage]).encode())
    return h.hexdigest()[:16]


def rank_sums(batch: Batch, step: int) -> dict[str, float]:
    """Sums over this rank's share of batch `step` (and the largest staleness in it), to be
    added up over the ranks by `all_reduce_rank_sums`."""
    rewards = [s.reward for s in batch.samples]
    stale = [contract.staleness(step, s.policy_version) for s in batch.samples]
    return {
        "n": float(len(rewards)),
        "reward_sum": float(sum(rewards)),
        "reward_sq": float(sum(r * r for r in rewards)),
        "stale_sum": float(sum(stale)),
        "stale_max": float(max(stale, default=0)),
        "completion_tokens": float(sum(len(s.completion_token_ids) for s in batch.samples)),
        "truncated": float(sum(s.finish_reason == "length" for s in batch.samples)),
    }


def all_reduce_rank_sums(sums: dict[str, float], learner: Any) -> dict[str, float]:
    """`rank_sums` of every rank added up ("stale_max": the largest); a collective, so every
    rank calls it, on the training thread."""
    import torch

    if not learner.distributed:
        return sums
    keys = [k for k in sums if k != "stale_max"]
    summed = learner.sharding.all_reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
    peak = learner.sharding.all_reduce(torch.tensor([sums["stale_max"]], dtype=torch.float64), "max")
    return {**dict(zip(keys, summed.tolist())), "stale_max": float(peak.item())}


def step_record(step: int, lr: float, result: dict[str, Any], sums: dict[str, float], batch: Batch,
                wait_s: float, train_s: float) -> dict[str, Any]:
    """The metrics line of step `step`: the learner's result, the all-rank sums as means, and
    timings. The order of the keys is the order of the line (and of what is published)."""
    n = max(sums["n"], 1.0)
    reward_mean = sums["reward_sum"] / n
    reward_std = max(sums["reward_sq"] / n - reward_mean ** 2, 0.0) ** 0.5
    return {
        "event": "step", "step": step, "version": step + 1, "lr": lr,
        **result,
        "reward_mean": reward_mean, "reward_std": reward_std,
        "staleness_mean": sums["stale_sum"] / n, "staleness_max": int(sums["stale_max"]),
        "batch_staleness_mean": batch.stats.staleness_mean,
        "batch_staleness_max": batch.stats.staleness_max,
        "samples": int(sums["n"]),
        "batch_digest": batch_digest(batch),  # rank 0's share
        "completion_tokens_mean": sums["completion_tokens"] / n,
        "truncated_fraction": sums["truncated"] / n,
        "batch_wait_s": wait_s, "train_s": train_s,
        # Rank 0's; publish_s stays null in what is published (not known yet).
        "checkpoint_s": 0.0, "probe_s": 0.0, "publish_s": None, "write_s": 0.0,
        "published_bytes": 0, "checkpoint_bytes": 0,
        "tokens_per_s": result["forward_tokens"] / train_s if train_s > 0 else None,
        "generation_s": batch.stats.generation_seconds,
    }


def published_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The step record's numbers for `POST /weights_version`'s `metrics` (the sampler shows them):
    finite ints and floats only (no strings, bools or nulls), at most `MAX_METRICS` (the wire's
    limit); the version travels apart."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "version" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[key] = value
        if len(out) == MAX_METRICS:
            break
    return out
