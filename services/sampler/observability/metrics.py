"""The sampler's Prometheus metrics: a private registry, event metrics and a scrape-time collector.

Event metrics are observed as they happen (`on_sealed`, `on_synced`, `observe_request`);
the numbers the sampler already keeps are read by `_StateCollector` at scrape time. Metric
names start with `tandem_sampler_`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Iterable, Mapping
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.sampler.fleet.inference_pool import OK, STATES
from services.sampler.rollouts.multiturn.stats import FIELDS, EnvStats
from services.sampler.storage.redis_link import RedisLink, is_outage
from shared import contract

if TYPE_CHECKING:
    from services.sampler.fleet.inference_pool import InferencePool
    from services.sampler.building.producer import Producer
    from services.sampler.rollouts.rollout import NonFiniteCounts, Rollouts
    from services.sampler.storage.store import Store
    from services.sampler.fleet.weight_sync import SyncResult

REWARD_BUCKETS = (-2.0, -1.0, -0.5, -0.25, 0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.5, 2.0, 5.0)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32)
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
LONG_POLL_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def observe_counts(histogram: Histogram, counts: Mapping[float, int]) -> None:
    """`histogram.observe(value)` `count` times for each (value, count) of `counts`, with one
    update of each bucket and of the sum (observing each sample of a batch took ~2 us apiece,
    a lock per bucket and sum update). Buckets as `observe` picks them: the first upper bound
    >= the value; a NaN lands in none but counts in the sum. An unlabelled histogram of
    prometheus_client's own make is updated through its bucket values; any other is observed
    value by value."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if type(histogram) is not Histogram or not bounds or buckets is None or total is None or len(buckets) != len(bounds):
        for value, count in counts.items():
            for _ in range(count):
                histogram.observe(value)
        return
    per_bucket = [0] * len(bounds)
    amount = 0.0
    for value, count in counts.items():
        amount += value * count
        i = bisect_left(bounds, value)
        if i < len(bounds) and value <= bounds[i]:
            per_bucket[i] += count
    if counts:
        total.inc(amount)
    for bucket, count in zip(buckets, per_bucket):
        if count:
            bucket.inc(count)


class _StateCollector(Collector):
    """Counters and gauges read from the live sampler state at scrape time."""

    def __init__(self, metrics: SamplerMetrics):
        self.metrics = metrics

    def collect(self) -> Iterable[Any]:
        m = self.metrics
        pool, rollouts, producer = m.pool, m.rollouts, m.producer
        yield CounterMetricFamily("tandem_sampler_completions", "completions generated with the run's environment (training and its evals)",
                                  value=rollouts.completions_done)
        yield CounterMetricFamily("tandem_sampler_completion_tokens", "completion tokens generated with the run's environment (training and its evals)",
                                  value=rollouts.tokens_done)
        yield CounterMetricFamily("tandem_sampler_inference_errors", "failed inference attempts (5xx, transport)",
                                  value=pool.stats.errors)
        yield CounterMetricFamily("tandem_sampler_inference_retries", "inference attempts retried",
                                  value=pool.stats.retries)
        yield from _server_families(pool)
        yield from _nonfinite_families(rollouts.nonfinite)
        yield from env_metrics(rollouts.env_stats)
        yield CounterMetricFamily("tandem_sampler_inference_answers_dropped",
                                  "answers dropped because their server had lost its weights (restarted)",
                                  value=pool.stats.backwards)
        yield GaugeMetricFamily("tandem_sampler_in_flight_requests", "inference requests in flight",
                                value=pool.in_flight)
        yield GaugeMetricFamily("tandem_sampler_batches_in_progress", "batches being generated",
                                value=len(producer.in_progress))
        yield GaugeMetricFamily("tandem_sampler_next_step", "next step the producer will start",
                                value=producer.next_step)
        yield GaugeMetricFamily("tandem_sampler_steps_missing",
                                "unsealed steps behind the frontier that nobody builds and no server can build yet "
                                "(normally 0; healed as soon as one can)", value=len(producer.missing))
        healed = CounterMetricFamily("tandem_sampler_steps_healed",
                                     "steps and versions the sampler repaired (rebuilt, taken_over, restored, "
                                     "version_restored; see /status steps.healed)", labels=["how"])
        for how, count in sorted(producer.heals.counts.items()):
            healed.add_metric([how], count)
        yield healed
        yield CounterMetricFamily("tandem_sampler_builds_dropped",
                                  "batch builds dropped because the run had moved past their step (failed, or trimmed before the seal)",
                                  value=producer.dropped)
        link = m.link
        yield GaugeMetricFamily("tandem_sampler_redis_up", "1 while Redis answers", value=1 if link.reachable else 0)
        yield CounterMetricFamily("tandem_sampler_redis_outages", "times Redis became unreachable",
                                  value=link.outages)
        yield CounterMetricFamily("tandem_sampler_redis_restarts",
                                  "times Redis came back as a new process (its run id changed)", value=link.restarts)
        cached = m.cached
        if "published_version" in cached:
            yield GaugeMetricFamily("tandem_sampler_published_version", "latest published weights version",
                                    value=cached["published_version"])
            yield GaugeMetricFamily("tandem_sampler_batches_ready", "sealed batches not yet consumed",
                                    value=cached["batches_ready"])


class SamplerMetrics:
    """This app's metrics registry: the event metrics, and the collector over the live state."""

    def __init__(self, *, pool: InferencePool, rollouts: Rollouts, producer: Producer, store: Store,
                 link: RedisLink):
        self.pool, self.rollouts, self.producer, self.store, self.link = pool, rollouts, producer, store, link
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http_requests = Counter("tandem_sampler_http_requests", "HTTP requests served",
                                     ["method", "route", "status"], registry=r)
        self.http_seconds = Histogram("tandem_sampler_http_request_seconds", "HTTP request duration",
                                      ["method", "route"], buckets=SECONDS_BUCKETS, registry=r)
        self.batch_wait = Histogram("tandem_sampler_batch_wait_seconds",
                                    "GET /batch long-poll wait, by answer (200 ready, 204 timed out, ...)",
                                    ["status"], buckets=LONG_POLL_BUCKETS, registry=r)
        self.batches_sealed = Counter("tandem_sampler_batches_sealed", "batches sealed by this process", registry=r)
        self.samples_sealed = Counter("tandem_sampler_samples_sealed", "samples in sealed batches", registry=r)
        self.sealed_tokens = Counter("tandem_sampler_sealed_completion_tokens",
                                     "completion tokens in sealed batches", registry=r)
        self.reward = Histogram("tandem_sampler_reward", "reward of each sealed sample",
                                buckets=REWARD_BUCKETS, registry=r)
        self.staleness = Histogram("tandem_sampler_staleness", "staleness (step - policy_version) of each sealed sample",
                                   buckets=STALENESS_BUCKETS, registry=r)
        self.seal_latency = Histogram("tandem_sampler_batch_seal_seconds",
                                      "seconds from starting a batch to sealing it", buckets=SECONDS_BUCKETS, registry=r)
        self.last_reward = Gauge("tandem_sampler_last_batch_reward_mean", "mean reward of the last sealed batch",
                                 registry=r)
        self.last_step = Gauge("tandem_sampler_last_sealed_step", "step of the last sealed batch", registry=r)
        self.weight_sync = Histogram("tandem_sampler_weight_sync_seconds", "weight sync duration per server",
                                     ["server", "outcome"], buckets=SECONDS_BUCKETS, registry=r)
        self.weight_syncs = Counter("tandem_sampler_weight_syncs", "weight syncs per server and outcome",
                                    ["server", "outcome"], registry=r)
        # Values the sync collector cannot fetch itself (they live in Redis); refreshed by
        # `refresh()` before each scrape.
        self.cached: dict[str, Any] = {}
        r.register(_StateCollector(self))

    # --- hooks ---------------------------------------------------------------------------

    def on_sealed(self, payload: dict[str, Any]) -> None:
        step, samples, stats = payload["step"], payload["samples"], payload["stats"]
        self.batches_sealed.inc()
        self.samples_sealed.inc(len(samples))
        self.last_step.set(step)
        self.last_reward.set(stats.get("reward_mean", 0.0))
        if stats.get("generation_seconds") is not None:
            self.seal_latency.observe(stats["generation_seconds"])
        # A batch holds few distinct rewards and versions: one histogram update per value.
        observe_counts(self.reward, Tally(map(itemgetter("reward"), samples)))
        by_version = Tally(map(itemgetter("policy_version"), samples))
        stale: Tally = Tally()
        for version, count in by_version.items():
            stale[contract.staleness(step, version)] += count
        observe_counts(self.staleness, stale)
        self.sealed_tokens.inc(sum(map(len, map(itemgetter("completion_token_ids"), samples))))

    def on_synced(self, result: SyncResult) -> None:
        outcome = "ok" if result.ok else "failed"
        self.weight_sync.labels(result.url, outcome).observe(result.seconds)
        self.weight_syncs.labels(result.url, outcome).inc()

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.http_requests.labels(method, route, str(status)).inc()
        self.http_seconds.labels(method, route).observe(seconds)
        if route == "/batch" and method == "GET":
            self.batch_wait.labels(str(status)).observe(seconds)

    # --- scrape --------------------------------------------------------------------------

    async def refresh(self) -> None:
        try:
            meta = await self.store.meta()
            sealed = await self.store.sealed_steps()
        except Exception as exc:
            if not is_outage(exc):
                raise
            self.link.report(exc)  # scrape anyway: tandem_sampler_redis_up says why these are stale
            return
        self.cached = {"published_version": meta["version"],
                       "batches_ready": len([s for s in sealed if s >= meta["version"]])}

    async def render(self) -> bytes:
        await self.refresh()
        return generate_latest(self.registry)


_ENV_HELP = {
    "trajectories": "multi-turn trajectories completed",
    "turns": "model turns of multi-turn trajectories",
    "tool_calls": "tool calls the model made",
    "tool_errors": "tool calls that raised, were malformed or named no tool (answered with an error message)",
    "tool_timeouts": "tool calls that passed their timeout (answered with an error message)",
    "env_errors": "environment turns or rewards that raised or passed env_timeout",
    "trajectory_retries": "trajectories run again after an environment failure",
    "groups_dropped": "groups dropped (and refilled) after a trajectory failed every retry",
    "forks": "verifiers traces whose prompts stopped extending the sampled tokens (branches; the last one is the sample)",
}


def env_metrics(stats: EnvStats) -> list[CounterMetricFamily]:
    """`tandem_sampler_env_<counter>{env}`: what environments did (multiturn/stats.py)."""
    families = []
    for name in FIELDS:
        family = CounterMetricFamily(f"tandem_sampler_env_{name}", _ENV_HELP[name], labels=["env"])
        for env, counts in sorted(stats.by_env.items()):
            family.add_metric([env], getattr(counts, name))
        families.append(family)
    return families


def _server_families(pool: InferencePool) -> Iterable[Any]:
    """Per inference server: requests, failures, version, health, state, re-syncs, probes."""
    requests = CounterMetricFamily("tandem_sampler_inference_requests", "inference requests sent, per server",
                                   labels=["server"])
    failures = CounterMetricFamily("tandem_sampler_inference_failures", "failed inference requests, per server",
                                   labels=["server"])
    version = GaugeMetricFamily("tandem_sampler_server_version", "weights version a server serves (-1: unknown)",
                                labels=["server"])
    healthy = GaugeMetricFamily("tandem_sampler_server_healthy",
                                "1 when the server is in rotation and its last request succeeded", labels=["server"])
    states = GaugeMetricFamily("tandem_sampler_server_state",
                               "1 for the state each inference server is in (ok: in rotation; see /status for why not)",
                               labels=["server", "state"])
    resyncs = CounterMetricFamily("tandem_sampler_server_resyncs",
                                  "re-syncs of an inference server that restarted or fell behind", labels=["server"])
    probe_diff = GaugeMetricFamily("tandem_sampler_probe_max_abs_diff",
                                   "largest |server - trainer| prompt logprob in the server's last probe (nats)",
                                   labels=["server"])
    probe_failures = CounterMetricFamily("tandem_sampler_probe_failures",
                                         "syncs whose probe showed the server does not compute the trainer's "
                                         "logprobs", labels=["server"])
    foreign_pauses = CounterMetricFamily("tandem_sampler_server_foreign_pauses",
                                         "times a server was found paused with no weight sync holding it "
                                         "(someone else paused it) and resumed", labels=["server"])
    outstanding = GaugeMetricFamily("tandem_sampler_server_outstanding", "requests outstanding per server",
                                    labels=["server"])
    for server in pool.servers:
        requests.add_metric([server.url], server.requests)
        failures.add_metric([server.url], server.failures)
        version.add_metric([server.url], -1 if server.version is None else server.version)
        healthy.add_metric([server.url], 1 if server.state == OK and server.consecutive_failures == 0 else 0)
        outstanding.add_metric([server.url], server.outstanding)
        for name in STATES:
            states.add_metric([server.url, name], 1 if server.state == name else 0)
        resyncs.add_metric([server.url], server.resyncs)
        probe_failures.add_metric([server.url], server.probe_failures)
        foreign_pauses.add_metric([server.url], server.foreign_pauses)
        if server.last_probe is not None and server.last_probe.max_abs_diff is not None:
            probe_diff.add_metric([server.url], server.last_probe.max_abs_diff)
    yield from (requests, failures, version, healthy, outstanding, states, resyncs, probe_diff, probe_failures,
                foreign_pauses)


def _nonfinite_families(nonfinite: NonFiniteCounts) -> Iterable[Any]:
    """What was kept out for being NaN or infinite: rewards, groups, logprobs."""
    rewards = CounterMetricFamily("tandem_sampler_nonfinite_rewards",
                                  "completions whose reward or a reward part was NaN or infinite (train: their "
                                  "group was dropped; eval: left out of the means)", labels=["env", "split"])
    for (env, split), count in sorted(nonfinite.rewards.items()):
        rewards.add_metric([env, split], count)
    groups = CounterMetricFamily("tandem_sampler_nonfinite_groups_dropped",
                                 "training groups dropped (and refilled) for a non-finite reward", labels=["env"])
    for env, count in sorted(nonfinite.groups.items()):
        groups.add_metric([env], count)
    logprobs = CounterMetricFamily("tandem_sampler_nonfinite_logprobs",
                                   "completion tokens whose logprob the server sent as null or non-finite "
                                   "(masked out of the loss)", labels=["server"])
    for url, count in sorted(nonfinite.logprobs.items()):
        logprobs.add_metric([url], count)
    yield from (rewards, groups, logprobs)
