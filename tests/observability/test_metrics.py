"""GET /metrics: Prometheus text with the sampler's families and plausible values; a
registry per app (two samplers in one process count separately)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.observability.support import publish, run_eval, take_batch, train_steps


def scrape(url: str) -> dict[str, list]:
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    return families


def value(families, name: str, suffix: str = "", **labels: str) -> float:
    """The sample `name+suffix` with these labels (a subset match); 0 if absent."""
    total = 0.0
    for sample in families[name].samples:
        if sample.name == name + suffix and all(sample.labels.get(k) == v for k, v in labels.items()):
            total += sample.value
    return total


def test_metrics_families_and_values(make_sampler, standin):
    sampler = make_sampler(max_staleness=1, request_retries=5)
    # Two 503s from the inference server: the pool retries them, which must show.
    assert httpx.post(f"{standin.url}/_standin/fail", params={"count": 2}).status_code == 200
    batches = train_steps(sampler.url, range(3))
    publish(sampler.url, 4, checkpoint_path="/tmp/tandem-test-checkpoint-4")  # a real sync of the stand-in
    run_eval(sampler.url, num_examples=3)
    assert httpx.get(f"{sampler.url}/eval/does-not-exist").status_code == 404
    httpx.get(f"{sampler.url}/no/such/path")

    m = scrape(sampler.url)
    samples = sum(len(b["samples"]) for b in batches)
    assert samples == 48

    # HTTP: by route template, never by raw path.
    assert m["tandem_sampler_http_requests"].type == "counter"
    assert value(m, "tandem_sampler_http_requests", "_total", method="GET", route="/batch", status="200") == 3
    assert value(m, "tandem_sampler_http_requests", "_total", method="POST", route="/weights_version",
                 status="200") == 4
    assert value(m, "tandem_sampler_http_requests", "_total", route="/eval/{eval_id}", status="404") == 1
    assert value(m, "tandem_sampler_http_requests", "_total", route="<unmatched>", status="404") == 1
    routes = {s.labels["route"] for s in m["tandem_sampler_http_requests"].samples}
    assert not any("does-not-exist" in r for r in routes)
    assert value(m, "tandem_sampler_http_request_seconds", "_count", route="/batch") == 3
    assert value(m, "tandem_sampler_batch_wait_seconds", "_count", status="200") == 3

    # Completions and tokens: at least the sealed samples (the producer may be ahead).
    assert value(m, "tandem_sampler_completions", "_total") >= samples
    sealed_tokens = sum(len(s["completion_token_ids"]) for b in batches for s in b["samples"])
    assert value(m, "tandem_sampler_completion_tokens", "_total") >= sealed_tokens > 0
    sealed = value(m, "tandem_sampler_samples_sealed", "_total")
    assert sealed >= samples and sealed % 16 == 0

    # Rewards and staleness: one observation per sealed sample, sums that match the data.
    assert m["tandem_sampler_reward"].type == "histogram"
    assert value(m, "tandem_sampler_reward", "_count") == sealed
    assert value(m, "tandem_sampler_staleness", "_count") == sealed
    first = next(b for b in batches if b["step"] == 0)
    assert all(s["policy_version"] == 0 for s in first["samples"])
    assert 0 <= value(m, "tandem_sampler_staleness", "_sum") <= sealed  # k = 1
    assert value(m, "tandem_sampler_batch_seal_seconds", "_count") == sealed / 16
    assert value(m, "tandem_sampler_batch_seal_seconds", "_sum") > 0

    # Inference errors and retries from the two injected 503s.
    assert value(m, "tandem_sampler_inference_errors", "_total") >= 2
    assert value(m, "tandem_sampler_inference_retries", "_total") >= 2
    assert value(m, "tandem_sampler_inference_failures", "_total", server=standin.url) >= 2
    assert value(m, "tandem_sampler_inference_requests", "_total", server=standin.url) >= 12

    # Weight sync: the checkpoint publish synced the one server.
    assert value(m, "tandem_sampler_weight_sync_seconds", "_count", server=standin.url, outcome="ok") == 1
    assert value(m, "tandem_sampler_server_version", server=standin.url) == 4
    assert value(m, "tandem_sampler_published_version") == 4
    assert value(m, "tandem_sampler_server_healthy", server=standin.url) == 1
    assert value(m, "tandem_sampler_server_state", server=standin.url, state="ok") == 1
    states = {s.labels["state"]: s.value for s in m["tandem_sampler_server_state"].samples}
    assert states == {"joining": 0, "ok": 1, "down": 0, "resyncing": 0, "stale": 0, "mismatch": 0, "leaving": 0}
    assert [s.value for s in m["tandem_sampler_server_resyncs"].samples if s.name.endswith("_total")] == [0]
    assert [s.value for s in m["tandem_sampler_inference_answers_dropped"].samples if s.name.endswith("_total")] == [0]


def test_each_sampler_has_its_own_registry(make_sampler, namespace):
    a = make_sampler()
    b = make_sampler(namespace=namespace + "b")
    take_batch(a.url, 0)
    for _ in range(3):
        httpx.get(f"{a.url}/health")
    ma, mb = scrape(a.url), scrape(b.url)
    assert value(ma, "tandem_sampler_http_requests", "_total", route="/health") == 3
    assert value(mb, "tandem_sampler_http_requests", "_total", route="/health") == 0
    assert value(ma, "tandem_sampler_http_requests", "_total", route="/batch") == 1
    assert value(mb, "tandem_sampler_http_requests", "_total", route="/batch") == 0
