"""The sampler's FastAPI app. The lifespan owns every client and background task.

Start-up: Redis (external, or the embedded one under run_dir), the W&B / TensorBoard
reporter when `report_to` names one (services/sampler/observability/tracking.py), the events
listener, the HTTP client for inference servers, the fleet (membership and health of the inference
servers), the producer and unfinished evals. Shutdown cancels the tasks within a deadline, closes the clients and
stops the embedded Redis if this process started it (its AOF keeps the data).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from services.sampler.api import guards
from services.sampler.storage import run_identity
from services.sampler.config import SamplerSettings
from services.sampler.building.curriculum import Curriculum
from services.sampler.building import drill as drills
from services.sampler.rollouts.envs import Environment, check_environment, load_environment
from services.sampler.building.evals import Evals
from services.sampler.fleet.members import Fleet
from services.sampler.fleet.inference_pool import InferencePool
from services.sampler.storage.keys import Keys
from services.sampler.rollouts.multiturn.stats import EnvStats
from services.sampler.rollouts.multiturn.workers import Workers
from services.sampler.storage.notify import Notifier
from services.sampler.api.request_metrics import HttpMetricsMiddleware
from services.sampler.observability import gc_tuning
from services.sampler.observability.metrics import SamplerMetrics
from services.sampler.observability.recent import RecentRollouts
from services.sampler.observability.throughput import ThroughputHistory
from services.sampler.observability.tracking import BatchReporter
from services.sampler.building.producer import Producer
from services.sampler.storage.redis_link import RedisLink
from services.sampler.storage.redis_server import EmbeddedRedis, start_embedded, watch_embedded
from services.sampler.storage.replay_store import ReplayPool
from services.sampler.rollouts.rollout import NonFiniteCounts, Rollouts
from services.sampler.observability.rollout_log import RolloutLog
from services.sampler.api.routes import (
    auth, batch, dashboard, evals, generate, health, inference_servers, metrics, status, weights,
)
from services.sampler.building.sources import FreshGroups
from services.sampler.api.state import SamplerState
from services.sampler.storage.chunk_files import ChunkFiles
from services.sampler.storage.store import Store
from services.sampler.building.strategies import Strategy, load_strategy
from services.sampler.storage.supervisor import Supervisor, install_task_dump
from services.sampler.rollouts.vf.environment import VerifiersLink
from services.sampler.rollouts.vf.sessions import Sessions
from services.sampler.fleet.weight_sync import WeightSync
from shared.http_client import HttpClient
from shared.settings import SettingsError
from shared.token_guard import TokenGuard, bearer_headers, dashboard_url
from shared.tracking import Reporter

log = logging.getLogger("tandem.sampler")

SHUTDOWN_DEADLINE = 10.0


@dataclass
class _Made:
    """What the lifespan has made so far: the cleanup closes exactly that, in order, whether the
    start-up finished or failed part-way."""

    embedded: EmbeddedRedis | None
    redis: aioredis.Redis
    http: HttpClient
    supervisor: Supervisor
    state: SamplerState | None = None
    rollouts: list[Rollouts] = field(default_factory=list)  # every environment's, made at start or later
    workers: Workers | None = None
    reporter: Reporter | None = None
    batch_reporter: BatchReporter | None = None


@asynccontextmanager
async def sampler_state(settings: SamplerSettings, env: Environment, strategy: Strategy) -> AsyncIterator[SamplerState]:
    embedded = None
    redis_url = settings.redis_url
    if not redis_url:
        embedded = await asyncio.to_thread(start_embedded, settings.run_dir / "redis")
        redis_url = embedded.url
    # No command here blocks server-side, so a plain socket timeout is safe; the
    # long-lived subscription in Notifier has its own connection without one.
    # One retry on a dropped connection: after a Redis restart every pooled connection is dead,
    # and each would otherwise fail one command. Every write here is idempotent (Lua SET NX,
    # compare-and-set, HSET), so sending one again is safe.
    redis = aioredis.from_url(redis_url, socket_timeout=settings.redis_timeout,
                              socket_connect_timeout=min(5.0, settings.redis_timeout), health_check_interval=15,
                              retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
    # Room for every request in flight plus the weight-sync and health-check calls (servers
    # can join at run time, hence the margin).
    # The run's token goes with every call to an inference server: they take the same one.
    http = HttpClient(max_connections=settings.max_concurrency + 2 * len(settings.inference_urls) + 64,
                      timeout=settings.request_timeout, headers=bearer_headers(settings.api_token))
    link = RedisLink(redis, redis_url)
    made = _Made(embedded=embedded, redis=redis, http=http, supervisor=Supervisor(link))
    try:
        await redis.ping()
        await link.start()
        made.state = state = await _assemble(settings, env, strategy, made, link, redis_url)
        await _start(state, settings)
        yield state
    finally:
        await _close(made, settings)


async def _assemble(settings: SamplerSettings, env: Environment, strategy: Strategy, made: _Made, link: RedisLink,
                    redis_url: str) -> SamplerState:
    """Every part of a running sampler, wired together; nothing started yet."""
    redis = made.redis
    keys = Keys(settings.namespace)
    # Before anything reads or writes the run: refuses a namespace holding another run.
    await run_identity.claim(redis, keys, settings, redis_url)
    # Before the first batch: a backend that cannot start (not logged in to W&B) refuses the start.
    # A sampler that continues the namespace's run (no --fresh) continues its W&B run; one per
    # port, so that replicas sharing a run_dir keep theirs apart.
    made.reporter = await asyncio.to_thread(
        Reporter.start, settings, "sampler", settings.model_dump(mode="json", exclude={"api_token", "redis_url"}),
        resume=not settings.fresh, instance=f"sampler-{settings.port}")
    files = (ChunkFiles(settings.chunk_dir, settings.batch_store_timeout)
             if settings.batch_store == "files" else None)
    store = Store(redis, keys, cache_bytes=settings.batch_cache_bytes, files=files,
                  write_timeout=settings.batch_store_timeout)
    # Chunk files a crash left behind, before this process writes any of its own.
    await store.sweep_orphans()
    notifier = Notifier(redis_url, keys.events, link)
    # Empty until the fleet loads the run's membership from Redis (seeded by inference_urls).
    pool = InferencePool([], max_concurrency=settings.max_concurrency,
                         request_timeout=settings.request_timeout, retries=settings.request_retries, http=made.http,
                         on_version_change=notifier.notify, seconds_per_token=settings.request_seconds_per_token,
                         request_floor=settings.request_floor)
    rollouts, rollouts_for, sessions = _rollouts(settings, env, pool, made)
    weight_sync = WeightSync(pool, store, resume_deadline=settings.resume_deadline,
                             step_timeout=settings.sync_step_timeout, reload_timeout=settings.reload_timeout,
                             adapter_name=settings.adapter_name)
    drill = drills.from_env(os.environ)  # inert unless a restart drill set TANDEM_DRILL_PAUSE
    curriculum = None
    if settings.curriculum:
        curriculum = Curriculum(settings.curriculum, seed=settings.seed, adaptive=settings.curriculum_adaptive,
                                redis=redis, key=keys.curriculum)
        await curriculum.load()
    source = FreshGroups(rollouts_for, env_name=env.name, prompts_per_step=settings.prompts_per_step,
                         seed=settings.seed, filter_zero_variance=settings.filter_zero_variance,
                         max_oversample=settings.max_oversample, curriculum=curriculum)
    producer = Producer(store=store, notifier=notifier, pool=pool, source=source, strategy=strategy,
                        replay_pool=ReplayPool(redis, keys), env_name=env.name, link=link, drill=drill,
                        claim_ttl=settings.claim_ttl, chunk_bytes=settings.batch_chunk_bytes)
    fleet = Fleet(pool, store, weight_sync, notifier, initial_urls=settings.inference_urls, owner=producer.owner,
                  check_interval=settings.server_check_interval, check_timeout=settings.server_check_timeout,
                  paused_grace=settings.paused_grace)
    # A restarted Redis may have lost the last writes it acknowledged: write back what this
    # process holds (batches it sealed, the version it published, the membership) first.
    link.on_restart += [producer.after_redis_restart, fleet.restore_members]
    eval_jobs = Evals(redis, keys, notifier, rollouts_for, lessons=curriculum.lessons if curriculum else None,
                      concurrency=settings.eval_concurrency or max(1, settings.max_concurrency // 4),
                      default_examples=settings.eval_examples, link=link)
    metrics, throughput, recent_rollouts, rollout_log = _observe(settings, made, pool, rollouts, producer, store,
                                                                 link, weight_sync)
    return SamplerState(settings=settings, redis=redis, redis_url=redis_url, embedded=made.embedded, link=link,
                        drill=drill, store=store,
                        notifier=notifier, http=made.http, pool=pool, rollouts=rollouts, strategy=strategy,
                        producer=producer, weight_sync=weight_sync, fleet=fleet, evals=eval_jobs,
                        rollouts_for=rollouts_for,
                        source=source, curriculum=curriculum, supervisor=made.supervisor, metrics=metrics,
                        throughput=throughput, recent_rollouts=recent_rollouts, rollout_log=rollout_log,
                        sessions=sessions)


def _rollouts(settings: SamplerSettings, env: Environment, pool: InferencePool, made: _Made
              ) -> tuple[Rollouts, Callable[[str | None], Rollouts], Sessions]:
    """The run's environment's rollouts, a way to the rollouts of any other environment an eval
    names (made once each), and the verifiers sessions they share."""
    sampling = {"temperature": settings.temperature, "top_p": settings.top_p}
    # Only when set: otherwise the environment's own top_k / min_p (if any) stand.
    sampling.update({name: value for name, value in (("top_k", settings.top_k), ("min_p", settings.min_p))
                     if value is not None})
    if settings.max_tokens is not None:
        sampling["max_tokens"] = settings.max_tokens

    # One tally of the non-finite rewards and logprobs kept out, over every environment.
    nonfinite = NonFiniteCounts()
    # One pool of worker threads and one tally of environment faults, for every environment.
    made.workers = workers = Workers(settings.env_workers)
    env_stats = EnvStats()
    # verifiers environments call back into this sampler's own POST /inference/v1/generate.
    sessions = Sessions()
    vf_link = VerifiersLink(base_url=settings.self_url, sessions=sessions, tokenizer=settings.vf_tokenizer,
                            renderer=settings.vf_renderer, request_timeout=settings.request_timeout,
                            api_token=settings.api_token, in_process=settings.vf_client == "in_process",
                            settle=gc_tuning.settle_episodes)

    def make_rollouts(environment: Environment) -> Rollouts:
        made.rollouts.append(Rollouts(environment, pool, prompts_per_step=settings.prompts_per_step,
                                      num_generations=settings.num_generations, sampling=sampling,
                                      seed=settings.seed, advantage=settings.advantage,
                                      model_name=settings.model_name, nonfinite=nonfinite, workers=workers,
                                      env_stats=env_stats, env_timeout=settings.env_timeout,
                                      env_retries=settings.env_retries, vf=vf_link))
        return made.rollouts[-1]

    rollouts = make_rollouts(env)

    @functools.lru_cache(maxsize=16)
    def rollouts_for(env_name: str | None) -> Rollouts:
        return rollouts if env_name in (None, "", settings.env) else make_rollouts(load_environment(env_name))

    return rollouts, rollouts_for, sessions


def _observe(settings: SamplerSettings, made: _Made, pool: InferencePool, rollouts: Rollouts, producer: Producer,
             store: Store, link: RedisLink, weight_sync: WeightSync
             ) -> tuple[SamplerMetrics, ThroughputHistory, RecentRollouts, RolloutLog | None]:
    """Observability: a per-app metrics registry, the throughput history, the dashboard's
    recent rollouts, the W&B / TensorBoard mirror and the Parquet rollout log, fed by the
    producer's and the weight sync's hooks."""
    metrics = SamplerMetrics(pool=pool, rollouts=rollouts, producer=producer, store=store, link=link)
    throughput = ThroughputHistory(rollouts)
    recent_rollouts = RecentRollouts()
    producer.on_sealed.append(metrics.on_sealed)
    producer.on_sealed.append(recent_rollouts.on_sealed)
    if made.reporter is not None:
        made.batch_reporter = BatchReporter(made.reporter, building=lambda: producer.in_progress.keys())
        producer.on_sealed.append(made.batch_reporter.on_sealed)
    weight_sync.on_synced.append(metrics.on_synced)
    rollout_log = None
    if settings.rollout_log:
        # Each file waits for its batch's hand-off to a trainer, at most a second.
        async def held_chunks(step: int) -> list[Any] | None:
            # The chunks this process sealed, when it still holds them (no chunk is read from Redis).
            batch = await store.manifest(step)
            return None if batch is None else batch.chunks

        rollout_log = RolloutLog(settings.run_dir / "rollouts", wait_for_handoff=lambda step: store.wait_served(step, 1.0),
                                 sealed_chunks=held_chunks)
        rollout_log.preload()
        producer.on_sealed.append(rollout_log.on_sealed)
    return metrics, throughput, recent_rollouts, rollout_log


async def _start(state: SamplerState, settings: SamplerSettings) -> None:
    """The background tasks started, the membership loaded, unfinished evals resumed."""
    supervisor, embedded = state.supervisor, state.embedded
    supervisor.spawn("redis link", state.link.run)
    supervisor.spawn("throughput", state.throughput.run)

    supervisor.spawn("events", state.notifier.run)
    await asyncio.wait_for(state.notifier.connected.wait(), 10)
    await state.fleet.start()
    supervisor.spawn("fleet", state.fleet.run)
    supervisor.spawn("producer", state.producer.run)
    await state.evals.resume_unfinished()
    log.info("sampler ready: env %s, strategy %s (max_staleness %s), %d inference server(s), redis %s",
             state.rollouts.env.name, state.strategy.name, settings.max_staleness, len(state.pool.servers),
             "embedded" if embedded else "external")
    # As Jupyter does: the link a person opens carries the token, and the page keeps it.
    log.info("dashboard: %s", dashboard_url(settings.self_url, settings.api_token))
    if not settings.api_token:
        log.warning("no api_token: every local user of this machine can read and steer the run "
                    "(set TANDEM_API_TOKEN to close it)")
    if embedded is not None:
        supervisor.spawn("embedded redis watchdog", functools.partial(watch_embedded, embedded))
    install_task_dump()


async def _close(made: _Made, settings: SamplerSettings) -> None:
    """Stop and close what `made` holds: batches in flight seal first, the clients close last."""
    state, supervisor = made.state, made.supervisor
    if state is not None:
        # Start nothing new, let batches in flight seal, then stop the rest.
        await supervisor.stop("producer", deadline=5.0)
        await state.producer.drain(settings.drain_deadline)
    await supervisor.shutdown(SHUTDOWN_DEADLINE)
    if state is not None:
        await state.fleet.shutdown()
        await state.evals.shutdown()
        await state.weight_sync.shutdown(SHUTDOWN_DEADLINE)
    for made_rollouts in made.rollouts:
        await made_rollouts.aclose()
    if made.workers is not None:
        made.workers.shutdown()
    if made.reporter is not None:
        # After the drain: the last batches sealed are reported too. W&B finishes its run here.
        if made.batch_reporter is not None:
            made.batch_reporter.flush()
        await asyncio.to_thread(made.reporter.close)
    await made.http.aclose()
    await made.redis.aclose()
    if made.embedded is not None and made.embedded.owned:
        await asyncio.to_thread(made.embedded.stop)


def create_app(settings: SamplerSettings, env: Environment | None = None, strategy: Strategy | None = None) -> FastAPI:
    if env is None:
        env = load_environment(settings.env, **settings.env_args)  # checks its settings
    else:
        check_environment(env)  # built by the caller: refuse its bad settings here, as load_environment does
    strategy = strategy or load_strategy(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, SamplerState]]:
        try:
            async with sampler_state(settings, env, strategy) as state:

                def begin_closing() -> None:
                    state.closing.set()
                    state.notifier.notify()

                # The server calls this on SIGTERM/SIGINT, before it waits for open requests,
                # so long-polls answer 503 at once instead of holding the shutdown up.
                app.state.begin_closing = begin_closing
                yield {"sampler": state}
        except SettingsError as exc:
            # A refusal at start-up (run_identity.py): the entrypoint reports it in one line.
            app.state.refused = exc
            raise

    app = FastAPI(title="Tandem sampler", version="0.1.0", lifespan=lifespan)
    for module in (health, auth, batch, weights, inference_servers, evals, generate, status, metrics, dashboard):
        app.include_router(module.router)
    app.mount("/static", StaticFiles(directory=dashboard.STATIC), name="static")
    app.add_middleware(HttpMetricsMiddleware)
    guards.install(app, settings.max_body_bytes)
    # Outermost: nothing runs for a request without the run's token (docs/operations.md, Security).
    app.add_middleware(TokenGuard, token=settings.api_token, open_paths=open_paths(settings),
                       browser_paths=dashboard.BROWSER_PATHS, service="the sampler")
    return app


def open_paths(settings: SamplerSettings) -> dict[str, str | None]:
    """The routes answered without the run's token: the health check, and Prometheus's scrape
    unless it has a token of its own."""
    return {"/health": None, "/metrics": settings.metrics_token}
