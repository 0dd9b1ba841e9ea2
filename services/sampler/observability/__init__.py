"""Observability of one sampler: Prometheus metrics, throughput history, recent rollouts, the
W&B/TensorBoard mirror, the Parquet rollout log and the process's GC settings. May import
building, rollouts, fleet, storage and config; never api (the HTTP middleware and the /status
views that read the whole state live there).

Contract:
* The app's lifespan creates each part and keeps it in a typed field of `SamplerState`:
  `metrics` (`metrics.SamplerMetrics`), `throughput` (`throughput.ThroughputHistory`),
  `recent_rollouts` (`recent.RecentRollouts`); the Parquet rollout log, when enabled, is
  `rollout_log` (services/sampler/observability/rollout_log.py).
* `SamplerMetrics` owns a private `CollectorRegistry` (never the process-global default
  one), so several samplers in one process (the tests) never share or clash on metrics.
* Event metrics (HTTP requests, sealed samples, rewards, staleness, seal latency,
  long-poll waits, weight-sync durations) are observed as they happen: HTTP by
  `api/request_metrics.HttpMetricsMiddleware`, batches by `SamplerMetrics.on_sealed` (a producer hook),
  syncs by `SamplerMetrics.on_synced` (a weight-sync hook).
* Counters the sampler already keeps (completions, tokens, inference errors and
  retries, per-server requests) are read at scrape time by a custom collector, so
  there is exactly one source of truth for each number.
* `ThroughputHistory.run()` samples the completion/token counters once a second into a
  bounded history: the dashboard's throughput chart and the "recent" rates of /status
  come from it.
* Recent rollouts (text truncated) are kept in a bounded ring for the dashboard
  (`RecentRollouts.on_sealed`, another producer hook).
* `views` turns these, the store's batch stats and the eval jobs (read through `Evals`)
  into the /status and dashboard blocks.

Metric names start with `tandem_sampler_`.
"""
