"""The sampler's runtime state, owned by the app's lifespan and handed to routes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from services.sampler.config import SamplerSettings
from services.sampler.building.curriculum import Curriculum
from services.sampler.building.drill import Drill
from services.sampler.building.evals import Evals
from services.sampler.fleet.members import Fleet
from services.sampler.fleet.inference_pool import InferencePool
from services.sampler.storage.notify import Notifier
from services.sampler.observability.metrics import SamplerMetrics
from services.sampler.observability.recent import RecentRollouts
from services.sampler.observability.throughput import ThroughputHistory
from services.sampler.building.producer import Producer
from services.sampler.storage.redis_link import RedisLink
from services.sampler.storage.redis_server import EmbeddedRedis
from services.sampler.rollouts.rollout import Rollouts
from services.sampler.observability.rollout_log import RolloutLog
from services.sampler.building.sources import FreshGroups
from services.sampler.storage.store import Store
from services.sampler.building.strategies import Strategy
from services.sampler.storage.supervisor import Supervisor
from services.sampler.rollouts.vf.sessions import Sessions
from services.sampler.fleet.weight_sync import WeightSync
from services.sampler.fleet.weights_check import WeightsCheck
from shared.http_client import HttpClient


@dataclass
class SamplerState:
    settings: SamplerSettings
    redis: aioredis.Redis
    redis_url: str
    embedded: EmbeddedRedis | None
    # Whether Redis answers, and whether it restarted (redis_link.py).
    link: RedisLink
    drill: Drill
    store: Store
    notifier: Notifier
    http: HttpClient
    pool: InferencePool
    rollouts: Rollouts
    strategy: Strategy
    producer: Producer
    weight_sync: WeightSync
    fleet: Fleet
    evals: Evals
    rollouts_for: Callable[[str | None], Rollouts]
    source: FreshGroups
    curriculum: Curriculum | None
    supervisor: Supervisor
    # Observability (services/sampler/observability): the Prometheus registry, the
    # throughput history, the dashboard's recent rollouts; the Parquet rollout log when enabled.
    metrics: SamplerMetrics
    throughput: ThroughputHistory
    recent_rollouts: RecentRollouts
    rollout_log: RolloutLog | None
    # Open verifiers rollouts by trace id: POST /inference/v1/generate looks each call up here.
    sessions: Sessions = field(default_factory=Sessions)
    # Refuses checkpoints holding NaN/inf at POST /weights_version (weights_check.py).
    weights_check: WeightsCheck = field(default_factory=WeightsCheck)
    started_at: float = field(default_factory=time.time)
    # Set when the server begins a graceful shutdown: long-polls return at once.
    closing: asyncio.Event = field(default_factory=asyncio.Event)
