"""The sampler's runtime state, owned by the app's lifespan and handed to routes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from services.sampler.config import SamplerSettings
from services.sampler.curriculum import Curriculum
from services.sampler.evals import Evals
from services.sampler.fleet import Fleet
from services.sampler.inference_pool import InferencePool
from services.sampler.notify import Notifier
from services.sampler.producer import Producer
from services.sampler.redis_server import EmbeddedRedis
from services.sampler.rollout import Rollouts
from services.sampler.sources import FreshGroups
from services.sampler.store import Store
from services.sampler.strategy import Strategy
from services.sampler.weight_sync import WeightSync
from shared.http_client import HttpClient


@dataclass
class SamplerState:
    settings: SamplerSettings
    redis: aioredis.Redis
    redis_url: str
    embedded: EmbeddedRedis | None
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
    started_at: float = field(default_factory=time.time)
    # Set when the server begins a graceful shutdown: long-polls return at once.
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    extra: dict[str, Any] = field(default_factory=dict)
