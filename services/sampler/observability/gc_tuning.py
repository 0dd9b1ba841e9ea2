"""Garbage-collector settings of the `tandem sampler` process (entrypoint.py turns them on).

Python's cyclic collector walks every tracked object of a generation on each of its
collections. In the sampler nearly all of them are long-lived and never garbage: modules,
classes and functions (~85k objects once the app is imported, ~120k once the rollout log has
imported pyarrow and, through it, pandas). Under `bench throughput` (64 x 16 completions a
batch) the sampler ran a full collection every ~6 batches at ~80 ms each, and spent ~18% of
its CPU in the collector in all.

* `gc.freeze()` once start-up is done (the entrypoint imports the rollout log's modules
  before it; were they imported later, `settle` freezes them then) moves those objects to the
  permanent generation, which collections skip. It does not keep anything alive: a frozen
  object that loses its last reference is freed as usual; only a reference cycle among
  frozen objects is never collected, and the objects alive at that moment are the app itself.
* A larger generation-0 threshold: the default (700 allocations) runs a young collection
  every few groups of a batch, each examining objects that are mostly still in use (the
  samples of the batch being built).

* Once a verifiers environment's first episode has ended (`settle_episodes`, which
  vf/environment.py calls through VerifiersLink.settle): what episodes load lazily (the
  tokenizer and renderer, verifiers' modules: ~180k objects) is frozen too, and generation 0
  waits for `EPISODES_GEN0_THRESHOLD` allocations. 64 verifiers episodes in flight keep tens
  of thousands of young objects alive (trace graphs, pydantic models, pending calls): at
  10,000 a young collection ran ~10 times a second and every 10th a generation-1 one over
  them all, ~8% of the sampler's CPU (`bench verifiers`, vf_parity); at 50,000 the net
  allocations seldom get there, and the full collections every ~10 s walked the unfrozen
  modules (~140 ms each, ~20 ms once frozen).

Only the dedicated process does this (`enable`); an app served in someone else's process
(tests, embedding) keeps that process's settings, and `settle` is then a no-op.
"""

from __future__ import annotations

import gc

# Allocations (net of deallocations) of tracked objects between two generation-0 collections.
GEN0_THRESHOLD = 10_000
# The same once verifiers episodes run (settle_episodes).
EPISODES_GEN0_THRESHOLD = 50_000

_enabled = False


def enable() -> None:
    """Tune the collector for this process, and freeze what start-up made so far."""
    global _enabled
    _enabled = True
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
    settle()


def settle() -> None:
    """Collect, then freeze every object alive now (after start-up, or after a lazy import of
    large modules); a no-op unless `enable` was called in this process."""
    if _enabled:
        gc.collect()
        gc.freeze()


def settle_episodes() -> None:
    """`settle`, and generation 0's threshold raised to `EPISODES_GEN0_THRESHOLD` (never
    lowered); a no-op unless `enable` was called in this process."""
    if _enabled:
        gen0, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(max(gen0, EPISODES_GEN0_THRESHOLD), gen1, gen2)
        settle()
