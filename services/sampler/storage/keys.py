"""Every Redis key the sampler uses, in one place.

All keys start with `tandem:<namespace>:` so that several runs can share one Redis
(and a `redis-cli --scan --pattern 'tandem:<ns>:*'` shows a run's whole state).
"""

from __future__ import annotations


class Keys:
    def __init__(self, namespace: str):
        if not namespace or any(c in namespace for c in " :*?[]"):
            raise ValueError(f"namespace {namespace!r} must be non-empty, without spaces, ':' or glob characters")
        self.prefix = f"tandem:{namespace}:"
        # Hash: version, checkpoint_path, trimmed_below.
        self.meta = self.prefix + "meta"
        # Hash: the run's identity (run_identity.py): setting -> JSON value, written by the
        # first sampler of the run; a later one with other values is refused.
        self.run = self.prefix + "run"
        # Sorted set of sealed steps (score = step), trimmed together with the batches.
        self.sealed = self.prefix + "sealed"
        # Hash: inference server URL -> JSON {version, state, error, ...}: what each serves.
        self.servers = self.prefix + "servers"
        # Hash: inference server URL -> JSON {added_at, source, removed_at}: which servers the
        # run uses. Seeded from `inference_urls` once; POST/DELETE /inference_servers change it.
        # A removed server keeps its entry (removed_at set), so a sampler restarted with the
        # same `inference_urls` does not bring back a server that was deliberately removed.
        self.members = self.prefix + "members"
        # Pub/sub channel: "sealed:<step>", "version:<v>", "eval:<id>", "servers".
        self.events = self.prefix + "events"
        # Stream of per-batch stats for dashboards, capped.
        self.batch_stats = self.prefix + "batch_stats"
        # Sorted set of eval ids by creation time, capped.
        self.evals = self.prefix + "evals"
        # JSON: the curriculum's per-lesson success rates (adaptive weights).
        self.curriculum = self.prefix + "curriculum"
        # Replay pool (strategy = replay): hashes group_id -> JSON meta / msgpack samples.
        self.replay_meta = self.prefix + "replay:meta"
        self.replay_data = self.prefix + "replay:data"
        # String: the latest published version's probe (shared/probe.py JSON), written with the
        # version; re-syncs and joins verify servers against it.
        self.probe = self.prefix + "probe"
        # Stream of the trainer's per-step metrics (sent with POST /weights_version), capped.
        self.trainer_metrics = self.prefix + "trainer_metrics"
        # Sorted set: published weights version -> unix time of its publication, capped
        # (the dashboard derives training time per step from it).
        self.published = self.prefix + "published"

    def batch(self, step: int) -> str:
        """Sealed batch `step`'s manifest: a hash of build (id), chunks (count), table (JSON:
        [samples, bytes] per chunk) and stats (JSON); written once, never modified."""
        return f"{self.prefix}batch:{step}"

    def chunk_prefix(self, step: int, build: str) -> str:
        """Chunk i of build `build` of batch `step` is this prefix + i (store.py's scripts
        build the same names)."""
        return f"{self.prefix}batch:{step}:{build}:"

    def claim(self, step: int) -> str:
        """Lease of the sampler replica generating batch `step` (owner id, expires)."""
        return f"{self.prefix}claim:{step}"

    def heal(self, url: str) -> str:
        """Lease of the sampler replica re-syncing inference server `url` (owner id, expires)."""
        return f"{self.prefix}heal:{url}"

    def eval(self, eval_id: str) -> str:
        """Hash of one eval job: status, request, result, error, timestamps."""
        return f"{self.prefix}eval:{eval_id}"
