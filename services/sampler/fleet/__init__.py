"""The inference fleet: the pool that fans requests out, membership and liveness checks, weight
syncs and the NaN/inf check of what they load. May import storage and config; never rollouts,
building, observability or api."""
