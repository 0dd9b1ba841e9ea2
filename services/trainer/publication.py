"""Publication off the trainer's critical path: a snapshot, then everything else in the background.

After optimizer step N the trainer (services/trainer/trainer.py) does one thing for version N+1
on its critical path: the snapshot (services/trainer/snapshot.py), the weights cast to the
publish dtype and copied into host buffers the optimizer does not touch. It hands that to
`Publisher.start` and trains step N+1 while the publisher, on two threads of its own and the
event loop:

  1. writes the version (services/trainer/checkpoint.py): a full one, or its difference from
     the previous version (shared/weights_delta.py) when a chain is open and shorter than
     `full_every`; the non-finite check happens there, so NaN never leaves the trainer;
  2. meanwhile, on the second thread, computes the probe (services/trainer/probe.py) from the
     snapshot, with a copy of the model of its own (`BackgroundProbe`), so the training thread
     never runs its forward (a LoRA run's probe is computed on the critical path instead: its
     adapter is small and its forward needs the live base);
  3. POSTs `/weights_version`, which answers when the servers are synced and probed;
  4. prunes old versions and calls `done(record)` (the step's metrics line, its evals).

`posted(version)` lets the trainer's prefetch of the next batch wait for the POST that makes
that batch possible instead of asking too early (a 409, then a retry after a back-off sleep).

Invariants:
* At most one publication is in flight. `wait()` (the trainer calls it before the next
  snapshot) waits for it and says how long: the step record's `publish_wait_s`. Its error, if
  any, is raised there, so a publication that fails stops the run at the next step.
* The snapshot of version N+1 is written into the buffer set the publication of version N
  no longer reads (two sets, swapped): the in-flight publication always reads its own.
* A version whose weights did not move (a step without signal) takes no snapshot and writes
  nothing: the previous version's directory and probe are announced again, in the background.
* A delta's base is the version the publisher wrote last, by its digest; a restarted trainer
  has none, so its first version is always full. Servers check the digest before applying.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.trainer import snapshot as snapshots

log = logging.getLogger("tandem.trainer.publication")

# A sparse delta stores an index (4 bytes) beside each changed value: past this share of the
# full version's bytes a full version is the better file, and the chain restarts there.
DELTA_MAX_SHARE = 0.5


@dataclass
class Job:
    """One version to publish. `tensors` is None when the weights did not move (`reuse`)."""

    version: int
    step: int
    tensors: dict[str, Any] | None
    record: dict[str, Any] | None  # the step's metrics record, filled in here; None: no metrics line
    probe_ids: list[int] | None = None  # the probe's tokens, computed here from the snapshot
    probe: dict[str, Any] | None = None  # a probe computed already (a LoRA run's)
    before_post: asyncio.Task | None = None  # awaited before the POST (the "before" eval)
    inline: bool = False  # the trainer waits for it at once: all of it counts as publish_wait_s


@dataclass
class Published:
    """What the newest written version leaves for the next one."""

    version: int  # the directory's version (a reused version points at an older directory)
    path: Path
    manifest: dict[str, Any]
    tensors: dict[str, Any] | None  # its snapshot: the next delta's base (None for an adapter)
    probe: dict[str, Any] | None
    chain_length: int = 0  # deltas since the chain's full version

    def facts(self) -> dict[str, Any]:
        """What the step's metrics say of it: published_bytes, publish_kind and, for a delta,
        delta_fraction (the share of values that changed)."""
        from services.trainer.checkpoint import dir_bytes

        out = {"published_bytes": dir_bytes(self.path), "publish_kind": self.manifest.get("kind", "full")}
        if "total_elements" in self.manifest:
            out["delta_fraction"] = self.manifest["changed_elements"] / max(self.manifest["total_elements"], 1)
        return out


@dataclass
class Writer:
    """How versions reach the disk: `full(version, step, tensors) -> path` and, for full
    weights, `delta(version, step, tensors, base: Published) -> (path, manifest)` (None: an
    adapter, always written whole)."""

    full: Callable[[int, int, dict[str, Any]], Path]
    delta: Callable[[int, int, dict[str, Any], Published], tuple[Path, dict[str, Any]]] | None = None


@dataclass
class Chain:
    """The versions a publisher writes (the native trainer's and the TRL bridge's): the newest
    (`last`, the next delta's base), the two snapshot buffer sets, and when to write whole."""

    full_every: int = 10
    last: Published | None = None
    _buffers: list[dict[str, Any]] = field(default_factory=lambda: [{}, {}])
    # After a delta is refused (most values moved, as with a tiny model at a large learning
    # rate), versions below this one are written whole without trying: a try diffs every tensor.
    _whole_until: int = 0

    def free_buffers(self) -> dict[str, Any]:
        """The buffer set the next snapshot may fill: not the one the newest version is in."""
        held = self.last.tensors if self.last is not None else None
        return self._buffers[1] if held is self._buffers[0] else self._buffers[0]

    def write(self, writer: Writer, version: int, step: int, tensors: dict[str, Any]) -> Published:
        """Version `version` on disk (on the publisher's thread), now `last`: a delta on `last`
        when the chain allows it (`last` holds a snapshot, the chain is shorter than
        `full_every`, no delta was refused in the last `full_every` versions, and the delta can
        be made and is small enough), else a full version."""
        from shared.weights_delta import DeltaError, read_manifest

        last = self.last
        if (writer.delta is not None and last is not None and last.tensors is not None
                and last.chain_length + 1 < self.full_every and version >= self._whole_until):
            try:
                path, manifest = writer.delta(version, step, tensors, last)
            except DeltaError as exc:
                self._whole_until = version + self.full_every
                log.info("version %d written whole: %s; the next delta is tried at version %d", version, exc,
                         self._whole_until)
            else:
                self.last = Published(version, path, manifest, tensors, None, last.chain_length + 1)
                return self.last
        path = writer.full(version, step, tensors)
        self.last = Published(version, path, read_manifest(path), tensors if writer.delta else None, None)
        return self.last


@dataclass
class Publisher:
    writer: Writer
    post: Callable[..., Awaitable[None]]  # (version, path, probe=, metrics=) -> awaited POST
    done: Callable[[Job], None]  # the step's record is complete (rank 0's metrics line, evals)
    prune: Callable[[Path], None]  # after each POST: old versions pruned, sparing this path
    chain: Chain = field(default_factory=Chain)
    probe: BackgroundProbe | None = None
    drill: Any = None
    metrics: Callable[[dict[str, Any]], dict[str, float]] = dict  # the record -> the POST's metrics
    _task: asyncio.Task | None = None
    _job: Job | None = None  # the one in flight
    _posted: asyncio.Event | None = None  # set once its POST has answered (or it ended without one)
    _pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tandem-publish"))
    _probe_pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tandem-probe"))

    # -- the critical path ----------------------------------------------------------------

    def snapshot(self, sharding: Any, model: Any, dtype: Any, *, trainable_only: bool = False) -> dict[str, Any] | None:
        """COLLECTIVE under fsdp (call on the training thread, after `wait`): rank 0's snapshot."""
        into = self.chain.free_buffers()
        snapshots.take(sharding, model, dtype, into, trainable_only=trainable_only)
        return into if sharding.is_main else None

    async def wait(self) -> float:
        """Wait for the publication in flight (none: 0); its error is raised here."""
        task, t0 = self._task, time.monotonic()
        if task is None:
            return 0.0
        try:
            await task
        finally:
            self._task = None
        return time.monotonic() - t0

    def start(self, job: Job) -> None:
        if self._task is not None and not self._task.done():
            raise RuntimeError(f"version {job.version}: a publication is still in flight (wait() first)")
        self._job, self._posted = job, asyncio.Event()
        self._task = asyncio.create_task(self._publish(job), name=f"publish-version-{job.version}")
        self._task.add_done_callback(lambda _, posted=self._posted: posted.set())

    async def posted(self, version: int) -> None:
        """Return once the sampler has (or may have) version `version`: at once unless version
        `version` is the one in flight (an older one was posted before it started; a newer one
        is not this publisher's yet), else when its POST has answered or it failed (the failure
        itself is raised by `wait()`, not here)."""
        job, posted = self._job, self._posted
        if self._task is None or job is None or posted is None or job.version != version:
            return
        await posted.wait()

    def warm(self) -> None:
        """Build the background probe's model on the probe's thread now (the first probe
        queues behind it)."""
        if self.probe is not None:
            self._probe_pool.submit(self.probe.build)

    async def close(self) -> None:
        """Stop a publication in flight (the run is failing) and the thread."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        self._pool.shutdown(wait=False)
        self._probe_pool.shutdown(wait=False)

    # -- the background -------------------------------------------------------------------

    async def _publish(self, job: Job) -> None:
        record = job.record if job.record is not None else {}
        started = time.monotonic()
        if job.tensors is None:
            last = self.chain.last
            if last is None:
                raise RuntimeError(f"version {job.version}: nothing published yet to announce again")
            path, probe = last.path, last.probe
            record["publish_kind"] = "reused"
        else:
            probing = None
            if job.probe is None and job.probe_ids is not None and self.probe is not None:
                # On a thread of its own while the version is written: both only read the snapshot.
                probing = asyncio.ensure_future(self._timed(record, "probe_s", self._probe_pool, self.probe.compute,
                                                            job.tensors, job.probe_ids))
            try:
                written = await self._timed(record, "write_s", self._pool, self.chain.write, self.writer,
                                            job.version, job.step, job.tensors)
            except BaseException:
                if probing is not None:
                    probing.cancel()
                raise
            record["written_at"] = time.time()
            record.update(written.facts())
            await self._point("written", job.step)
            probe = job.probe if probing is None else await probing
            await self._point("probed", job.step)
            written.probe = probe  # announced again with this version should the weights not move
            path = written.path
        if job.before_post is not None:
            await job.before_post  # the "before" eval must see the starting weights
        t0 = time.monotonic()
        await self.post(job.version, path, probe=probe, metrics=self.metrics(record) if job.record else None)
        record["publish_s"] = time.monotonic() - t0
        if self._posted is not None and self._job is job:
            self._posted.set()
        # Deleting old versions' files is system calls that can take milliseconds: on the
        # publication's thread, not the event loop the next batch's fetch runs on.
        await asyncio.get_running_loop().run_in_executor(self._pool, self.prune, path)
        await self._point("published", job.step)
        if job.inline:
            # Measured here, not by the caller: the metrics line is written now, before the
            # caller's wait returns.
            record["publish_wait_s"] = record.get("publish_wait_s", 0.0) + time.monotonic() - started
        self.done(job)

    async def _timed(self, record: dict[str, Any], key: str, pool: concurrent.futures.Executor, fn: Any,
                     *args: Any) -> Any:
        t0 = time.monotonic()
        result = await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        record[key] = time.monotonic() - t0
        return result

    async def _point(self, point: str, step: int) -> None:
        if self.drill is not None:
            await self.drill.point(point, step)


def weights_writer(root: Path, config: Any, dtype: Any) -> Writer:
    """How full weights reach the disk (services/trainer/checkpoint.py, versions.py): whole, or as a
    delta on the version before, refused past DELTA_MAX_SHARE of the whole. Shared with the TRL bridge."""
    from services.trainer import checkpoint as ckpt
    from services.trainer.versions import publish_delta

    def full(version: int, step: int, tensors: dict[str, Any]) -> Path:
        return ckpt.publish_weights(root, version, tensors, config, dtype=dtype, step=step)

    def delta(version: int, step: int, tensors: dict[str, Any], base: Published) -> tuple[Path, dict[str, Any]]:
        return publish_delta(root, version, tensors, base.tensors, base.manifest, config, dtype=dtype,
                             step=step, max_share=DELTA_MAX_SHARE)

    return Writer(full=full, delta=delta)


class BackgroundProbe:
    """The probe of a snapshot, computed off the training thread: a model of its own (built from
    the config on first use, in the training model's dtype, on its device) takes the snapshot's
    values, then runs `compute_probe` under autocast to the publish dtype, as the training
    thread used to on the live model. Its weights are the published (rounded) values, which is
    what the servers compute with."""

    def __init__(self, config: Any, device: Any, dtype: Any, publish_dtype: Any):
        self.config, self.device, self.dtype, self.publish_dtype = config, device, dtype, publish_dtype
        self.model: Any = None

    def build(self) -> None:
        """The probe's model, once (seconds at 0.5 B on a CPU: `Publisher.warm` builds it on the
        probe's thread while the first step trains, not inside the first publication)."""
        if self.model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_config(self.config, dtype=self.dtype).to(self.device).eval()
            self.model = model.requires_grad_(False)

    def compute(self, tensors: dict[str, Any], ids: list[int]) -> dict[str, Any]:
        import torch

        from services.trainer.probe import compute_probe_as_published

        self.build()
        own = self.model.state_dict()
        with torch.no_grad():
            for name, value in tensors.items():
                own[name].copy_(value, non_blocking=True)  # a tied LM head follows its embedding
        return compute_probe_as_published(self.model, ids, self.publish_dtype)

