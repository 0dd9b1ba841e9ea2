"""Views shared by /status and the dashboard: staleness histogram, timeline, eval summaries.

Pure functions over the store's per-batch stats and publish times, plus `extend_status`,
which adds the observability facts to a /status body.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shared import contract

if TYPE_CHECKING:
    from services.sampler.building.evals import Evals
    from services.sampler.api.state import SamplerState


def staleness_histogram(batches: list[dict[str, Any]]) -> dict[str, int]:
    """Samples per staleness value over `batches` (from each batch's policy_versions counts)."""
    counts: dict[int, int] = {}
    for b in batches:
        for version, n in (b.get("policy_versions") or {}).items():
            stale = contract.staleness(b["step"], int(version))
            counts[stale] = counts.get(stale, 0) + n
    return {str(k): counts[k] for k in sorted(counts)}


def timeline(batches: list[dict[str, Any]], published: dict[int, float],
             trainer: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Generation, training and publication intervals per step (unix seconds).

    Generation of batch N: from `generation_started_at` to `sealed_at` (measured).
    Training of step N, when the trainer's metrics for version N+1 carry `snapshot_at`
    (services/trainer/publication.py): `train_s` ending where the snapshot began; and
    `publish`, version N+1's way out: `snapshot` (the trainer's critical path), `write` (in the
    background) and `apply` (the POST's sync, the slowest server; `apply_s` per server).
    Without them (an older trainer), training is derived: the trainer needs batch N sealed and
    version N published, and publishes version N+1 when step N is done, so training spans
    max(sealed_at(N), published(N)) to published(N+1); version 0 is never published, so step
    0 starts at its seal. Steps whose training has not finished have `train_end` null.
    """
    measured = {m["version"]: m for m in trainer or [] if isinstance(m.get("snapshot_at"), (int, float))}
    rows = []
    for b in sorted(batches, key=lambda b: b["step"]):  # seal order is not step order when max_staleness >= 1
        step = b["step"]
        row: dict[str, Any] = {"step": step, "gen_start": b.get("generation_started_at"), "gen_end": b.get("sealed_at")}
        m = measured.get(step + 1)
        if m is not None:
            row.update(_measured_step(m))
        else:
            start = b.get("sealed_at")
            if step > 0 and step in published:
                start = max(start or 0.0, published[step])
            elif step > 0:
                start = None  # version N not published yet: training has not started
            row.update(train_start=start, train_end=published.get(step + 1) if start is not None else None)
        rows.append(row)
    return rows


def _measured_step(m: dict[str, Any]) -> dict[str, Any]:
    snapshot_end = float(m["snapshot_at"])
    snapshot_start = snapshot_end - float(m.get("snapshot_s") or 0.0)
    train_end = snapshot_start
    publish: dict[str, list[float]] = {"snapshot": [snapshot_start, snapshot_end]}
    if isinstance(m.get("written_at"), (int, float)):
        publish["write"] = [float(m["written_at"]) - float(m.get("write_s") or 0.0), float(m["written_at"])]
    applied = m.get("apply_s") if isinstance(m.get("apply_s"), dict) else {}
    if applied and isinstance(m.get("at"), (int, float)):
        publish["apply"] = [float(m["at"]) - max(applied.values()), float(m["at"])]
    return {"train_start": train_end - float(m.get("train_s") or 0.0), "train_end": train_end, "publish": publish}


async def recent_evals(evals: Evals, count: int = 50) -> list[dict[str, Any]]:
    """The last `count` eval jobs, oldest first, summarised (no request, no per-example output)."""
    out = []
    for record in await evals.recent(count):
        result = record.get("result") or {}
        out.append({
            "eval_id": record["eval_id"], "status": record["status"],
            "created_at": record.get("created_at"), "finished_at": record.get("finished_at"),
            "env": result.get("env"), "num_examples": result.get("num_examples"),
            "reward_mean": result.get("reward_mean"), "policy_version": result.get("policy_version"),
            "error": record.get("error"),
        })
    return out


async def extend_status(state: SamplerState, body: dict[str, Any], recent: list[dict[str, Any]],
                        redis_up: bool = True) -> None:
    """Add the observability facts to a /status body (existing keys are kept as they are).
    With `redis_up` False (an outage) the facts that live in Redis are left empty."""
    published = await state.store.version_publish_times(50) if redis_up else {}
    body["versions"]["published_at"] = published.get(body["versions"]["published"])
    body["staleness"]["histogram"] = staleness_histogram(recent)
    body["throughput"].update(state.throughput.recent_rates())
    evals = [e for e in await recent_evals(state.evals, 10) if e["status"] == "done"] if redis_up else []
    last = recent[-1] if recent else None
    body["rewards"] = {
        "last_batch_mean": last["reward_mean"] if last else None,
        "recent_mean": (sum(b["reward_mean"] for b in recent) / len(recent)) if recent else None,
        "last_eval": evals[-1] if evals else None,
    }
    trainer = await state.store.recent_trainer_metrics(20) if redis_up else []
    body["timeline"] = timeline(recent[-10:], published, trainer)
    body["rollout_log"] = state.rollout_log.snapshot() if state.rollout_log is not None else None
