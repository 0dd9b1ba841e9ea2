"""The dashboard: GET / serves static/index.html; GET /dashboard/data feeds its charts.

The page is plain HTML+CSS+JS under services/sampler/api/static (no build step, no CDN),
served by FastAPI's StaticFiles at /static. It polls GET /status and GET
/dashboard/data, which carries the series that /status keeps short: per-batch stats,
the staleness histogram, the generation-vs-training timeline, eval rewards, throughput
history and recent rollouts (text truncated; the page renders it as text, never HTML).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse

from services.sampler.api.deps import State
from services.sampler.api.views import recent_evals, staleness_histogram, timeline

STATIC = Path(__file__).resolve().parent.parent / "static"

router = APIRouter(tags=["dashboard"])

# The pages a person opens in a browser: `/?token=...` (the URL the sampler prints) keeps the
# token in a cookie, and a browser without it is shown how to get in (shared/token_guard.py).
BROWSER_PATHS = ("/",)


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    # no-cache: a dashboard left open across an upgrade should pick up the new page.
    return FileResponse(STATIC / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})


@router.get("/dashboard/data")
async def dashboard_data(
    state: State,
    batches: Annotated[int, Query(ge=1, le=256, description="recent batches to include (the store keeps 256)")] = 200,
    rollouts: Annotated[int, Query(ge=0, le=200, description="recent rollouts to include")] = 100,
) -> dict[str, Any]:
    # Seal order is not step order when max_staleness >= 1; charts want steps in order.
    recent = sorted(await state.store.recent_batch_stats(batches), key=lambda b: b["step"])
    published = await state.store.version_publish_times()
    trainer = await state.store.recent_trainer_metrics(batches)
    return {
        "now": time.time(),
        "batches": [
            {k: b.get(k) for k in ("step", "num_samples", "reward_mean", "reward_std", "rewards_mean",
                                   "staleness_mean", "staleness_max", "completion_tokens_mean",
                                   "generation_started_at", "sealed_at", "generation_seconds")}
            for b in recent
        ],
        "staleness_histogram": staleness_histogram(recent),
        "timeline": timeline(recent, published, trainer),
        "versions": [{"version": v, "published_at": t} for v, t in sorted(published.items())],
        "evals": await recent_evals(state.evals),
        # The trainer's per-step metrics, sent with each POST /weights_version (behaviour_mismatch...).
        "trainer": trainer,
        "throughput": state.throughput.series(),
        "rollouts": state.recent_rollouts.latest(rollouts),
    }
