"""The trainer loop: batch N from the sampler -> one optimizer step -> checkpoint -> version N+1.

`await train(settings)` (or `run(settings)` from synchronous code) runs until
`settings.max_steps` optimizer steps exist and returns a summary dict:

    {"steps", "start_step", "final_step", "final_version", "wall_seconds",
     "wait_seconds", "train_seconds", "trainer_wait_fraction", "staleness_mean",
     "reward_mean_first", "reward_mean_last", "eval_reward_before", "eval_reward_after",
     "evals", "last_checkpoint", "metrics_path", "world_size"}

and writes the same to `run_dir/trainer_summary.json` (rank 0).

`Trainer.run` reads top to bottom: `start()`, then `step(N)` for each step, then `finish()`.

Start-up (`Trainer.start`): GET /status supplies the sampler's batch shape, temperature,
max_tokens and max_staleness; a batch-shape or reuse disagreement (shared/contract.py) stops
the trainer with a message naming the numbers. Then the process's place in the job
(services/trainer/world.py) and the model, optimizer and reference model
(services/trainer/model_setup.py); with a checkpoint in run_dir/checkpoints (and `resume`)
the run continues at step = its version and rank 0 announces that checkpoint again, in
case the previous run died between saving and publishing.

Per step N (`Trainer.step`), on every rank:
  1. `GET /batch?step=N&rank=R&world_size=W` (prefetched during step N-1 when the
     sampler's max_staleness >= 1, since batch N may then be generated from version N-1);
  2. `Learner.train_on_samples` (in a worker thread, so evals and the prefetch progress
     on the event loop meanwhile), then this rank's sums over its share (`rank_sums`),
     all-reduced over the ranks;
  3. rank 0 computes the probe (the first sample's logprobs under the new weights,
     services/trainer/probe.py), writes `run_dir/checkpoints/step-N` atomically, POSTs
     `/weights_version` with version N+1, that path, the probe and the step's metrics,
     prunes old checkpoints, appends a metrics line; the other ranks wait at a barrier,
     so nobody asks for batch N+1 before version N+1 is published;
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
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.trainer import checkpoint as ckpt
from services.trainer.config import TrainerSettings
from services.trainer.metrics import MetricsLogger, ProgressBar, describe, eval_reward
from services.trainer.mismatch import MismatchGuard
from services.trainer.model_setup import set_up_model
from services.trainer.world import World
from shared import codec, contract
from shared.client import BatchNotReady, BatchTrimmed, SamplerClient, VersionConflict
from shared.contract import SamplerConfig
from shared.settings import SettingsError
from shared.wire import MAX_METRICS, Batch

log = logging.getLogger("tandem.trainer")


# -- agreeing with the sampler -------------------------------------------------------------


def accept_sampler_config(status: Any, settings: TrainerSettings, world_size: int) -> SamplerConfig:
    """The sampler's config block from `GET /status`, once it agrees with these settings on the
    contract (shared/contract.py): batch shape, batch reuse, sampling it can score. Refuses with SettingsError
    (exit status 2) naming the numbers."""
    try:
        config = SamplerConfig.from_status(status)
        contract.check_batch_shape(settings.per_device_batch_size, settings.grad_accum_steps, world_size,
                                   config.prompts_per_step, config.num_generations)
        contract.check_reuse(settings.num_iterations, config.num_iterations)
        contract.check_untruncated_sampling(config.top_p, config.top_k, config.min_p)
    except contract.ContractError as exc:
        raise SettingsError(str(exc)) from None
    return config


def resolve_temperature(settings: TrainerSettings, config: SamplerConfig) -> float:
    """The trainer must score with the temperature the sampler sampled with."""
    sampler_t = config.temperature
    if settings.temperature is None:
        if sampler_t is None:
            log.warning("sampler /status does not report a temperature; assuming 1.0")
            return 1.0
        if float(sampler_t) <= 0:
            raise SettingsError(
                f"the sampler samples with temperature {sampler_t}: greedy decoding has no "
                "sampling distribution to train on; set the sampler's temperature > 0"
            )
        return float(sampler_t)
    if sampler_t is not None and abs(float(sampler_t) - settings.temperature) > 1e-6:
        raise SettingsError(
            f"temperature mismatch: the trainer's --temperature {settings.temperature} differs from the "
            f"sampler's temperature {sampler_t}; the behaviour logprobs are after the sampler's "
            "temperature, so leave --temperature unset or make them equal"
        )
    return settings.temperature


def learning_rate(settings: TrainerSettings, step: int) -> float:
    """Constant after a linear warm-up; a pure function of the step, so resume needs no state."""
    if settings.warmup_steps and step < settings.warmup_steps:
        return settings.learning_rate * (step + 1) / settings.warmup_steps
    return settings.learning_rate


# -- one step's numbers --------------------------------------------------------------------


def batch_digest(batch: Batch) -> str:
    """A short fingerprint of this rank's share: equal digests = the same training data."""
    h = hashlib.sha256()
    for smp in batch.samples:
        h.update(json.dumps([smp.prompt_id, codec.plain(smp.prompt_token_ids),
                             codec.plain(smp.completion_token_ids), smp.advantage]).encode())
    return h.hexdigest()[:16]


def rank_sums(batch: Batch, step: int) -> dict[str, float]:
    """Sums over this rank's share of batch `step` (and the largest staleness in it), to be
    added up over the ranks by `all_reduce_rank_sums`."""
    rewards = [s.reward for s in batch.samples]
    stale = [contract.staleness(step, s.policy_version) for s in batch.samples]
    return {
        "n": float(len(rewards)),
        "reward_sum": float(sum(rewards)),
        "reward_sq": float(sum(r * r for r in rewards)),
        "stale_sum": float(sum(stale)),
        "stale_max": float(max(stale, default=0)),
        "completion_tokens": float(sum(len(s.completion_token_ids) for s in batch.samples)),
        "truncated": float(sum(s.finish_reason == "length" for s in batch.samples)),
    }


def all_reduce_rank_sums(sums: dict[str, float], learner: Any) -> dict[str, float]:
    """`rank_sums` of every rank added up ("stale_max": the largest); a collective, so every
    rank calls it, on the training thread."""
    import torch
    import torch.distributed as dist

    if not learner.distributed:
        return sums
    keys = [k for k in sums if k != "stale_max"]
    dev = learner._collective_device
    summed = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=dev)
    dist.all_reduce(summed)
    peak = torch.tensor([sums["stale_max"]], dtype=torch.float64, device=dev)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {**dict(zip(keys, summed.tolist())), "stale_max": float(peak.item())}


def step_record(step: int, lr: float, result: dict[str, Any], sums: dict[str, float], batch: Batch,
                wait_s: float, train_s: float) -> dict[str, Any]:
    """The metrics line of step `step`: the learner's result, the all-rank sums as means, and
    timings. The order of the keys is the order of the line (and of what is published)."""
    n = max(sums["n"], 1.0)
    reward_mean = sums["reward_sum"] / n
    reward_std = max(sums["reward_sq"] / n - reward_mean ** 2, 0.0) ** 0.5
    return {
        "event": "step", "step": step, "version": step + 1, "lr": lr,
        **result,
        "reward_mean": reward_mean, "reward_std": reward_std,
        "staleness_mean": sums["stale_sum"] / n, "staleness_max": int(sums["stale_max"]),
        "batch_staleness_mean": batch.stats.staleness_mean,
        "batch_staleness_max": batch.stats.staleness_max,
        "samples": int(sums["n"]),
        "batch_digest": batch_digest(batch),  # rank 0's share
        "completion_tokens_mean": sums["completion_tokens"] / n,
        "truncated_fraction": sums["truncated"] / n,
        "batch_wait_s": wait_s, "train_s": train_s,
        # Rank 0's; publish_s stays null in what is published (not known yet).
        "checkpoint_s": 0.0, "probe_s": 0.0, "publish_s": None,
        "tokens_per_s": result["forward_tokens"] / train_s if train_s > 0 else None,
        "generation_s": batch.stats.generation_seconds,
    }


def published_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The step record's numbers for `POST /weights_version`'s `metrics` (the sampler shows them):
    finite ints and floats only (no strings, bools or nulls), at most `MAX_METRICS` (the wire's
    limit); the version travels apart."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "version" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[key] = value
        if len(out) == MAX_METRICS:
            break
    return out


# -- the loop ------------------------------------------------------------------------------


@dataclass
class RunState:
    """What the steps of one run share: where it started, the totals for the summary, and
    the tasks in flight from one step to the next."""

    start_step: int
    wall_start: float
    last_checkpoint: Path | None = None
    wait_seconds: float = 0.0
    train_seconds: float = 0.0
    stale_sum: float = 0.0
    samples: float = 0.0
    first_reward: float | None = None
    last_reward: float | None = None
    prefetch: asyncio.Task | None = None  # batch N+1, fetched while step N trains
    before_eval: asyncio.Task | None = None  # awaited before version start_step + 1 is published

    def add_step(self, wait_s: float, train_s: float, sums: dict[str, float], reward_mean: float) -> None:
        self.wait_seconds += wait_s
        self.train_seconds += train_s
        self.stale_sum += sums["stale_sum"]
        self.samples += sums["n"]
        self.first_reward = reward_mean if self.first_reward is None else self.first_reward
        self.last_reward = reward_mean


class Trainer:
    def __init__(self, settings: TrainerSettings, client: SamplerClient | None = None):
        self.settings = settings
        self._client = client  # the caller's, closed by the caller; None: run() makes and closes one
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-train")
        self.evals: list[dict[str, Any]] = []
        self._eval_tasks: list[asyncio.Task] = []
        # Set by start():
        self.world: World | None = None
        self.client: SamplerClient | None = None
        self.metrics: MetricsLogger | None = None

    async def run(self) -> dict[str, Any]:
        """Start, train steps start_step..max_steps-1, finish; returns the summary."""
        try:
            await self.start()
            try:
                for step in range(self.state.start_step, self.settings.max_steps):
                    await self.step(step)
            finally:
                self.progress.close()
                if self.state.prefetch is not None:
                    self.state.prefetch.cancel()
            return await self.finish()
        finally:
            await self._close()

    # -- start ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Agree with the sampler, load the model (resumed when there is a checkpoint), re-announce
        a resumed checkpoint, and start the "before" eval."""
        import torch

        from services.trainer.learner import Learner, LossConfig

        s = self.settings
        wall_start = time.monotonic()
        self.world = world = World(s)
        self.client = self._client or SamplerClient(s.sampler_url, api_token=s.api_token, poll_timeout=s.poll_timeout)

        self.config = accept_sampler_config(await self.client.status(), s, world.world_size)
        temperature = resolve_temperature(s, self.config)
        max_len = s.max_completion_length or self.config.max_tokens
        loss_cfg = LossConfig(loss_type=s.loss, epsilon_low=s.epsilon_low, epsilon_high=s.epsilon_high,
                              tis_cap=s.tis_cap, beta=s.beta, temperature=temperature,
                              max_completion_length=max_len)

        torch.manual_seed(s.seed)
        loaded = set_up_model(s, world.device)
        self.model, self.optimizer = loaded.model, loaded.optimizer
        self.learner = Learner(loaded.model, loaded.optimizer, loss_cfg, device=world.device,
                               ref_model=loaded.ref_model, max_grad_norm=s.max_grad_norm,
                               distributed=world.distributed, train_mode=s.gradient_checkpointing)

        start_step, resumed_from = loaded.start_step, loaded.resumed_from
        self.metrics = MetricsLogger(s.run_dir, enabled=world.is_main, tensorboard=s.tensorboard)
        self.published_version = start_step
        self.public_settings = s.model_dump(mode="json", exclude={"api_token"})
        if world.is_main:
            self.metrics.write({"event": "start", "start_step": start_step, "max_steps": s.max_steps,
                                "world_size": world.world_size, "device": str(world.device),
                                "dtype": str(loaded.dtype), "temperature": temperature,
                                "resumed_from": str(resumed_from) if resumed_from else None,
                                "sampler_config": self.config.model_dump(), "settings": self.public_settings})
            log.info("trainer: steps %d..%d, %d rank(s) on %s, loss %s, temperature %g%s",
                     start_step, s.max_steps - 1, world.world_size, world.device, s.loss, temperature,
                     f", resumed from {resumed_from}" if resumed_from else "")
            if resumed_from is not None:
                # The previous run may have died between saving and publishing.
                await self._publish(start_step, resumed_from)
        world.barrier()

        self.state = RunState(start_step=start_step, wall_start=wall_start, last_checkpoint=resumed_from)
        if world.is_main and s.eval_at_start:
            self.state.before_eval = asyncio.create_task(self._eval(start_step, start_step, "before"))
        self.progress = ProgressBar(s.max_steps, start_step, enabled=world.is_main and s.progress)
        self.guard = MismatchGuard(s.max_behaviour_mismatch, s.behaviour_mismatch_patience,
                                   on_warning=self.metrics.write, announce=world.is_main)

    # -- one step -------------------------------------------------------------------------

    async def step(self, step: int) -> None:
        """Optimizer step `step` on batch `step`; publishes version step + 1 (every rank runs it)."""
        s, world = self.settings, self.world
        batch, wait_s = await self._next_batch(step)

        lr = learning_rate(s, step)
        t_train = time.monotonic()
        result = await self._in_thread(self.learner.train_on_samples, batch.samples,
                                       grad_accum_steps=s.grad_accum_steps,
                                       num_iterations=s.num_iterations, lr=lr)
        sums = await self._in_thread(all_reduce_rank_sums, rank_sums(batch, step), self.learner)
        train_s = time.monotonic() - t_train
        record = step_record(step, lr, result, sums, batch, wait_s, train_s)

        if world.is_main:
            await self._checkpoint_and_publish(step, batch, record, lr)
        await self._in_thread(world.barrier)

        self.state.add_step(wait_s, train_s, sums, record["reward_mean"])
        if world.is_main:
            self.metrics.write(record)
            self.progress.update(step + 1, describe(record))
            log.info(describe(record))
            version = step + 1
            if s.eval_every and version % s.eval_every == 0 and step + 1 < s.max_steps:
                self._eval_tasks.append(asyncio.create_task(self._eval(step + 1, version, "periodic")))
        # After the checkpoint and the metrics line: a stop loses no work. Every rank
        # sees the same all-rank value, so all of them stop at the same step.
        self.guard.observe(step, result.get("behaviour_mismatch"))

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
            # Batch N+1 may use version N (already published): fetch it while training.
            state.prefetch = asyncio.create_task(
                self.client.get_batch(step + 1, world.rank, world.world_size, timeout=s.batch_timeout)
            )
        return batch, wait_s

    async def _checkpoint_and_publish(self, step: int, batch: Batch, record: dict[str, Any], lr: float) -> None:
        """Rank 0's part of step `step`: probe, checkpoint, publish version step + 1, prune.
        Fills in the record's probe_s, checkpoint_s and publish_s."""
        from services.trainer.probe import compute_probe, probe_token_ids

        s, state = self.settings, self.state
        probe = None
        probe_ids = probe_token_ids(batch.samples[0], s.probe_tokens)
        if probe_ids is not None:
            # Under the weights after this step's update, i.e. the ones saved below.
            t0 = time.monotonic()
            probe = await self._in_thread(compute_probe, self.model, probe_ids)
            record["probe_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        state.last_checkpoint = await self._in_thread(
            ckpt.save_checkpoint, s.run_dir, step, self.model, model_dir=s.model,
            optimizer=self.optimizer if s.save_optimizer else None,
            state={"lr": lr, "world_size": self.world.world_size, "settings": self.public_settings},
        )
        record["checkpoint_s"] = time.monotonic() - t0
        if step == state.start_step and state.before_eval is not None:
            # The "before" eval must see version 0: publish only once it is done.
            await state.before_eval
        t0 = time.monotonic()
        await self._publish(step + 1, state.last_checkpoint, probe=probe, metrics=published_metrics(record))
        record["publish_s"] = time.monotonic() - t0
        # Prune only after publishing, so the previous published version stays on disk.
        ckpt.prune_checkpoints(s.run_dir, s.keep_checkpoints)

    # -- finish ---------------------------------------------------------------------------

    async def finish(self) -> dict[str, Any]:
        """Wait for the evals (the "after" one started here), then the summary: returned, and
        on rank 0 written as the metrics' "end" line and run_dir/trainer_summary.json."""
        s, world, state = self.settings, self.world, self.state
        final_version = max(s.max_steps, state.start_step)
        if state.before_eval is not None:
            await state.before_eval
        after = None
        if world.is_main and s.eval_at_end:
            after = await self._eval(final_version, final_version, "after")
        if self._eval_tasks:
            await asyncio.gather(*self._eval_tasks)
        before = next((e for e in self.evals if e["label"] == "before"), None)
        wall = time.monotonic() - state.wall_start
        busy = state.wait_seconds + state.train_seconds
        summary = {
            "steps": max(s.max_steps - state.start_step, 0),
            "start_step": state.start_step,
            "final_step": final_version - 1,
            "final_version": final_version,
            "wall_seconds": wall,
            "wait_seconds": state.wait_seconds,
            "train_seconds": state.train_seconds,
            "trainer_wait_fraction": state.wait_seconds / busy if busy > 0 else 0.0,
            "staleness_mean": state.stale_sum / state.samples if state.samples else 0.0,
            "reward_mean_first": state.first_reward,
            "reward_mean_last": state.last_reward,
            "eval_reward_before": before.get("reward") if before else None,
            "eval_reward_after": after.get("reward") if after else None,
            "evals": self.evals,
            "last_checkpoint": str(state.last_checkpoint) if state.last_checkpoint else None,
            "metrics_path": str(self.metrics.path),
            "world_size": world.world_size,
        }
        if world.is_main:
            self.metrics.write({"event": "end", **{k: v for k, v in summary.items() if k != "evals"}})
            Path(s.run_dir).mkdir(parents=True, exist_ok=True)
            (Path(s.run_dir) / "trainer_summary.json").write_text(json.dumps(summary, indent=2, default=str))
        world.barrier()
        return summary

    async def _close(self) -> None:
        """Whatever start() set up, released; safe after a failure part-way through it."""
        for task in self._eval_tasks:
            task.cancel()
        if self.metrics is not None:
            self.metrics.close()
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

    async def _fetch(self, step: int, *, not_ready_grace: float = 60.0) -> Batch:
        """Batch `step` for this rank; a 409 is retried briefly (a publish may be in flight)."""
        give_up = time.monotonic() + not_ready_grace
        delay = 0.05
        while True:
            try:
                return await self.client.get_batch(step, self.world.rank, self.world.world_size,
                                                   timeout=self.settings.batch_timeout)
            except BatchNotReady as exc:
                if time.monotonic() > give_up:
                    raise RuntimeError(
                        f"batch {step} cannot become ready: {exc.detail}. The trainer has published "
                        f"version {self.published_version}; the sampler needs a newer one "
                        "(is another trainer or an old run_dir involved?)"
                    ) from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
            except BatchTrimmed as exc:
                raise RuntimeError(
                    f"batch {step} was trimmed by the sampler ({exc.detail}): the trainer fell behind its "
                    "retention window (raise the sampler's keep_batches, or start a fresh run_dir)"
                ) from exc

    async def _publish(self, version: int, path: Path | None, *, probe: dict[str, Any] | None = None,
                       metrics: dict[str, float] | None = None) -> None:
        try:
            await self.client.publish_weights(version, str(path) if path else None,
                                              probe=probe if path else None, metrics=metrics)
        except VersionConflict as exc:
            # Already at (or past) this version: a resumed run re-announcing its checkpoint.
            log.info("sampler already has version >= %d (%s)", version, exc.detail)
        self.published_version = version

    async def _eval(self, step: int, version: int, label: str) -> dict[str, Any]:
        started = time.monotonic()
        record: dict[str, Any] = {"event": "eval", "label": label, "step": step, "version": version}
        try:
            eval_id = await self.client.start_eval(num_examples=self.settings.eval_examples)
            result = await self.client.wait_eval(eval_id, timeout=self.settings.eval_timeout)
            record.update(eval_id=eval_id, status=result.status, result=result.result,
                          error=result.error, reward=eval_reward(result.result))
        except Exception as exc:  # noqa: BLE001 -- an eval must never take training down
            log.warning("eval %s at version %d failed: %s", label, version, exc)
            record.update(status="failed", error=f"{type(exc).__name__}: {exc}", reward=None)
        record["seconds"] = time.monotonic() - started
        self.evals.append(record)
        self.metrics.write(record)
        log.info("eval %s (version %d): reward %s in %.1fs", label, version, record.get("reward"), record["seconds"])
        return record


async def train(settings: TrainerSettings, client: SamplerClient | None = None) -> dict[str, Any]:
    """Train until `settings.max_steps`; returns the summary (see the module docstring)."""
    return await Trainer(settings, client).run()


def run(settings: TrainerSettings) -> dict[str, Any]:
    """Synchronous wrapper of `train` for scripts and the CLI."""
    return asyncio.run(train(settings))
