"""Prometheus metrics of one CPU inference server, in a registry owned by that server
(no process-global state, so tests can run several servers in one process).

Names follow vLLM's where vLLM has the same quantity (`vllm:num_requests_running`,
`vllm:generation_tokens_total`, ...), so dashboards work against either backend; the
batching metrics vLLM lacks are `tandem_inference_*`.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class InferenceMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name}
        self._labels = labels
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "sequences in the running batch", list(labels), registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "sequences waiting to be admitted", list(labels), registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "prefilled prompt tokens", list(labels), registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "generated tokens", list(labels), registry=r)
        self.finished = Counter(
            "vllm:request_success", "finished sequences by finish reason",
            list(labels) + ["finished_reason"], registry=r,
        )
        self.batch_size = Histogram(
            "tandem_inference_batch_size", "sequences per batched decode step", list(labels),
            buckets=BATCH_BUCKETS, registry=r,
        )
        self.peak_batch = Gauge("tandem_inference_peak_batch_size", "largest batch so far", list(labels), registry=r)
        self.step_seconds = Histogram(
            "tandem_inference_step_seconds", "wall time of one engine step", list(labels), registry=r,
        )
        self.paused = Gauge("tandem_inference_paused", "1 while generation is paused", list(labels), registry=r)
        self.weight_reloads = Counter("tandem_inference_weight_reloads", "reload_weights calls", list(labels), registry=r)
        self.weight_version = Gauge(
            "tandem_inference_weight_version_info", "current weight-version label (value 1)",
            list(labels) + ["version"], registry=r,
        )

        # The labelled children, looked up once: `labels()` costs microseconds per call, and
        # on_finish runs for every sequence (128 per batch of the demo).
        self._step_children = (self.batch_size.labels(**labels), self.peak_batch.labels(**labels),
                               self.step_seconds.labels(**labels), self.prompt_tokens.labels(**labels),
                               self.generation_tokens.labels(**labels))
        self._finished: dict[str, Counter] = {}

    def bind(self, running: Callable[[], float], waiting: Callable[[], float], paused: Callable[[], float]) -> None:
        self.running.labels(**self._labels).set_function(running)
        self.waiting.labels(**self._labels).set_function(waiting)
        self.paused.labels(**self._labels).set_function(paused)

    def on_step(self, batch_size: int, peak: int, prompt_tokens: int, generated: int, seconds: float) -> None:
        sizes, peaks, step_seconds, prompts, generations = self._step_children
        sizes.observe(batch_size)
        peaks.set(peak)
        step_seconds.observe(seconds)
        if prompt_tokens:
            prompts.inc(prompt_tokens)
        generations.inc(generated)

    def on_finish(self, reason: str) -> None:
        child = self._finished.get(reason)
        if child is None:
            child = self._finished[reason] = self.finished.labels(**self._labels, finished_reason=reason)
        child.inc()

    def on_reload(self) -> None:
        self.weight_reloads.labels(**self._labels).inc()

    def on_version(self, old: str | None, new: str) -> None:
        if old is not None:
            self.weight_version.remove(*self._labels.values(), old)
        self.weight_version.labels(**self._labels, version=new).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
