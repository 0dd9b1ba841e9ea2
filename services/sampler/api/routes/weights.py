"""GET/POST /weights_version: the published weights version and what each server serves."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, status

from services.sampler.api.deps import State
from services.sampler.fleet.inference_pool import DOWN, JOINING, LEAVING
from services.sampler.api.state import SamplerState
from shared.wire import ServerVersion, WeightsVersion, WeightsVersionRequest

router = APIRouter(tags=["weights"])


async def _current(state: SamplerState) -> WeightsVersion:
    meta = await state.store.meta()
    servers = [ServerVersion(**{**s.snapshot(), "url": s.url}) for s in state.pool.servers]
    return WeightsVersion(
        version=meta["version"],
        checkpoint_path=meta["checkpoint_path"],
        adapter=meta["adapter"],
        servers=servers,
        min_served_version=state.pool.min_version(),
        trimmed_below=meta["trimmed_below"],
    )


@router.get("/weights_version", response_model=WeightsVersion)
async def get_weights_version(state: State) -> WeightsVersion:
    return await _current(state)


@router.post(
    "/weights_version",
    response_model=WeightsVersion,
    responses={409: {"description": "lower than the published version"},
               422: {"description": "the inference servers refused the checkpoint, or none computes the "
                          "probe's logprobs"},
               502: {"description": "the inference servers that answered failed to load the checkpoint"}},
)
async def post_weights_version(body: WeightsVersionRequest, state: State) -> WeightsVersion:
    sync = state.weight_sync
    async with sync.lock:
        published = await state.store.version()
        if body.version < published:
            raise HTTPException(
                status.HTTP_409_CONFLICT,
                detail=f"version {body.version} is lower than the published version {published}: "
                "versions only move forward",
            )
        if body.checkpoint_path:
            state.weights_check.refuse_wrong_kind(body.checkpoint_path, body.adapter)  # 422: adapter or not
            await state.weights_check.refuse_nonfinite(body.checkpoint_path)  # 422 for NaN/inf weights
            # Servers out of rotation for a reason the fleet handles (down, joining, leaving)
            # are brought to the published version by the fleet once they can be.
            behind = [s for s in state.pool.servers if s.state not in (DOWN, JOINING, LEAVING)
                      and (s.version is None or s.version < body.version)]
            results = await sync.sync_all(body.version, body.checkpoint_path, behind, body.probe,
                                          adapter=body.adapter)
            refused = [r for r in results if not r.ok and not r.unreachable]
            if refused and not any(r.ok for r in results):
                # Servers answered, and none serves it: the checkpoint (or the servers) is broken,
                # and publishing it would stall generation or, worse, train on samples from other
                # weights. Servers that did not answer at all do not block a publication: they are
                # re-synced when they are back.
                if all(r.mismatch for r in refused):
                    detail = (f"every inference server loaded {body.checkpoint_path!r} and labelled it version "
                              f"{body.version}, but none computes the trainer's logprobs: "
                              + "; ".join(f"{r.url}: {r.probe.describe() if r.probe else r.error}" for r in refused)
                              + ". They are out of rotation and the version is not published. Check that the "
                              "servers run with Tandem's reload fix (docs/vllm.md) and load the dtype the trainer "
                              "saved.")
                    raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=detail)
                errors = "; ".join(f"{r.url}: {r.error}" for r in refused)
                code = status.HTTP_422_UNPROCESSABLE_CONTENT if all(r.client_error for r in refused) \
                    else status.HTTP_502_BAD_GATEWAY
                raise HTTPException(code, detail=f"no inference server loaded {body.checkpoint_path!r}: {errors}")
        elif body.version > published:
            await sync.record_pushed(body.version)
        await state.drill.point("publishing", body.version)
        outcome, previous = await state.store.publish_version(body.version, body.checkpoint_path, body.probe,
                                                              adapter=body.adapter)
        await state.drill.point("published", body.version)
        if outcome == 0:
            raise HTTPException(
                status.HTTP_409_CONFLICT,
                detail=f"version {body.version} is lower than the published version {previous}",
            )
        # The producer may build on the new version now: woken before the trim and the metrics,
        # which nothing it does waits for (the next batch's generation is on the trainer's path).
        state.notifier.notify()
        if outcome == 2:
            await state.store.trim_below(body.version - state.settings.keep_batches, body.resume_step)
            if body.metrics:
                # With each server's sync seconds: the dashboard's timeline draws the apply.
                applied = {r.url: round(r.seconds, 4) for r in results if r.ok} if body.checkpoint_path else {}
                await state.store.add_trainer_metrics(body.version, {**body.metrics, "apply_s": applied})
            state.notifier.notify()  # what the trim changed (GET /batch of a trimmed step answers 410)
    return await _current(state)
