"""The trainer loop: batch N from the sampler -> one optimizer step -> checkpoint -> version N+1.

`await train(settings)` (or `run(settings)` from synchronous code) runs until
`settings.max_steps` optimizer steps exist and returns a summary dict:

    {"steps", "start_step", "final_step", "final_version", "wall_seconds",
     "wait_seconds", "train_seconds", "trainer_wait_fraction", "staleness_mean",
     "reward_mean_first", "reward_mean_last", "eval_reward_before", "eval_reward_after",
     "evals", "last_checkpoint", "last_published", "skipped_steps_no_signal",
     "skipped_steps_non_finite", "metrics_path", "world_size"}

and writes the same to `run_dir/trainer_summary.json` (rank 0).

`Trainer.run` reads top to bottom: `start()`, then `step(N)` for each step, then `finish()`.

Start-up (`Trainer.start`): GET /status (retried, with a line every `wait_log_interval`, for
`retry_for` seconds) supplies the sampler's batch shape, temperature, max_tokens and
max_staleness; a batch-shape, reuse or retention disagreement (shared/contract.py) stops the
trainer with a message naming the numbers, and so do a token the sampler refuses (`GET
/auth`) and a `--model` that is no model (services/trainer/preflight.py), all before the
model loads; so does a `report_to` backend that cannot start (rank 0 starts its reporter
there, shared/tracking.py). Then the process's place in the job (services/trainer/world.py), how parameters
are spread over the ranks (services/trainer/sharding.py: ddp or fsdp), and the model,
optimizer and reference model (services/trainer/model_setup.py); with a full checkpoint in
run_dir/checkpoints (and `resume`) the run continues at step = its version, and rank 0
publishes and announces that version again, in case the previous run died between saving
and publishing. When the sampler is already past it (the run died after publishing later
versions), the trainer re-trains the steps since the checkpoint on the same batches (the
sampler kept them: every version carries the trainer's `resume_step`, the step after its
newest checkpoint), marks their records `retrained`, and publishes from the first version
the sampler has not seen; the metrics file is repaired first
(services/trainer/metrics_history.py). A sampler that has already deleted the batches the
resume needs is refused here, naming the way out.

Per step N (`Trainer.step`), on every rank:
  1. `GET /batch?step=N&rank=R&world_size=W` (prefetched during step N-1 when the
     sampler's max_staleness >= 1, since batch N may then be generated from version N-1);
  2. `Learner.train_on_samples` (in a worker thread, so evals and the prefetch progress
     on the event loop meanwhile), then this rank's sums over its share (`rank_sums`),
     all-reduced over the ranks;
  3. publication (services/trainer/checkpoint.py): the full weights are gathered (a
     collective under fsdp) and rank 0 writes them, in `publish_dtype`, to
     `publish_dir/version-{N+1}` atomically; the probe (the first sample's logprobs under
     the new weights, services/trainer/probe.py) is computed; every `checkpoint_every`
     steps, and after the last, a full checkpoint `run_dir/checkpoints/step-N` (float32
     weights + optimizer state, sharded under fsdp) is written too. A LoRA run gathers, publishes
     and checkpoints its adapter alone (services/trainer/lora.py; the probe is base + adapter,
     the POST says `adapter`). Rank 0 POSTs
     `/weights_version` with version N+1, the published path, the probe and the step's
     metrics, prunes old versions and checkpoints, appends a metrics line; the other ranks
     wait at a barrier, so nobody asks for batch N+1 before version N+1 is published. A
     step that left the weights as they were (no signal, non-finite) publishes its
     predecessor's directory again under the new version: nothing is written;
  4. every rank checks the step's behaviour_mismatch (services/trainer/mismatch.py):
     after `behaviour_mismatch_patience` steps in a row above `max_behaviour_mismatch`
     the run stops with `BehaviourMismatchError`, its last checkpoint written.

Evals (rank 0): one before training (its result is awaited before the first new
version is published, so it measures the starting weights), one every `eval_every` steps in the background,
and one after the last step, awaited (`Trainer.finish`, which then writes the summary).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from services.trainer import checkpoint as ckpt
from services.trainer import drill as drills
from services.trainer import metrics_history, preflight
from services.trainer.agreement import accept_sampler_config, resolve_temperature
from services.trainer.checkpointing import Checkpoints
from services.trainer.config import TrainerSettings
from services.trainer.evals import Evals
from services.trainer.metrics import METRICS_FILE, MetricsLogger, ProgressBar, describe
from services.trainer.mismatch import BehaviourMismatchError, MismatchGuard
from services.trainer.model_setup import set_up_model
from services.trainer.publication import BackgroundProbe, Chain, Job, Publisher, Writer, weights_writer
from services.trainer.run_state import RunState
from services.trainer.step_record import (
    all_reduce_rank_sums,
    learning_rate,
    published_metrics,
    rank_sums,
    step_record,
)
from services.trainer.world import World
from shared import contract
from shared.client import BatchNotReady, SamplerClient, VersionConflict
from shared.tracking import Reporter
from shared.wire import Batch

log = logging.getLogger("tandem.trainer")


# -- the loop ------------------------------------------------------------------------------


class Trainer:
    def __init__(self, settings: TrainerSettings, client: SamplerClient | None = None):
        self.settings = settings
        self._client = client  # the caller's, closed by the caller; None: run() makes and closes one
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-train")
        self.evals: Evals | None = None  # rank 0's evals, set by start()
        self.drill = drills.from_env(os.environ)  # inert unless a kill drill set TANDEM_TRAINER_DRILL_PAUSE
        # Set by start():
        self.world: World | None = None
        self.client: SamplerClient | None = None
        self.metrics: MetricsLogger | None = None
        self.reporter: Reporter | None = None  # rank 0's, with report_to
        self.publisher: Publisher | None = None  # versions published in the background

    async def run(self) -> dict[str, Any]:
        """Start, train steps start_step..max_steps-1, finish; returns the summary."""
        try:
            await self.start()
            try:
                for step in range(self.state.start_step, self.settings.max_steps):
                    await self.step(step)
            except BehaviourMismatchError:
                # Every rank stops at the same step: keep what it trained, its version out too.
                await self.publisher.wait()
                await self.checkpoints.final()
                raise
            finally:
                self.progress.close()
                if self.state.prefetch is not None:
                    self.state.prefetch.cancel()
            summary = await self.finish()
        except BaseException:
            await self._close(failed=True)
            raise
        await self._close(failed=False)
        return summary

    # -- start ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Agree with the sampler, load the model (resumed when there is a checkpoint), re-announce
        a resumed checkpoint, and start the "before" eval."""
        s = self.settings
        wall_start = time.monotonic()
        await self._agree()
        loaded, temperature, truncation = self._set_up_model()
        start_step, resumed_from = await self._open_run(loaded, temperature, truncation)
        world = self.world
        self.state = RunState(start_step=start_step, wall_start=wall_start, last_checkpoint=resumed_from,
                              checkpoint_step=start_step - 1 if resumed_from is not None else None)
        self.checkpoints = Checkpoints(s, world, sharding=self.sharding, model=self.model, optimizer=self.optimizer,
                                       lora=self.lora, drill=self.drill, state=self.state,
                                       public_settings=self.public_settings, in_thread=self._in_thread)
        self.publisher = self._publisher(loaded)
        self.publisher.warm()
        if resumed_from is not None:
            # The previous run may have died between saving and publishing: publish the
            # resumed version again, whole (every rank: the snapshot is a collective under fsdp).
            tensors = await self._in_thread(self.publisher.snapshot, self.sharding, self.model, self.publish_dtype,
                                            trainable_only=self.lora is not None)
            if world.is_main:
                self.publisher.start(Job(start_step, start_step - 1, tensors, None))
                await self.publisher.wait()
            self.state.published_any = True
        await self._in_thread(world.barrier)

        if world.is_main and s.eval_at_start:
            self.state.before_eval = self.evals.start(start_step, start_step, "before")
        self.progress = ProgressBar(s.max_steps, start_step, enabled=world.is_main and s.progress)
        self.guard = MismatchGuard(s.max_behaviour_mismatch, s.behaviour_mismatch_patience,
                                   on_warning=self.metrics.write, announce=world.is_main)

    async def _agree(self) -> None:
        """The sampler's token, configuration and the model path checked, and rank 0's reporter
        started, all before the model loads: a wrong one costs seconds, not a model load."""
        s = self.settings
        self.world = world = World(s)
        self.client = self._client or preflight.sampler_client(s)  # speaks while it waits, for retry_for
        # Before GET /status, which the token guards too.
        await preflight.check_token(self.client, s)
        self.config = accept_sampler_config(await self.client.status(), s, world.world_size)
        preflight.check_model(s.model)
        # What the metrics' start record, checkpoints and the tracking run's config show of the settings.
        self.public_settings = s.model_dump(mode="json", exclude={"api_token"})
        if world.is_main and s.report_to:
            # A backend that cannot start (not logged in to W&B) costs seconds.
            self.reporter = await asyncio.to_thread(
                Reporter.start, s, "trainer",
                {**self.public_settings, "sampler": self.config.model_dump(mode="json"),
                 "world_size": world.world_size},
                resume=s.resume)  # a resumed run continues its W&B run, as it does trainer_metrics.jsonl

    def _set_up_model(self) -> tuple[Any, float, Any]:
        """The model, optimizer and learner (resumed from a checkpoint when there is one); with
        the temperature and truncation the loss uses."""
        import torch

        from services.trainer.learner import Learner, LossConfig
        from services.trainer.sharding import make_sharding

        s, world = self.settings, self.world
        temperature = resolve_temperature(s, self.config)
        truncation = self.config.truncation()
        loss_cfg = LossConfig.from_settings(s, temperature=temperature, truncation=truncation,
                                            max_tokens=self.config.max_tokens)

        torch.manual_seed(s.seed)
        self.sharding = make_sharding(s.sharding, distributed=world.distributed, rank=world.rank,
                                      world_size=world.world_size, device=world.device)
        loaded = set_up_model(s, world.device, self.sharding)
        self.model, self.optimizer = loaded.model, loaded.optimizer
        self.lora = loaded.lora  # a LoRA run's adapter (services/trainer/lora.py): published alone
        self.publish_dtype = loaded.publish_dtype
        self.publish_root = Path(s.publish_dir) if s.publish_dir else Path(s.run_dir) / "published"
        self.learner = Learner(loaded.model, loaded.optimizer, loss_cfg, device=world.device,
                               ref_model=loaded.ref_model, reference=loaded.reference,
                               max_grad_norm=s.max_grad_norm, sharding=self.sharding,
                               # LoRA dropout, like checkpointing, only acts in train mode.
                               train_mode=s.gradient_checkpointing or s.lora_dropout > 0)
        return loaded, temperature, truncation

    async def _open_run(self, loaded: Any, temperature: float, truncation: Any) -> tuple[int, Path | None]:
        """Where this run starts (step, checkpoint): refused when the sampler no longer holds the
        batches it needs; which steps it trains a second time; the metrics and evals opened,
        with the run's start record."""
        s, world = self.settings, self.world
        start_step, resumed_from = loaded.start_step, loaded.resumed_from
        # Which steps this run trains a second time: those a dead predecessor trained after its
        # checkpoint (the sampler's version says how far it got; its metrics lines too).
        served = await self.client.weights_version()
        self.served_path = served.checkpoint_path
        preflight.refuse_trimmed(served, start_step, resumed_from, s.sampler_url)
        retrained = set(range(start_step, served.version))
        if world.is_main:
            history = metrics_history.prepare(
                Path(s.run_dir) / METRICS_FILE, resumed=s.resume, checkpoint_step=start_step - 1,
                checkpoint_record=ckpt.read_state(resumed_from).get("record") if resumed_from else None)
            retrained |= history.superseded
        self.retrained = retrained
        self.metrics = MetricsLogger(s.run_dir, enabled=world.is_main, reporter=self.reporter)
        self.evals = Evals(self.client, self.metrics, examples=s.eval_examples, timeout=s.eval_timeout)
        self.published_version = start_step
        if world.is_main:
            self.metrics.write({"event": "start", "start_step": start_step, "max_steps": s.max_steps,
                                "world_size": world.world_size, "device": str(world.device),
                                "sharding": self.sharding.kind, "dtype": str(loaded.dtype),
                                "publish_dtype": str(loaded.publish_dtype), "publish_dir": str(self.publish_root),
                                "lora": self.lora.spec.record() if self.lora else None,
                                "temperature": temperature, "truncation": truncation.describe(),
                                "resumed_from": str(resumed_from) if resumed_from else None,
                                # The sampler's version as this run found it: steps below it are retrained.
                                "sampler_version": served.version,
                                "sampler_config": self.config.model_dump(), "settings": self.public_settings})
            log.info("trainer: steps %d..%d, %d rank(s) on %s, loss %s, temperature %g, truncation %s%s",
                     start_step, s.max_steps - 1, world.world_size, world.device, s.loss, temperature,
                     truncation.describe(),
                     f", resumed from {resumed_from}" if resumed_from else "")
        return start_step, resumed_from

    # -- one step -------------------------------------------------------------------------

    async def step(self, step: int) -> None:
        """Optimizer step `step` on batch `step`; publishes version step + 1 (every rank runs it)."""
        s, world = self.settings, self.world
        batch, wait_s = await self._next_batch(step)
        await self.drill.point("fetched", step)

        lr = learning_rate(s, step)
        t_train = time.monotonic()
        result = await self._in_thread(self.learner.train_on_samples, batch.samples,
                                       grad_accum_steps=s.grad_accum_steps,
                                       num_iterations=s.num_iterations, lr=lr, step=step)
        sums = await self._in_thread(all_reduce_rank_sums, rank_sums(batch, step), self.learner)
        train_s = time.monotonic() - t_train
        record = step_record(step, lr, result, sums, batch, wait_s, train_s)
        if step in self.retrained:
            record["retrained"] = True
        await self.drill.point("trained", step)

        self.state.add_step(step, wait_s, train_s, sums, record["reward_mean"], result)
        await self._publish_step(step, batch, record, lr)
        await self._in_thread(world.barrier)
        # After the checkpoint: a stop loses no work. Every rank sees the same all-rank value,
        # so all of them stop at the same step.
        self.guard.observe(step, result.get("behaviour_mismatch"))

    def _published(self, job: Job) -> None:
        """Rank 0, when version job.version is out: the step's metrics line, then its evals."""
        s, record = self.settings, job.record
        if record is None:
            return
        self.metrics.write(record)
        self.progress.update(job.step + 1, describe(record))
        log.info(describe(record))
        version = job.version
        if s.eval_every and version % s.eval_every == 0 and version < s.max_steps:
            self.evals.start(version, version, "periodic")

    async def _next_batch(self, step: int) -> tuple[Batch, float]:
        """Batch `step` for this rank (the prefetched one when it came) and the seconds waited
        for it; starts fetching batch `step + 1` when the contract allows it."""
        s, world, state = self.settings, self.world, self.state
        t_need = time.monotonic()
        batch = None
        if state.prefetch is not None:
            try:
                batch = await state.prefetch
            except BatchNotReady:
                batch = None
            state.prefetch = None
        if batch is None:
            batch = await self._fetch(step)
        wait_s = time.monotonic() - t_need
        if batch.step != step:
            raise RuntimeError(f"asked the sampler for batch {step}, got batch {batch.step}")
        expected = s.per_device_batch_size * s.grad_accum_steps
        if len(batch.samples) != expected:
            raise RuntimeError(
                f"batch {step} gave rank {world.rank} {len(batch.samples)} samples, expected "
                f"per_device_batch_size ({s.per_device_batch_size}) x grad_accum_steps "
                f"({s.grad_accum_steps}) = {expected}"
            )
        if contract.can_prefetch(self.config.max_staleness) and step + 1 < s.max_steps:
            # Batch N+1 may use version N: fetch it while training, once version N is out.
            state.prefetch = asyncio.create_task(self._prefetch(step + 1))
        return batch, wait_s

    async def _prefetch(self, step: int) -> Batch:
        """Batch `step`, asked for as soon as the sampler can have it: the version it needs may
        still be publishing in the background, and asked before that the sampler answers 409
        (BatchNotReady), which costs a retry after a back-off sleep."""
        s, world = self.settings, self.world
        await self.publisher.posted(step - self.config.max_staleness)
        return await self.client.get_batch(step, world.rank, world.world_size, timeout=s.batch_timeout)

    async def _publish_step(self, step: int, batch: Batch, record: dict[str, Any], lr: float) -> None:
        """Version step + 1 (every rank calls it: the snapshot, a LoRA run's probe and the
        checkpoint are collectives under fsdp): the publication in flight waited for, the
        snapshot taken, a checkpoint written when due, then the publication started in the
        background (services/trainer/publication.py), which writes the step's metrics line
        when it is done. Fills in publish_wait_s, snapshot_s and (in the background) write_s,
        probe_s, publish_s, published_bytes, publish_kind and delta_fraction."""
        s, state, world = self.settings, self.state, self.world
        # Decided alike on every rank (the snapshot is a collective): the skip flags are
        # all-rank values, and every rank knows whether this run has published yet.
        unchanged = bool(record.get("skipped_no_signal") or record.get("skipped_non_finite"))
        reuse = unchanged and state.published_any
        checkpoint_due = (step + 1) % s.checkpoint_every == 0 or step + 1 == s.max_steps

        record["publish_wait_s"] = await self.publisher.wait()
        t0 = time.monotonic()
        tensors = None
        if not reuse:
            tensors = await self._in_thread(self.publisher.snapshot, self.sharding, self.model, self.publish_dtype,
                                            trainable_only=self.lora is not None)
        record["snapshot_s"] = time.monotonic() - t0
        record["snapshot_at"] = time.time()  # the end of the step's critical path (the dashboard's timeline)
        await self.drill.point("snapshot", step)
        # max_staleness 0: batch step + 1 needs this very version, so there is nothing to overlap
        # with; waiting for it keeps the ranks from asking for it too early. publish_in_background
        # False: the publication inline, as before (bench overlap's "before").
        inline = not contract.can_prefetch(self.config.max_staleness) or not s.publish_in_background
        job = Job(step + 1, step, tensors, record, inline=inline)
        if not reuse:
            if self.lora is not None:
                job.probe = await self._probe(batch, record)  # needs the live base: on this thread
            elif world.is_main:
                job.probe_ids = self._probe_ids(batch)
        if checkpoint_due:
            # Before the publication starts, so a checkpoint step's version is announced after
            # its checkpoint is committed (the kill drill's order of points).
            await self.checkpoints.write(step, lr, record)
        if world.is_main:
            if step == state.start_step:
                job.before_post = state.before_eval
            self.publisher.start(job)
        state.published_any = True
        if inline:
            await self.publisher.wait()  # its seconds are in the record's publish_wait_s already

    def _publisher(self, loaded: Any) -> Publisher:
        s = self.settings
        probe = None
        if self.lora is None and s.probe_tokens and self.world.is_main:
            probe = BackgroundProbe(self.model.config, self.world.device, loaded.dtype, self.publish_dtype)
        if self.lora is None:
            writer = weights_writer(self.publish_root, self.model.config, self.publish_dtype)
        else:  # an adapter is published whole, in PEFT's format
            lora = self.lora
            writer = Writer(full=lambda version, step, tensors: lora.publish(
                self.publish_root, version, tensors, dtype=self.publish_dtype, step=step))

        def prune(path: Path) -> None:
            # Never the version the sampler serves (a retrained step's version is not served).
            ckpt.prune_published(self.publish_root, s.keep_published, protect=(self.served_path, path))

        return Publisher(writer, post=self._publish, done=self._published, prune=prune, chain=Chain(s.full_every),
                         probe=probe, drill=self.drill, metrics=published_metrics)

    def _probe_ids(self, batch: Batch) -> list[int] | None:
        from services.trainer.probe import probe_token_ids

        return probe_token_ids(batch.samples[0], self.settings.probe_tokens)

    async def _probe(self, batch: Batch, record: dict[str, Any]) -> dict[str, Any] | None:
        """The probe of the live weights (a LoRA run's, on the training thread): rank 0's (None
        elsewhere). Under fsdp the forward is a collective, so every rank runs it on rank 0's ids."""
        from services.trainer.probe import probe_live_weights

        t0 = time.monotonic()
        probe = await probe_live_weights(self._probe_ids(batch) if self.world.is_main else None, self.model,
                                         self.publish_dtype, self.sharding, is_main=self.world.is_main,
                                         in_thread=self._in_thread)
        record["probe_s"] = time.monotonic() - t0
        return probe

    # -- finish ---------------------------------------------------------------------------

    async def finish(self) -> dict[str, Any]:
        """Wait for the evals (the "after" one started here), then the summary: returned, and
        on rank 0 written as the metrics' "end" line and run_dir/trainer_summary.json."""
        s, world, state = self.settings, self.world, self.state
        final_version = max(s.max_steps, state.start_step)
        await self.publisher.wait()  # the last version is out before the "after" eval asks for it
        if state.before_eval is not None:
            await state.before_eval
        after = None
        if world.is_main and s.eval_at_end:
            after = await self.evals.run(final_version, final_version, "after")
        await self.evals.wait()
        summary = state.summary(s.max_steps, world.world_size, self.evals.records, after, str(self.metrics.path),
                                self.publisher.chain.last.path if self.publisher.chain.last else None)
        if world.is_main:
            self.metrics.write({"event": "end", **{k: v for k, v in summary.items() if k != "evals"}})
            Path(s.run_dir).mkdir(parents=True, exist_ok=True)
            (Path(s.run_dir) / "trainer_summary.json").write_text(json.dumps(summary, indent=2, default=str))
        world.barrier()
        return summary

    async def _close(self, failed: bool) -> None:
        """Whatever start() set up, released; safe after a failure part-way through it."""
        if self.evals is not None:
            self.evals.cancel()
        if self.publisher is not None:
            await self.publisher.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.reporter is not None:
            # W&B: finish the run, marked failed when the trainer stops on an error.
            await asyncio.to_thread(self.reporter.close, exit_code=1 if failed else 0)
        if self._client is None and self.client is not None:
            await self.client.aclose()
        self._executor.shutdown(wait=False)
        if self.world is not None:
            self.world.close()

    # -- helpers --------------------------------------------------------------------------

    async def _in_thread(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # One dedicated thread: torch work and collectives always run on the same thread,
        # while the event loop keeps serving prefetches and eval polls.
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    async def _fetch(self, step: int) -> Batch:
        return await self.client.get_batch_for_training(step, self.world.rank, self.world.world_size,
                                                        timeout=self.settings.batch_timeout,
                                                        published_version=self.published_version)

    async def _publish(self, version: int, path: Path | None, *, probe: dict[str, Any] | None = None,
                       metrics: dict[str, float] | None = None) -> None:
        # The step a restart would train first: the sampler keeps every batch from there on.
        checkpoint_step = self.state.checkpoint_step
        resume_step = checkpoint_step + 1 if checkpoint_step is not None else 0
        try:
            served = await self.client.publish_weights(version, str(path) if path else None,
                                                       probe=probe if path else None, metrics=metrics,
                                                       resume_step=resume_step,
                                                       adapter=self.lora is not None and path is not None)
            self.served_path = served.checkpoint_path
        except VersionConflict as exc:
            # Already at (or past) this version: a resumed run re-announcing its checkpoint.
            log.info("sampler already has version >= %d (%s)", version, exc.detail)
        self.published_version = version


async def train(settings: TrainerSettings, client: SamplerClient | None = None) -> dict[str, Any]:
    """Train until `settings.max_steps`; returns the summary (see the module docstring)."""
    return await Trainer(settings, client).run()


def run(settings: TrainerSettings) -> dict[str, Any]:
    """Synchronous wrapper of `train` for scripts and the CLI."""
    return asyncio.run(train(settings))
