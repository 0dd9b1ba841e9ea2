"""GET /status: one JSON snapshot of the run for curl users, dashboards and trainers."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter

from services.sampler.api.deps import State
from services.sampler.api.views import extend_status
from services.sampler.storage.redis_link import is_outage
from services.sampler.api.state import SamplerState
from shared.contract import SamplerConfig

router = APIRouter(tags=["status"])


async def _from_redis(state: SamplerState) -> dict[str, Any] | None:
    """What /status reads from Redis; None while Redis is unreachable (the body says so)."""
    try:
        return {
            "meta": await state.store.meta(),
            "sealed": await state.store.sealed_steps(),
            "recent": await state.store.recent_batch_stats(50),
            "trainer": (await state.store.recent_trainer_metrics(1) or [None])[-1],
        }
    except Exception as exc:
        if not is_outage(exc):
            raise
        state.link.report(exc)
        return None


@router.get("/status")
async def get_status(state: State) -> dict[str, Any]:
    s = state.settings
    stored = await _from_redis(state)
    # During a Redis outage the answer still comes, from memory: what lives only in Redis is null.
    meta = stored["meta"] if stored else {"version": None, "checkpoint_path": None, "trimmed_below": None}
    sealed = stored["sealed"] if stored else None
    recent = stored["recent"] if stored else []
    pool = state.pool
    uptime = time.time() - state.started_at
    last = recent[-1] if recent else None
    ready = [step for step in sealed if step >= meta["version"]] if stored else []
    sampling = state.rollouts.request_sampling
    body = {
        "config": SamplerConfig(
            namespace=s.namespace, env=s.env, strategy=state.strategy.name,
            prompts_per_step=s.prompts_per_step, num_generations=s.num_generations, batch_size=s.batch_size,
            max_staleness=s.max_staleness, on_policy=s.max_staleness == 0, num_iterations=s.num_iterations,
            temperature=s.temperature, top_p=sampling.get("top_p"), top_k=sampling.get("top_k"),
            min_p=sampling.get("min_p"), max_tokens=state.rollouts.max_tokens,
            max_concurrency=s.max_concurrency, advantage=s.advantage, seed=s.seed, keep_batches=s.keep_batches,
            holds_resume_step=True,
            filter_zero_variance=s.filter_zero_variance, inference_urls=s.inference_urls,
        ).model_dump(),
        "steps": {
            **state.producer.snapshot(),
            "sealed_steps": sealed,
            "trimmed_below": meta["trimmed_below"],
            "resume_step": meta.get("resume_step"),
        },
        "queues": {
            "batches_ready": len(ready) if stored else None,
            "batches_in_progress": len(state.producer.in_progress),
            "in_flight_requests": pool.in_flight,
        },
        "versions": {
            "published": meta["version"],
            "checkpoint_path": meta["checkpoint_path"],
            "min_served": pool.min_version(),
            "servers": {srv.url: srv.version for srv in pool.servers},
        },
        "staleness": {
            "last_batch_mean": last["staleness_mean"] if last else None,
            "last_batch_max": last["staleness_max"] if last else None,
            "recent_mean": (sum(b["staleness_mean"] for b in recent) / len(recent)) if recent else None,
        },
        "throughput": {
            "completions": state.rollouts.completions_done,
            "completion_tokens": state.rollouts.tokens_done,
            "completions_per_second": state.rollouts.completions_done / uptime if uptime > 0 else 0.0,
            "tokens_per_second": state.rollouts.tokens_done / uptime if uptime > 0 else 0.0,
            "retries": pool.stats.retries,
            "errors": pool.stats.errors,
        },
        "strategy": state.strategy.snapshot(),
        "dynamic_sampling": state.source.snapshot(),
        "nonfinite": state.rollouts.nonfinite.snapshot(),
        # Per environment: turns, tool calls and failures, retried trajectories, dropped groups.
        "environments": state.rollouts.env_stats.snapshot(),
        "env_workers": {"size": state.rollouts.workers.size, "busy": state.rollouts.workers.busy},
        "curriculum": state.curriculum.snapshot(state.producer.next_step) if state.curriculum else None,
        "inference_servers": [srv.snapshot() for srv in pool.servers],
        "trainer": stored["trainer"] if stored else None,
        "recent_batches": recent[-20:],
        "redis": {**state.link.snapshot(), "embedded": state.embedded is not None},
        "uptime_seconds": uptime,
    }
    await extend_status(state, body, recent, redis_up=stored is not None)
    return body
