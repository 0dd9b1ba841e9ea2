"""Observability of one sampler: Prometheus metrics, throughput history, recent rollouts.

Contract:
* `Observability` is created by the app's lifespan and lives in `state.extra["observability"]`.
  It owns a private `CollectorRegistry` (never the process-global default one), so
  several samplers in one process (the tests) never share or clash on metrics.
* Event metrics (HTTP requests, sealed samples, rewards, staleness, seal latency,
  long-poll waits, weight-sync durations) are observed as they happen: HTTP by
  `HttpMetricsMiddleware`, batches by `on_sealed` (a producer hook), syncs by
  `on_synced` (a weight-sync hook).
* Counters the sampler already keeps (completions, tokens, inference errors and
  retries, per-server requests) are read at scrape time by a custom collector, so
  there is exactly one source of truth for each number.
* `run()` samples the completion/token counters once a second into a bounded history:
  the dashboard's throughput chart and the "recent" rates of /status come from it.
* Recent rollouts (text truncated) are kept in a bounded ring for the dashboard.

Metric names start with `tandem_sampler_`.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.sampler.inference_pool import OK, STATES

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from services.sampler.state import SamplerState
    from services.sampler.weight_sync import SyncResult

REWARD_BUCKETS = (-2.0, -1.0, -0.5, -0.25, 0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.5, 2.0, 5.0)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32)
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
LONG_POLL_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

RECENT_ROLLOUTS = 200
TEXT_LIMIT = 2000  # characters of prompt/completion kept per rollout for the dashboard
HISTORY_SECONDS = 600
RATE_WINDOW = 30.0  # seconds behind the "recent" throughput of /status


class _StateCollector(Collector):
    """Counters and gauges read from the live sampler state at scrape time."""

    def __init__(self, obs: Observability):
        self.obs = obs

    def collect(self) -> Iterable[Any]:
        state = self.obs.state
        pool, rollouts = state.pool, state.rollouts
        yield CounterMetricFamily("tandem_sampler_completions", "completions generated with the run's environment (training and its evals)",
                                  value=rollouts.completions_done)
        yield CounterMetricFamily("tandem_sampler_completion_tokens", "completion tokens generated with the run's environment (training and its evals)",
                                  value=rollouts.tokens_done)
        yield CounterMetricFamily("tandem_sampler_inference_errors", "failed inference attempts (5xx, transport)",
                                  value=pool.stats.errors)
        yield CounterMetricFamily("tandem_sampler_inference_retries", "inference attempts retried",
                                  value=pool.stats.retries)
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
            if server.last_probe is not None and server.last_probe.max_abs_diff is not None:
                probe_diff.add_metric([server.url], server.last_probe.max_abs_diff)
        yield from (requests, failures, version, healthy, outstanding, states, resyncs, probe_diff, probe_failures)
        yield CounterMetricFamily("tandem_sampler_inference_answers_dropped",
                                  "answers dropped because their server had lost its weights (restarted)",
                                  value=pool.stats.backwards)
        yield GaugeMetricFamily("tandem_sampler_in_flight_requests", "inference requests in flight",
                                value=pool.in_flight)
        yield GaugeMetricFamily("tandem_sampler_batches_in_progress", "batches being generated",
                                value=len(state.producer.in_progress))
        yield GaugeMetricFamily("tandem_sampler_next_step", "next step the producer will start",
                                value=state.producer.next_step)
        cached = self.obs.cached
        if "published_version" in cached:
            yield GaugeMetricFamily("tandem_sampler_published_version", "latest published weights version",
                                    value=cached["published_version"])
            yield GaugeMetricFamily("tandem_sampler_batches_ready", "sealed batches not yet consumed",
                                    value=cached["batches_ready"])


class Observability:
    def __init__(self, state: SamplerState):
        self.state = state
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
        self.rollouts: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_ROLLOUTS)
        # (unix time, completions, tokens) once a second.
        self.history: collections.deque[tuple[float, int, int]] = collections.deque(maxlen=HISTORY_SECONDS)

    # --- hooks ---------------------------------------------------------------------------

    def on_sealed(self, payload: dict[str, Any]) -> None:
        step, samples, stats = payload["step"], payload["samples"], payload["stats"]
        self.batches_sealed.inc()
        self.samples_sealed.inc(len(samples))
        self.last_step.set(step)
        self.last_reward.set(stats.get("reward_mean", 0.0))
        if stats.get("generation_seconds") is not None:
            self.seal_latency.observe(stats["generation_seconds"])
        reward, staleness = self.reward.observe, self.staleness.observe
        tokens = 0
        for s in samples:
            reward(s["reward"])
            staleness(step - s["policy_version"])
            tokens += len(s["completion_token_ids"])
        self.sealed_tokens.inc(tokens)
        # Only the last `maxlen` samples stay in the ring: build entries for those alone.
        recent = samples[-self.rollouts.maxlen:] if self.rollouts.maxlen is not None else samples
        for s in recent:
            self.rollouts.append({
                "step": step,
                "prompt_id": s["prompt_id"],
                "group_id": s["group_id"],
                "prompt": _clip(s.get("prompt_text")),
                "completion": _clip(s.get("completion_text")),
                "reward": s["reward"],
                "rewards": s.get("rewards", {}),
                "advantage": s.get("advantage"),
                "policy_version": s["policy_version"],
                "finish_reason": s.get("finish_reason"),
                "tokens": len(s["completion_token_ids"]),
            })

    def on_synced(self, result: SyncResult) -> None:
        outcome = "ok" if result.ok else "failed"
        self.weight_sync.labels(result.url, outcome).observe(result.seconds)
        self.weight_syncs.labels(result.url, outcome).inc()

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.http_requests.labels(method, route, str(status)).inc()
        self.http_seconds.labels(method, route).observe(seconds)
        if route == "/batch" and method == "GET":
            self.batch_wait.labels(str(status)).observe(seconds)

    # --- scrape and history --------------------------------------------------------------

    async def refresh(self) -> None:
        meta = await self.state.store.meta()
        sealed = await self.state.store.sealed_steps()
        self.cached = {"published_version": meta["version"],
                       "batches_ready": len([s for s in sealed if s >= meta["version"]])}

    async def render(self) -> bytes:
        await self.refresh()
        return generate_latest(self.registry)

    def sample(self) -> None:
        self.history.append((time.time(), self.state.rollouts.completions_done, self.state.rollouts.tokens_done))

    async def run(self, interval: float = 1.0) -> None:
        """Background task: sample the throughput counters every `interval` seconds."""
        while True:
            self.sample()
            await asyncio.sleep(interval)

    def throughput_series(self, smooth: float = 5.0) -> list[dict[str, float]]:
        """Completions/s and tokens/s over the history, each a rate over the last `smooth` seconds."""
        points = list(self.history)
        out = []
        j = 0
        for t, c, k in points:
            while j < len(points) and points[j][0] < t - smooth:
                j += 1
            t0, c0, k0 = points[j]
            dt = t - t0
            if dt > 0:
                out.append({"t": t, "completions_per_second": (c - c0) / dt, "tokens_per_second": (k - k0) / dt})
        return out

    def recent_rates(self) -> dict[str, float | None]:
        points = list(self.history)
        if len(points) < 2:
            return {"recent_completions_per_second": None, "recent_tokens_per_second": None,
                    "recent_window_seconds": None}
        now = self.state.rollouts.completions_done, self.state.rollouts.tokens_done
        t_now = time.time()
        first = next((p for p in points if p[0] >= t_now - RATE_WINDOW), points[0])
        dt = max(t_now - first[0], 1e-6)
        return {"recent_completions_per_second": (now[0] - first[1]) / dt,
                "recent_tokens_per_second": (now[1] - first[2]) / dt,
                "recent_window_seconds": dt}

    # --- views shared by /status and the dashboard ----------------------------------------

    async def version_times(self, count: int = 500) -> dict[int, float]:
        return await self.state.store.version_publish_times(count)

    async def recent_evals(self, count: int = 50) -> list[dict[str, Any]]:
        r, keys = self.state.redis, self.state.store.keys
        ids = await r.zrange(keys.evals, -count, -1)
        if not ids:
            return []
        raws = await r.mget([keys.eval(i.decode()) for i in ids])
        out = []
        for raw in raws:
            if not raw:
                continue
            record = json.loads(raw)
            result = record.get("result") or {}
            out.append({
                "eval_id": record["eval_id"], "status": record["status"],
                "created_at": record.get("created_at"), "finished_at": record.get("finished_at"),
                "env": result.get("env"), "num_examples": result.get("num_examples"),
                "reward_mean": result.get("reward_mean"), "policy_version": result.get("policy_version"),
                "error": record.get("error"),
            })
        return out


def _clip(text: str | None) -> str:
    if not text:
        return ""
    return text if len(text) <= TEXT_LIMIT else text[:TEXT_LIMIT] + "…"


def staleness_histogram(batches: list[dict[str, Any]]) -> dict[str, int]:
    """Samples per staleness value over `batches` (from each batch's policy_versions counts)."""
    counts: dict[int, int] = {}
    for b in batches:
        for version, n in (b.get("policy_versions") or {}).items():
            staleness = b["step"] - int(version)
            counts[staleness] = counts.get(staleness, 0) + n
    return {str(k): counts[k] for k in sorted(counts)}


def timeline(batches: list[dict[str, Any]], published: dict[int, float]) -> list[dict[str, Any]]:
    """Generation and training intervals per step.

    Generation of batch N: from `generation_started_at` to `sealed_at` (measured).
    Training of step N is derived: the trainer needs batch N sealed and version N
    published (it publishes N when it finishes step N-1), and it publishes version N+1
    when step N is done. So training spans max(sealed_at(N), published(N)) to
    published(N+1); version 0 is never published, so step 0 starts at its seal.
    Steps whose training has not finished have `train_end` null.
    """
    rows = []
    for b in sorted(batches, key=lambda b: b["step"]):  # seal order is not step order when k >= 1
        step = b["step"]
        start = b.get("sealed_at")
        if step > 0 and step in published:
            start = max(start or 0.0, published[step])
        elif step > 0:
            start = None  # version N not published yet: training has not started
        rows.append({
            "step": step,
            "gen_start": b.get("generation_started_at"),
            "gen_end": b.get("sealed_at"),
            "train_start": start,
            "train_end": published.get(step + 1) if start is not None else None,
        })
    return rows


class HttpMetricsMiddleware:
    """Counts requests and their duration by method, route template and status.

    Pure ASGI (no BaseHTTPMiddleware) so long-polls and streaming answers pass through
    untouched. The route template (`/eval/{eval_id}`) rather than the path keeps label
    cardinality bounded; paths matching no route are labelled `<unmatched>`.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            sampler = (scope.get("state") or {}).get("sampler")
            obs = sampler.extra.get("observability") if sampler is not None else None
            if obs is not None:
                obs.observe_request(scope["method"], _route_label(scope), status, time.perf_counter() - started)


def _route_label(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    if path:
        return path
    if scope.get("path", "").startswith("/static/"):
        return "/static/{path}"
    return "<unmatched>"


async def extend_status(state: SamplerState, body: dict[str, Any], recent: list[dict[str, Any]]) -> None:
    """Add the observability facts to a /status body (existing keys are kept as they are)."""
    obs: Observability | None = state.extra.get("observability")
    if obs is None:
        return
    published = await obs.version_times(50)
    body["versions"]["published_at"] = published.get(body["versions"]["published"])
    body["staleness"]["histogram"] = staleness_histogram(recent)
    body["throughput"].update(obs.recent_rates())
    evals = [e for e in await obs.recent_evals(10) if e["status"] == "done"]
    last = recent[-1] if recent else None
    body["rewards"] = {
        "last_batch_mean": last["reward_mean"] if last else None,
        "recent_mean": (sum(b["reward_mean"] for b in recent) / len(recent)) if recent else None,
        "last_eval": evals[-1] if evals else None,
    }
    body["timeline"] = timeline(recent[-10:], published)
    log_ = state.extra.get("rollout_log")
    body["rollout_log"] = log_.snapshot() if log_ is not None else None
