"""GET /batch: long-poll for a sealed batch (docs/sampler-api.md, GET /batch).

200 the batch (the same bytes on every read until trimmed), 204 when `timeout` passes
first, 409 when the published version is too old for the batch ever to be generated,
410 when the batch was trimmed, or was never sealed and the published version is past it,
422 for malformed parameters, 503 while Redis is unreachable or generation is stuck, 500
when a sealed batch's chunk file is damaged (it says which file; no read would succeed).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Header, HTTPException, Query, Response, status
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.background import BackgroundTask

from services.sampler.api.deps import State
from services.sampler.storage.chunk_files import ChunkUnreadable
from services.sampler.storage.packing import SealedBatch, joined, pieces, share_chunks, share_range
from services.sampler.storage.store import Store
from shared import codec
from shared.aio import wait_event
from shared.chunks import FRAMES, frame_head, gc_paused, samples_of_chunks
from shared.codec import negotiate

router = APIRouter(tags=["batch"])

# Seconds past its own `timeout` a long-poll waits for an answer from a Redis that has stopped
# answering before it answers 503 (Retry-After): a few, not the Redis client's socket_timeout.
REDIS_GRACE_S = 2.0

T = TypeVar("T")


@router.get(
    "/batch",
    responses={
        200: {"description": "the sealed batch (this rank's share): chunk frames with `Accept: "
                   "application/vnd.tandem.batch` (shared/chunks.py, what SamplerClient asks for); JSON; msgpack "
                   "with `Accept: application/msgpack`; msgpack with typed arrays with `Accept: "
                   "application/vnd.tandem+msgpack` (shared/codec.py)"},
        204: {"description": "not sealed within `timeout` seconds: ask again"},
        409: {"description": "the published weights version is too old for this batch"},
        410: {"description": "the batch was trimmed, or never sealed and the published version is past it"},
    },
)
async def get_batch(
    state: State,
    step: Annotated[int, Query(ge=0, le=2**53, description="the trainer step N")],
    timeout: Annotated[float, Query(ge=0, le=86400, description="seconds to wait; capped by max_poll_timeout")] = 30.0,
    rank: Annotated[int, Query(ge=0, le=65535)] = 0,
    world_size: Annotated[int, Query(ge=1, le=65536)] = 1,
    accept: Annotated[str | None, Header()] = None,
) -> Response:
    if rank >= world_size:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=f"rank {rank} must be < world_size {world_size}")
    timeout = min(timeout, state.settings.max_poll_timeout)
    deadline = time.monotonic() + timeout
    store, notifier = state.store, state.notifier
    # A Redis that stops answering (frozen, not dead) is given up on this long after the
    # caller's own timeout, not after the Redis client's socket_timeout: the caller gets a 503.
    answer_by = asyncio.get_running_loop().time() + timeout + REDIS_GRACE_S
    while True:
        changed = notifier.changed()
        sealed = await _asked(store.manifest(step), answer_by, f"batch {step}'s manifest")
        response = None if sealed is None else await _batch_response(store, sealed, rank, world_size, accept)
        if response is not None:
            # Runs once the body is handed to the socket: observers waiting for the
            # hand-off (the rollout log) start then, not while the trainer receives it.
            response.background = BackgroundTask(store.mark_served, step)
            return response
        meta = await _asked(store.meta(), answer_by, "the published version")
        if step < meta["trimmed_below"]:
            raise HTTPException(status.HTTP_410_GONE, detail=_trimmed_message(step, meta))
        required = state.strategy.required_version(step)
        if meta["version"] < required:
            raise HTTPException(
                status.HTTP_409_CONFLICT,
                detail={
                    "message": f"batch {step} needs weights version >= {required}, but the "
                    f"published version is {meta['version']}: POST /weights_version with version "
                    f">= {required} before asking for this batch",
                    "required_version": required,
                    "published_version": meta["version"],
                },
            )
        producer = state.producer
        if (step < meta["version"] and not producer.building(step)
                and await _asked(store.claim_owner(step), answer_by, f"who builds batch {step}") is None):
            # Nobody builds it, and nobody will: a published version V says batches below V were
            # consumed, and a batch built now would hold samples from weights newer than its step.
            raise HTTPException(
                status.HTTP_410_GONE,
                detail={
                    "message": f"batch {step} was never sealed and will not be: version {meta['version']} is "
                    "published, which says every batch below it was consumed (a trainer publishes version N+1 "
                    "only after reading batch N; docs/sampler-api.md, 'Versions and batches'). Ask for batch "
                    f"{meta['version']} or later, or publish each version only after reading the batch before it",
                    "reason": "superseded",
                    "published_version": meta["version"],
                },
            )
        if not producer.building(step) and step not in producer.foreign:
            producer.wake()  # the plan comes from Redis: a step nobody builds is started, not waited for
        stalled = producer.stall(step, state.settings.generation_deadline)
        if stalled:
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, detail=stalled, headers={"Retry-After": "5"})
        if state.closing.is_set():
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE,
                                detail="the sampler is shutting down; retry (a restarted sampler keeps every batch)",
                                headers={"Retry-After": "1"})
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return Response(status_code=status.HTTP_204_NO_CONTENT)
        await wait_event(changed, remaining)


async def _asked(call: Awaitable[T], answer_by: float, what: str) -> T:
    """`call`'s Redis answer, or a redis TimeoutError (a 503 saying what was asked, guards.py)
    once the loop's clock passes `answer_by`."""
    bound = asyncio.timeout_at(answer_by)
    try:
        async with bound:
            return await call
    except TimeoutError:
        if not bound.expired():
            raise
        raise RedisTimeoutError(f"no answer from Redis for {what} within the request's timeout + "
                                f"{REDIS_GRACE_S:g} s") from None


async def _batch_response(store: Store, batch: SealedBatch, rank: int, world_size: int,
                          accept: str | None) -> Response | None:
    """This rank's share of `batch`, reading only the chunks that hold it; None when a chunk
    is gone (the batch was trimmed meanwhile: the caller looks again and answers 410)."""
    try:
        start, stop = share_range(batch.num_samples, rank, world_size)
    except ValueError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=str(exc)) from exc
    parts = pieces(batch.table, start, stop)
    try:
        buffers = await store.read_chunks(batch, [p.index for p in parts])
    except ChunkUnreadable as exc:
        raise HTTPException(status.HTTP_500_INTERNAL_SERVER_ERROR, detail={
            "message": f"batch {batch.step} is sealed but cannot be served: {exc}. Its bytes on disk were changed "
            "or lost outside the sampler (a full or failing disk, a copy that did not finish, an edit); every read "
            "would fail the same way. Restore the file, or restart the run from a checkpoint past step "
            f"{batch.step}",
            "reason": "damaged",
        }) from exc
    if buffers is None:
        if batch.files is not None and await store.manifest(batch.step) is not None:
            # Sealed and not trimmed, yet its files are not here: written where this sampler cannot see.
            raise HTTPException(
                status.HTTP_503_SERVICE_UNAVAILABLE, headers={"Retry-After": "5"},
                detail=f"batch {batch.step} is sealed, but its chunk files in {batch.files} are not readable here: "
                "every sampler replica of a run must see one batch_dir at the same path (a shared filesystem), "
                "or all must run with batch_store = redis (docs/sampler-api.md, 'How a batch is stored')")
        return None
    chunks = share_chunks(parts, buffers)  # each as pieces: views of the stored chunks, no copy
    media_type = negotiate(accept)
    if media_type == FRAMES:
        head = frame_head(step=batch.step, stats=batch.stats, chunk_lengths=[sum(map(len, c)) for c in chunks],
                          num_samples=stop - start, rank=rank, world_size=world_size)
        return FramesResponse([head, *(piece for chunk in chunks for piece in chunk)])
    # The other forms are transcoded, off the event loop: a large batch takes seconds.
    body = await asyncio.to_thread(_transcode, batch, [joined(c) for c in chunks], rank, world_size, media_type)
    return Response(body, media_type=media_type)


def _transcode(batch: SealedBatch, chunks: list, rank: int, world_size: int, media_type: str) -> bytes:
    body: dict[str, Any] = {"step": batch.step, "samples": samples_of_chunks(chunks), "stats": batch.stats}
    if world_size > 1:
        body["rank"], body["world_size"] = rank, world_size
    with gc_paused():
        return codec.encode(body, media_type)


class FramesResponse(Response):
    """A `FRAMES` body sent piece by piece from the stored chunks: no copy of the batch is made
    to answer (the server's flow control waits while the socket is full)."""

    media_type = FRAMES

    def __init__(self, pieces: list[Any]):
        super().__init__(status_code=200)
        self.pieces = pieces
        self.headers["content-length"] = str(sum(len(p) for p in pieces))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for piece in self.pieces:
            await send({"type": "http.response.body", "body": memoryview(piece), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if self.background is not None:
            await self.background()


def _trimmed_message(step: int, meta: dict[str, Any]) -> str:
    """What a 410 for a trimmed batch says: which batches are gone, why, and the two ways on
    (settings changed now cannot bring deleted batches back, so it does not suggest any)."""
    first = meta["trimmed_below"]
    why = (f"the trainer reported it would restart at step {meta['resume_step']}"
           if meta.get("resume_step") is not None
           else "no trainer reported a resume step, so only keep_batches kept them")
    return (f"batch {step} was trimmed: this run's batches below step {first} are deleted (published version "
            f"{meta['version']}; {why}). A trainer can continue this run only from a checkpoint of step "
            f"{first - 1} or later (its next step >= {first}); otherwise start the run afresh: a new sampler run "
            "(fresh run_dir or namespace) and the trainer with --no-resume or a new run_dir")
