"""The producer: generates and seals batches in step order, as early as staleness allows.

Its plan is read from Redis on every pass, never kept in memory that a crash or a Redis
restart could make wrong. A pass (`_plan`) runs at start, on every change announced on
the events channel, when `GET /batch` asks for a step nobody builds (`wake`), and at least
every couple of seconds. It reads where the run stands:

* the floor: the first step the run may still need, max(trim mark, published version),
  where the published version is also at least the last one this process acknowledged;
* the frontier: the last step whose required version (the strategy's) is published and
  served by some inference server;
* which steps from the floor on are sealed, and which are claimed by a live replica.

Every step from the floor to the frontier must be sealed, being built here, or claimed by
a live replica; anything else is started now. A step behind the highest sealed step (or
behind where this process already planned) that nobody builds was lost (a crashed build, a
restarted Redis that dropped its seal): it is rebuilt, or, when this process still holds
the bytes it sealed, written back; both are recorded in `heals` (healing.py) for /status
and /metrics. A step below the floor is never started; one already being built when the
floor passed it still seals (its samples are within the staleness bound), or is dropped if
it fails.

A build (`_build`) generates the samples, packs them once and seals those bytes. While
Redis is unreachable it waits (`RedisLink.ride_out`) and seals the same bytes when Redis
is back, instead of generating the batch again. A batch never holds a sample from weights
newer than its step (negative staleness): such samples mean the run moved on meanwhile.

Replicas: several samplers on one Redis and namespace split the steps. Before building a
step, a replica takes its claim (a Redis lease, renewed while it works); a step whose
claim lapsed without a seal is taken over by the next pass of any replica.

Shutdown drains: the planner stops, and builds in flight get `drain()`'s deadline to
seal before they are cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from services.sampler.storage.chunk_files import StoreFailed
from services.sampler.building.drill import Drill
from services.sampler.storage.healing import HealLog
from services.sampler.fleet.inference_pool import OK, InferencePool
from services.sampler.storage import packing
from services.sampler.storage.notify import Notifier
from services.sampler.storage.packing import SealedBatch
from services.sampler.storage.redis_link import RedisLink, is_outage
from services.sampler.storage.replay_store import ReplayPool
from services.sampler.rollouts.rollout import summarize_batch
from services.sampler.building.sources import FreshGroups
from services.sampler.storage.store import Store
from services.sampler.building.strategies import BuildContext, Strategy
from shared import codec, contract
from shared.aio import wait_any, wait_event
from shared.chunks import samples_of_chunks

log = logging.getLogger("tandem.sampler.producer")

# A pass also runs this often without a change event: a wake-up published while the event
# subscription was down (Redis restarting), or a lapsed claim, announces nothing.
_RECHECK_SECONDS = 2.0
# How far past the floor one pass plans at most: a custom strategy whose required version
# never rises would otherwise have the producer build batches without end.
MAX_AHEAD = 256
# Batches estimated at least this large are packed in a worker thread (about 20 ms of packing).
_THREAD_PACK_BYTES = 16 << 20


@dataclass
class BuildProgress:
    """Where the build of one batch stands (GET /status, steps.in_progress)."""

    step: int
    min_version: int
    started_at: float = field(default_factory=time.time)
    attempts: int = 0
    seal_attempts: int = 0  # attempts at storing and sealing the packed bytes
    error: str | None = None
    # "generating", then "sealing" once the bytes are packed, then "sealed" (hooks running).
    phase: str = "generating"


class Producer:
    def __init__(self, *, store: Store, notifier: Notifier, pool: InferencePool, source: FreshGroups,
                 strategy: Strategy, replay_pool: ReplayPool, env_name: str, link: RedisLink,
                 drill: Drill | None = None, claim_ttl: float = 10.0,
                 chunk_bytes: int = packing.DEFAULT_CHUNK_BYTES):
        self.store = store
        self.notifier = notifier
        self.pool = pool
        self.source = source
        self.strategy = strategy
        # The replay strategy's pool (strategies see it as BuildContext.replay_pool).
        self.replay_pool = replay_pool
        self.env_name = env_name
        self.link = link
        self.drill = drill or Drill()
        self.chunk_bytes = chunk_bytes
        self.heals = HealLog()
        self.in_progress: dict[int, BuildProgress] = {}
        self.floor = 0
        self.next_step = 0
        # Steps up to here were planned before (or are behind a sealed step): an unsealed one
        # nobody builds below it is a lost step, not a new one.
        self.high_water = 0
        self.missing: list[int] = []  # lost steps the last pass found but could not start yet
        self.last_sealed: int | None = None
        self.last_error: str | None = None
        self.sealed_count = 0
        self.store_failures = 0  # attempts at storing a built batch that failed (StoreFailed, a Redis error)
        self.dropped = 0  # builds dropped because the run moved past their step (failed, or trimmed)
        self._tickets = 0
        self._builds: dict[int, asyncio.Task] = {}
        self.owner = uuid.uuid4().hex[:12]
        self.claim_ttl_ms = int(claim_ttl * 1000)
        self.foreign: set[int] = set()  # unsealed steps another replica is building
        # (required version, since) while no server is new enough for the next step.
        self.waiting: tuple[int, float] | None = None
        self.draining = False
        self._replan = asyncio.Event()
        # Called with each newly sealed batch payload (metrics, rollout logs); errors are logged.
        self.on_sealed: list[Callable[[dict[str, Any]], Awaitable[None] | None]] = []

    # --- planning --------------------------------------------------------------------------

    def wake(self) -> None:
        """Plan again now (GET /batch found a step that nobody builds)."""
        self._replan.set()

    def building(self, step: int) -> bool:
        return step in self._builds

    def follow_versions(self, servers: dict[str, dict[str, Any]]) -> None:
        """Take up per-server versions read from Redis (another replica may have synced them).
        Only servers in rotation: one this process took out (restarted, stale) is the fleet's
        to bring back, whatever an older record says."""
        for url, info in servers.items():
            server = self.pool.find(url)
            if (server is not None and server.state == OK and info.get("version") is not None
                    and (server.version is None or info["version"] > server.version)):
                self.pool.set_version(url, int(info["version"]))

    async def run(self) -> None:
        """Plan, start what the plan says, wait for a change; forever. A Redis outage is waited
        out (RedisLink), and the next pass plans from what Redis holds then."""
        recheck = min(_RECHECK_SECONDS, self.claim_ttl_ms / 2000)
        while True:
            changed = self.notifier.changed()
            self._replan.clear()
            try:
                await self._plan()
            except Exception as exc:
                if not is_outage(exc):
                    raise
                await self.link.ride_out(exc)
                continue
            await wait_any([changed, self._replan], recheck)

    async def _plan(self) -> None:
        meta, servers, sealed_steps = await self.store.plan_view()
        # Batches below the published version were consumed (a trainer publishes N+1 after
        # reading batch N); the version this process acknowledged counts even if Redis lost it.
        published = max(meta["version"], self.store.acked_version)
        floor = max(meta["trimmed_below"], published)
        self.floor = floor
        self.follow_versions(servers)
        best = self.pool.max_version()
        # The frontier: the last step whose required version is published and served. (A server
        # is ahead of the published version only while a publication is in flight.)
        servable = None if best is None else min(best, published)
        last = floor - 1
        while (servable is not None and last + 1 - floor < MAX_AHEAD
               and self.strategy.required_version(last + 1) <= servable):
            last += 1
        sealed = set(sealed_steps)  # those from `floor` on
        if sealed:
            self.high_water = max(self.high_water, max(sealed) + 1)
        missing = []
        for step in range(floor, min(max(last + 1, self.high_water), floor + MAX_AHEAD)):
            if step in sealed or step in self._builds:
                continue
            if self.store.held(step):
                # Sealed here, then lost by a restarted Redis: the same bytes go back.
                if await self.store.restore(step) == 1:
                    self.heals.record("restored", step=step, why="Redis had lost its seal; written back from memory")
                    log.warning("batch %d was missing from Redis (restarted?); wrote back the bytes sealed before", step)
                continue
            if step > last:
                # Lost, but no server is new enough to build it yet: reported, built when one is.
                if step not in self.foreign and await self.store.claim_owner(step) is None:
                    missing.append(step)
                continue
            claimed = await self.store.claim(step, self.owner, self.claim_ttl_ms)
            if claimed == 1:
                if step in self.foreign:
                    self.heals.record("taken_over", step=step, why="its replica's claim lapsed without a seal")
                    log.warning("taking over step %d: its replica's claim lapsed without a seal", step)
                elif step < self.high_water:
                    self.heals.record("rebuilt", step=step, why="unsealed behind the frontier and built by nobody")
                    log.warning("step %d was lost (unsealed, built by nobody, behind step %d); building it again",
                                step, self.high_water - 1)
                self.foreign.discard(step)
                self._start(step, self.strategy.required_version(step))
            elif claimed == 0:
                self.foreign.add(step)
            else:
                self.foreign.discard(step)
        self.foreign = {step for step in self.foreign if step >= floor}
        self.missing = missing
        self.high_water = max(self.high_water, last + 1)
        # The next step to start: the first one past the frontier that is neither sealed nor
        # being built (here or by a replica; a build started before the frontier moved back,
        # when its server died, counts). Waiting for a server
        # new enough for it is what stall() tells GET /batch after generation_deadline (waiting
        # for the trainer's next publication is not).
        upcoming = last + 1
        while upcoming in sealed or upcoming in self._builds or upcoming in self.foreign:
            upcoming += 1
        self.next_step = upcoming
        required = self.strategy.required_version(upcoming)
        if best is not None and best >= required:
            self.waiting = None
        elif self.waiting is None or self.waiting[0] != required:
            self.waiting = (required, time.monotonic())

    def _start(self, step: int, required: int) -> None:
        ticket = None
        if self.strategy.base_step(step) == step:
            ticket, self._tickets = self._tickets, self._tickets + 1
        task = asyncio.create_task(self._build(step, required, ticket), name=f"batch-{step}")
        self._builds[step] = task
        task.add_done_callback(lambda t, step=step: self._builds.pop(step, None) if self._builds.get(step) is t else None)

    async def _keep_claim(self, step: int) -> None:
        while True:
            await asyncio.sleep(self.claim_ttl_ms / 3000)
            try:
                renewed = await self.store.renew_claim(step, self.owner, self.claim_ttl_ms)
            except Exception as exc:  # noqa: BLE001 - Redis blips must not kill the build
                if is_outage(exc):
                    self.link.report(exc)
                else:
                    log.warning("could not renew the claim on step %d: %s", step, exc)
                continue
            if renewed == 0:
                log.warning("lost the claim on step %d (another replica may build it too; sealing is idempotent)", step)
            elif renewed == 2:
                log.info("the claim on step %d was gone from Redis (restarted?); took it again", step)

    async def drain(self, deadline: float) -> None:
        """Give builds in flight `deadline` seconds to seal, then cancel the rest."""
        if not self._builds:
            return
        # A build that is failing (inference down) would only burn the deadline: stop it now,
        # and let any build that fails from here on give up instead of retrying.
        self.draining = True
        self.pool.closing = True
        builds = list(self._builds.items())
        failing = [task for step, task in builds if (p := self.in_progress.get(step)) is not None and p.error]
        for task in failing:
            task.cancel()
        log.info("draining %d batch build(s) for up to %.0fs (%d failing ones cancelled)",
                 len(builds) - len(failing), deadline, len(failing))
        _, pending = await asyncio.wait([task for _, task in builds], timeout=deadline)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def stall(self, step: int, deadline: float) -> str | None:
        """Why batch `step` has made no progress for over `deadline` seconds, if it has not."""
        now = time.monotonic()
        if self.waiting is not None and now - self.waiting[1] > deadline and step >= self.next_step:
            why = self.pool.unavailable_reason(self.waiting[0]) or "; ".join(s.describe() for s in self.pool.servers)
            return f"batch {step} cannot start: for {now - self.waiting[1]:.0f}s {why}"
        progress = self.in_progress.get(step)
        if progress is None:
            return None
        blocked = self.pool.blocked_since
        if blocked is not None and now - blocked > deadline:
            why = self.pool.unavailable_reason(progress.min_version)
            if why:
                return f"batch {step} has waited {now - blocked:.0f}s for an inference server: {why}"
        if progress.error and time.time() - progress.started_at > deadline:
            return (f"batch {step} has failed to build for {time.time() - progress.started_at:.0f}s "
                    f"({progress.attempts} attempts); last error: {progress.error}")
        return None

    # --- building ----------------------------------------------------------------------------

    async def _samples(self, step: int, required: int, ticket: int | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        base = self.strategy.base_step(step)
        if ticket is None:
            return await self._reuse(step, base), {"reused_from_step": base}
        ctx = BuildContext(step=step, min_version=required, source=self.source, replay_pool=self.replay_pool,
                           env_name=self.env_name, ticket=ticket)
        samples = await self.strategy.assemble(ctx)
        return samples, ctx.stats

    async def _reuse(self, step: int, base: int) -> list[dict[str, Any]]:
        """Batch `step` serves batch `base`'s samples again, one more use each."""
        while True:
            changed = self.notifier.changed()
            sealed = await self.store.get_batch(base)
            if sealed is not None:
                break
            await wait_event(changed, _RECHECK_SECONDS)
        samples = samples_of_chunks(sealed.chunks or [])
        for sample in samples:
            sample["use_count"] = contract.use_count_after_reuse(sample.get("use_count", 1), step, base)
        return samples

    async def _generate(self, step: int, required: int, ticket: int | None,
                        progress: BuildProgress) -> tuple[dict[str, Any], SealedBatch] | None:
        """Batch `step`'s payload and its chunks; None when shutting down after a failure."""
        delay = 0.5
        while True:
            progress.attempts += 1
            try:
                samples, extra = await self._samples(step, required, ticket)
                newer = sorted({s["policy_version"] for s in samples if s["policy_version"] > step})
                if newer:
                    raise RuntimeError(
                        f"samples from weights version(s) {newer}, newer than the batch's step {step} (negative "
                        f"staleness): a version above {step} was served before batch {step} was read; the trainer "
                        f"publishes version N+1 only after reading batch N")
                stats = {**summarize_batch(step, samples, progress.started_at, time.time()).model_dump(), **extra}
                # The on-sealed hooks get typed arrays (the rollout log builds its token columns
                # from them without touching each number); fresh groups made theirs when they
                # finished (FreshGroups), so only reused or replayed samples are converted here.
                payload = codec.with_arrays({"step": step, "samples": samples, "stats": stats})
                # A large batch is packed in a worker thread: that takes seconds, during which
                # the event loop must go on answering (other ranks, /health, the inference
                # traffic of other builds); the copies release the GIL, and each chunk's file is
                # written as soon as it is packed. A small one is packed here: handing it to a
                # thread costs more CPU than it saves (bench throughput: ~4 us per completion at
                # 1,024 samples of 16 tokens).
                samples = payload["samples"]
                if packing.estimate_bytes(samples) < _THREAD_PACK_BYTES:
                    return payload, packing.pack(step, samples, stats, self.chunk_bytes)
                return payload, await packing.pack_writing(step, samples, stats, self.chunk_bytes, self.store.files)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep producing; the error is surfaced in /status
                if is_outage(exc) and not self.draining:
                    progress.error = f"step {step}: waiting for Redis ({type(exc).__name__})"
                    await self.link.ride_out(exc)
                    continue
                progress.error = self.last_error = f"step {step}: {type(exc).__name__}: {exc}"
                if self.draining:
                    log.warning("batch %d failed while shutting down; not retrying: %s", step, exc)
                    return None
                if step < self.floor:
                    # Started before version > step was published (a resumed trainer, or one that
                    # publishes before reading): nobody will ask for it, so it is not retried.
                    log.warning("batch %d failed (%s) after the run moved past it (it stands at step %d); "
                                "dropping it", step, exc, self.floor)
                    self.dropped += 1
                    return None
                log.error("building batch %d failed (attempt %d): %s; retrying in %.1fs",
                          step, progress.attempts, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def _seal(self, step: int, packed: SealedBatch, progress: BuildProgress) -> int | None:
        """Seal these chunks, retried (the same chunks) until Redis takes them; None when shutting
        down. 1 sealed now, 0 another build sealed it first, -1 trimmed before it was sealed."""
        delay = 0.5
        while True:
            progress.seal_attempts += 1
            try:
                return await self.store.seal(step, packed, staged=lambda: self.drill.point("staged", step),
                                             writing=lambda: self.drill.point("writing", step))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the batch is built: never lose it to a blip
                if self.draining:
                    log.warning("batch %d was built but could not be sealed while shutting down: %s", step, exc)
                    return None
                if is_outage(exc):
                    progress.error = f"step {step}: built, waiting for Redis to seal it ({type(exc).__name__})"
                    await self.link.ride_out(exc)
                    continue
                self.store_failures += 1
                if isinstance(exc, StoreFailed):  # its message names the batch, its size and the bound
                    progress.error = self.last_error = str(exc)
                else:
                    progress.error = self.last_error = f"step {step}: sealing failed: {type(exc).__name__}: {exc}"
                log.error("sealing batch %d failed (attempt %d): %s; trying the same bytes again in %.1fs",
                          step, progress.seal_attempts, progress.error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def _build(self, step: int, required: int, ticket: int | None) -> None:
        progress = self.in_progress[step] = BuildProgress(step, required)
        keeper = asyncio.create_task(self._keep_claim(step), name=f"claim-{step}")
        try:
            await self.drill.point("claimed", step)
            built = await self._generate(step, required, ticket, progress)
            if built is None:
                return
            payload, packed = built
            progress.phase = "sealing"
            await self.drill.point("built", step)
            outcome = await self._seal(step, packed, progress)
            if outcome is None:
                return
            progress.phase = "sealed"
            if outcome == 1:
                await self.drill.point("sealed", step)
            self.notifier.notify()
            if outcome == 1:
                await self._after_seal(step, payload, packed.nbytes)
            elif outcome == -1:
                self.dropped += 1
                log.info("batch %d was trimmed before it was sealed; dropped", step)
        finally:
            keeper.cancel()
            if self.in_progress.get(step) is progress:
                del self.in_progress[step]
            try:
                await self.store.release_claim(step, self.owner)
            except Exception:  # noqa: BLE001 - the lease expires by itself
                pass

    async def _after_seal(self, step: int, payload: dict[str, Any], nbytes: int) -> None:
        stats = payload["stats"]
        self.sealed_count += 1
        self.last_sealed = step if self.last_sealed is None else max(self.last_sealed, step)
        self.last_error = None
        try:
            await self.store.add_batch_stats(stats)
        except Exception as exc:  # noqa: BLE001 - dashboard data; the batch itself is sealed
            if not is_outage(exc):
                raise
            self.link.report(exc)
            log.info("batch %d is sealed, but its stats did not reach the dashboard stream: Redis went away", step)
        if nbytes >= _THREAD_PACK_BYTES:
            # The hooks walk every sample on the event loop (~45 ms at 1 GiB), which would hold up
            # the hand-off's first sends: they wait for it (at most a second), as the rollout log does.
            await self.store.wait_served(step, 1.0)
        await self._run_hooks(payload)
        log.info("sealed batch %d: %d samples, reward %.3f, staleness mean %.2f, %.2fs",
                 step, stats["num_samples"], stats["reward_mean"], stats["staleness_mean"],
                 stats["generation_seconds"])

    async def _run_hooks(self, payload: dict[str, Any]) -> None:
        for hook in self.on_sealed:
            try:
                result = hook(payload)
                if asyncio.iscoroutine(result):
                    await result
            except Exception:  # noqa: BLE001 - an observer must never stop production
                log.exception("on_sealed hook %r failed for batch %d", hook, payload["step"])

    # --- after a Redis restart ---------------------------------------------------------------

    async def after_redis_restart(self) -> str | None:
        """RedisLink callback: write back what this process acknowledged and the new Redis lacks."""
        restored, republished = await self.store.reverify()
        for step in restored:
            self.heals.record("restored", step=step, why="a restarted Redis had lost it; written back from memory")
        if republished is not None:
            self.heals.record("version_restored", version=republished,
                              why="a restarted Redis had lost this published version; published again")
        self.wake()
        parts = []
        if restored:
            parts.append(f"wrote back sealed batch(es) {restored} from memory")
        if republished is not None:
            parts.append(f"published version {republished} again")
        return "; ".join(parts) or None

    def snapshot(self) -> dict[str, Any]:
        return {
            "next_step": self.next_step,
            "floor": self.floor,
            "last_sealed_step": self.last_sealed,
            "sealed_since_start": self.sealed_count,
            "in_progress": [
                {"step": p.step, "min_version": p.min_version, "started_at": p.started_at,
                 "attempts": p.attempts, "seal_attempts": p.seal_attempts, "error": p.error, "phase": p.phase}
                for p in sorted(self.in_progress.values(), key=lambda p: p.step)
            ],
            "missing": self.missing,
            "healed": self.heals.snapshot(),
            "dropped_builds": self.dropped,
            "store_failures": self.store_failures,
            "last_error": self.last_error,
            "replica": self.owner,
            "claimed_elsewhere": sorted(self.foreign),
            "waiting_for_version": self.waiting[0] if self.waiting else None,
        }
