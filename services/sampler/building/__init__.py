"""Building batches: the producer that seals them in step order, where groups come from (sources,
curriculum, strategies), evals, and the drills' pause points. May import rollouts, fleet,
storage and config; never api or observability."""
