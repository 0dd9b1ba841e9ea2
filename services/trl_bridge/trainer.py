"""`TandemGRPOTrainer`: TRL's `GRPOTrainer` fed by the Tandem sampler.

The seam is `_generate_and_score_completions`, the one method TRL calls once per generation
batch. With `steps_per_generation == gradient_accumulation_steps` (refused otherwise) that is
once per optimizer step, so it maps one to one onto `GET /batch?step=N`: instead of
generating and scoring, it fetches this rank's share of batch N (groups whole), and hands TRL
what its loss reads: prompt and completion ids and masks, the sampler's advantages, the
behaviour logprobs and the importance-sampling ratio they give. TRL then splits the share into
its micro-batches, accumulates gradients, steps the optimizer, logs and checkpoints as always.

Mapping onto TRL's knobs:

* **Steps and versions.** Batch N feeds optimizer step N; after it, the callback below
  publishes version N + 1: the weights copied aside and the probe computed, then the write and
  `POST /weights_version` in the background while step N + 1 trains (services/trl_bridge/
  publication.py; at most one in flight, the wait before the next recorded as
  `publish_wait_s`). With the sampler's max_staleness 0 batch N + 1 needs version N + 1, so the
  callback waits for it there. Batch N + 1 is prefetched while step N trains whenever the
  sampler's max_staleness allows it (`contract.can_prefetch`), as the native trainer does. Staleness is the sampler's: this side
  never drops or reorders samples.
* **num_iterations (mu).** TRL's mu reuses a generation batch for mu optimizer steps. Here
  those mu passes belong to one sampler step (`agreement.tandem_step`), like the native
  trainer's mu passes inside its step N, and one version is published after the last of them.
  Refused when the sampler reuses batches too (`contract.check_reuse`).
* **Importance sampling.** TRL's correction for rollouts from another engine (the one it
  applies to its own vLLM rollouts) is what a sampler batch needs: pi_old is the model's
  logprob at the start of the step (no-grad forward here), the ratio pi_old / pi_behaviour is
  formed per `vllm_importance_sampling_mode` and clipped per `vllm_importance_sampling_clip_*`,
  and `_compute_loss` multiplies it in. TRL applies it only when `self.use_vllm` is true, the
  flag it uses for "the rollouts came from an external engine"; TRL's own vLLM never starts
  (use_vllm=False is required in the config, and the generation paths that would use it are
  the ones replaced here), so the flag is turned on after TRL's set-up. With
  `vllm_importance_sampling_correction=False` the clipped ratio is taken against the behaviour
  logprobs directly (the native trainer's `tis_cap` 0).
* **Evaluation** is the sampler's `POST /eval` (one generation per held-out prompt, rewards
  only), logged with TRL's `log`: `trainer.evaluate()` or `eval_strategy="steps"`.
* **Tracking** is TRL's: `args.report_to` (wandb, tensorboard, ...) reports TRL's metrics through
  transformers' callbacks; `tracking.grpo_reporting` picks the names and places that put the
  run beside its sampler's (docs/tracking.md). A chosen backend that is not installed is
  refused before the model loads.
* **LoRA** (`peft_config=LoraConfig(...)`, as TRL takes it): TRL wraps the base model, only the
  adapter trains, and every version is the adapter alone in PEFT's format, posted with
  `adapter: true` (publication.py, shared/adapters.py); the probe is base + adapter, the
  reference model (beta > 0) the base, i.e. the adapter disabled. A config the servers could not
  serve (lm_head or embeddings as targets, modules_to_save, DoRA, biases) is refused here.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast_object_list
from datasets import Dataset
from transformers import Trainer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from services.trainer.loss import mismatch_estimates
from services.trainer.metrics import MetricsLogger, eval_reward
from services.trl_bridge.agreement import check_grpo_config, tandem_step, version_after
from services.trl_bridge.inputs import to_tensors
from services.trl_bridge.publication import Publisher
from services.trl_bridge.sampler_link import SamplerLink
from services.trl_bridge.tracking import check_report_to
from shared import contract
from shared.contract import SamplerConfig
from shared.wire import MAX_METRICS, Batch

log = logging.getLogger("tandem.trl")

PLACEHOLDER_PROMPT = "(the Tandem sampler chooses the prompts)"


def sampler_reward(prompts: Any = None, completions: Any = None, **kwargs: Any) -> list[float]:
    """GRPOTrainer insists on a reward function; with Tandem the sampler scores every completion
    and sends the advantages, so this one is never called (it would mean TRL generated itself)."""
    raise RuntimeError("TandemGRPOTrainer got rewards from the sampler; TRL must not score completions itself")


class TandemGRPOTrainer(GRPOTrainer):
    """`TandemGRPOTrainer(model, args=GRPOConfig(...), sampler_url=URL).train()`.

    `model`: a model directory or a loaded `PreTrainedModel` (the weights the inference servers
    start from). `args`: a GRPOConfig whose batch shape, num_generations and temperature agree with
    the sampler (see `agreement.grpo_config_values`), with `max_steps` set. The rest are Tandem's:
    where the sampler is, where published weights go (readable by the inference servers), how many
    stay, a full version every `full_every` (deltas between), the probe's length (0: none), and
    the evals' size and patience."""

    def __init__(self, model: Any, args: GRPOConfig, *, sampler_url: str, api_token: str | None = None,
                 processing_class: Any = None, callbacks: list[TrainerCallback] | None = None,
                 optimizers: tuple[Any, Any] = (None, None), peft_config: Any = None,
                 publish_dir: str | Path | None = None, keep_published: int = 2, probe_tokens: int = 64,
                 publish_dtype: torch.dtype | None = None, eval_examples: int | None = None,
                 eval_timeout: float = 1800.0, poll_timeout: float = 30.0, batch_timeout: float | None = None,
                 skip_steps_without_signal: bool = True, full_every: int = 10):
        if args is None:
            raise ValueError("args is required: a GRPOConfig with max_steps and the sampler's batch shape")
        if type(model).__name__.startswith("Peft"):
            raise ValueError(
                "pass the base model and peft_config=LoraConfig(...), not a PeftModel: version 0 of a LoRA run is "
                "the base model the inference servers start from, so the adapter must start untrained")
        if peft_config is not None:
            from services.trainer.lora import peft_config_problem

            problem = peft_config_problem(peft_config)
            if problem:
                raise ValueError(problem)
        check_report_to(args.report_to)  # a missing W&B / TensorBoard named now, not after the model loads
        link = SamplerLink(sampler_url, api_token=api_token, poll_timeout=poll_timeout, batch_timeout=batch_timeout)
        try:
            # Before any model is loaded: a disagreement costs a second, not a model load. The
            # token first: GET /status needs it too.
            link.check_token()
            self.sampler_config = SamplerConfig.from_status(link.status())
            check_grpo_config(args, self.sampler_config, args.world_size)
        except BaseException:
            link.close()
            raise
        self._link = link
        # The sampler picks the prompts; TRL's dataloader still runs (it paces the accumulation
        # loop), over exactly one generation batch of placeholder rows.
        rows = args.generation_batch_size // args.num_generations
        placeholder = Dataset.from_dict({"prompt": [PLACEHOLDER_PROMPT] * rows})
        try:
            super().__init__(model=model, reward_funcs=sampler_reward, args=args, train_dataset=placeholder,
                             eval_dataset=placeholder if args.eval_strategy != "no" else None,
                             processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
                             peft_config=peft_config)
        except BaseException:
            link.close()
            raise
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            link.close()
            raise NotImplementedError(
                "FSDP and DeepSpeed are not supported by TandemGRPOTrainer yet: publication gathers the weights "
                "and runs the probe's forward on the main process only; use DDP (plain `accelerate launch`)")
        # See the module docstring: TRL's switch for "rollouts from an external engine, correct for it".
        self.use_vllm = bool(args.vllm_importance_sampling_correction)
        self.tandem_steps = args.max_steps // self.num_iterations
        root = Path(publish_dir) if publish_dir is not None else Path(args.output_dir) / "published"
        if publish_dtype is None:
            # The compute dtype, as the native trainer's publish_dtype `auto`: under TRL's bf16/fp16 mixed
            # precision accelerate wraps the model's forward in autocast, so the probe computes in that
            # dtype, and the servers must load weights in it to agree (fp32 weights would be refused).
            publish_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        # A LoRA run publishes its adapter alone (TRL wrapped the model in a PeftModel).
        self.tandem_adapter = peft_config is not None
        self.publisher = Publisher(link, root, keep=keep_published, probe_tokens=probe_tokens, dtype=publish_dtype,
                                   adapter=self.tandem_adapter, full_every=full_every)
        self.eval_examples = eval_examples
        self.eval_timeout = eval_timeout
        # What happened, step by step, for summaries and tests: one entry per batch fetched and
        # per version published (main process).
        self.tandem_batches: list[dict[str, Any]] = []
        self.tandem_publications: list[dict[str, Any]] = []
        self.tandem_resume_step: int | None = None  # set by _PublishEachVersion: the batch a restart trains first
        self._probe_sample = None
        # A batch whose loss tokens all have advantage 0 (and no KL term) has nothing to teach, but
        # AdamW would still move the weights by its momentum: on the toy task that made one seed of
        # five learn (eval 0.95 at step 50) and then drift to 0.78 (bench/results/trl.md). The
        # native trainer leaves the weights alone on such steps; so does this one, unless told not to.
        self.skip_steps_without_signal = skip_steps_without_signal
        self.skipped_steps_no_signal = 0
        self._batch_has_signal = True
        # A NaN or infinite gradient norm (a non-finite loss gives one) must not reach AdamW: its
        # moments would hold NaN for the rest of the run. Such a step is skipped and said so.
        self.skipped_steps_non_finite = 0
        self._last_grad_norm = 0.0
        self._step_metrics: dict[str, float] = {}
        # The native trainer's JSONL (services/trainer/metrics.py), so the demo's progress display,
        # summaries and tools read both trainers' runs alike: output_dir/trainer_metrics.jsonl.
        self.metrics_log = MetricsLogger(args.output_dir, enabled=self.accelerator.is_main_process)
        self.add_callback(_SkipStepsWithoutSignal(self))
        self.add_callback(_PublishEachVersion(self))

    # -- batch N instead of generation -------------------------------------------------------

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        if not self.model.training:
            raise RuntimeError("TandemGRPOTrainer evaluates through the sampler's /eval: call evaluate(), "
                               "which does not generate here")
        acc = self.accelerator
        step = tandem_step(self.state.global_step, self.num_iterations)
        rank, world = acc.process_index, acc.num_processes
        t0 = time.monotonic()
        batch = self._link.batch(step, rank, world)
        wait_s = time.monotonic() - t0
        self._check_share(batch, step)
        if contract.can_prefetch(self.sampler_config.max_staleness) and step + 1 < self.tandem_steps:
            # Batch N+1 may come from version N, published before this step ends: fetch it meanwhile.
            self._link.prefetch(step + 1, rank, world)
        self._probe_sample = batch.samples[0]

        device = acc.device
        t = to_tensors(batch.samples, self._pad_id(), mask_truncated=self.mask_truncated_completions, device=device)
        ids = torch.cat([t.prompt_ids, t.completion_ids], dim=1)
        attention = torch.cat([t.prompt_mask, t.completion_mask], dim=1)
        keep = t.completion_ids.size(1)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            # pi_old: the weights at the start of this step, fixed over its micro-batches and passes.
            old, _, _ = self._get_per_token_logps_and_entropies(
                self.model, ids, attention, keep, batch_size=self.args.per_device_train_batch_size)
            ref = None
            if self.beta != 0.0:
                ref_model, reference = self.ref_model, contextlib.nullcontext()
                if ref_model is None:  # TRL keeps none with an adapter: the base is the adapter disabled
                    ref_model, reference = self.model, acc.unwrap_model(self.model).disable_adapter()
                with reference:
                    ref, _, _ = self._get_per_token_logps_and_entropies(
                        ref_model, ids, attention, keep, batch_size=self.args.per_device_train_batch_size)

        mask = t.loss_mask.to(old.dtype)
        signal = ((t.advantages != 0) & (t.loss_mask.sum(dim=1) > 0)).sum()
        self._batch_has_signal = self.beta != 0.0 or bool((acc.reduce(signal, reduction="sum")
                                                           if acc.num_processes > 1 else signal).item())
        out: dict[str, Any] = {
            "prompt_ids": t.prompt_ids, "prompt_mask": t.prompt_mask,
            "completion_ids": t.completion_ids, "completion_mask": t.completion_mask,
            "tool_mask": t.loss_mask,  # TRL's loss mask on top of completion_mask
            "advantages": t.advantages,
            "num_items_in_batch": acc.gather(t.loss_mask.sum()).sum(),
            "sampling_per_token_logps": t.behaviour_logprobs,
        }
        if self.use_vllm:
            out["old_per_token_logps"] = old
            out["importance_sampling_ratio"] = self._importance_ratio(old, t.behaviour_logprobs, mask)
        else:
            out["old_per_token_logps"] = t.behaviour_logprobs
        if ref is not None:
            out["ref_per_token_logps"] = ref
        self._record_batch(batch, step, wait_s, old, t.behaviour_logprobs, mask, out.get("importance_sampling_ratio"))
        return out

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> float:
        # transformers calls this right before the optimizer step with the (all-rank) pre-clip
        # norm; kept for `_SkipStepsWithoutSignal`, which runs next.
        self._last_grad_norm = float(super()._get_grad_norm(model, grad_norm))
        return self._last_grad_norm

    def _pad_id(self) -> int:
        tok = self.processing_class
        tok = getattr(tok, "tokenizer", tok)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return int(pad if pad is not None else 0)

    def _check_share(self, batch: Batch, step: int) -> None:
        if batch.step != step:
            raise RuntimeError(f"asked the sampler for batch {step}, got batch {batch.step}")
        expected = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
        if len(batch.samples) != expected:
            raise RuntimeError(
                f"batch {step} gave rank {self.accelerator.process_index} {len(batch.samples)} samples, expected "
                f"per_device_train_batch_size ({self.args.per_device_train_batch_size}) x "
                f"gradient_accumulation_steps ({self.args.gradient_accumulation_steps}) = {expected}")

    def _importance_ratio(self, old: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """pi_old / pi_behaviour per TRL's `vllm_importance_sampling_mode`: per token or per sequence
        (product over its loss tokens), then truncated (clamped) or masked (zeroed) outside
        [clip_min, clip_max]. Tokens without loss count as ratio 1."""
        mode = self.vllm_importance_sampling_mode
        lo, hi = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        diff = (old - behaviour) * mask
        if mode.startswith("sequence"):
            diff = diff.sum(dim=-1, keepdim=True)
        ratio = torch.exp(diff)
        if mode.endswith("truncate"):
            return torch.clamp(ratio, min=lo, max=hi)
        if mode.endswith("mask"):
            low = lo if lo is not None else -math.inf
            high = hi if hi is not None else math.inf
            return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
        raise ValueError(f"vllm_importance_sampling_mode {mode!r} is none of token_truncate, token_mask, "
                         "sequence_truncate, sequence_mask")

    def _record_batch(self, batch: Batch, step: int, wait_s: float, old: torch.Tensor, behaviour: torch.Tensor,
                      mask: torch.Tensor, ratio: torch.Tensor | None) -> None:
        """This step's numbers into TRL's metrics (averaged and cleared by `log`), all ranks reduced."""
        acc, device = self.accelerator, self.accelerator.device
        samples = batch.samples
        stale = [contract.staleness(step, s.policy_version) for s in samples]
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64, device=device)
        tokens = mask.sum()
        log_r = torch.where(mask > 0, old - behaviour, 0.0).double()  # log pi_old / mu on the loss tokens
        delta = log_r.abs().sum()
        # The native trainer's estimates of KL(mu || pi_old) over the loss tokens.
        k1, k2, k3 = (k.sum() for k in mismatch_estimates(log_r))
        local = torch.stack([
            rewards.sum(), (rewards ** 2).sum(), torch.tensor(float(len(samples)), dtype=torch.float64, device=device),
            torch.tensor(float(sum(stale)), dtype=torch.float64, device=device),
            torch.tensor(float(sum(len(s.completion_token_ids) for s in samples)), dtype=torch.float64, device=device),
            tokens.double(), delta.double(),
            (ratio * mask).sum().double() if ratio is not None and ratio.shape == mask.shape else tokens.double(),
            k1, k2, k3,
        ])
        total = acc.reduce(local, reduction="sum") if acc.num_processes > 1 else local
        peaks = torch.tensor([float(max(stale, default=0)), wait_s], dtype=torch.float64, device=device)
        peaks = acc.reduce(peaks, reduction="max") if acc.num_processes > 1 else peaks
        r_sum, r_sq, n, s_sum, c_len, tok, d_sum, ratio_sum, k1_sum, k2_sum, k3_sum = total.tolist()
        mismatch = {"mismatch_k1": k1_sum / max(tok, 1.0), "mismatch_k2": k2_sum / max(tok, 1.0),
                    "mismatch_k3": k3_sum / max(tok, 1.0)}
        mean = r_sum / n
        m = self._metrics["train"]
        m["reward"].append(mean)
        m["reward_std"].append(max(r_sq / n - mean * mean, 0.0) ** 0.5)
        m["completions/mean_length"].append(c_len / n)
        m["tandem/step"].append(float(step))
        m["tandem/staleness_mean"].append(s_sum / n)
        m["tandem/staleness_max"].append(peaks[0].item())
        m["tandem/batch_wait_s"].append(peaks[1].item())
        m["sampling/sampling_logp_difference/mean"].append(d_sum / max(tok, 1.0))
        for name, value in mismatch.items():
            m[f"tandem/{name}"].append(value)
        if ratio is not None and ratio.shape == mask.shape:
            m["sampling/importance_sampling_ratio/mean"].append(ratio_sum / max(tok, 1.0))
        self._step_metrics = {"reward_mean": mean, "staleness_mean": s_sum / n, "staleness_max": peaks[0].item(),
                              "batch_wait_s": peaks[1].item(), "behaviour_mismatch": d_sum / max(tok, 1.0),
                              **mismatch}
        self.tandem_batches.append({
            "step": step, "global_step": self.state.global_step, "batch_step": batch.step,
            "samples": len(samples), "policy_versions": sorted({s.policy_version for s in samples}),
            "staleness_min": min(stale), "staleness_max": max(stale), "staleness_mean": s_sum / n, "wait_s": wait_s,
            "reward_mean": mean, "fetched_at": time.time(),
        })

    # -- versions out ------------------------------------------------------------------------

    def publish_version(self, version: int) -> None:
        """Version `version` on its way out through the sampler (every rank calls it: gathering the
        state dict is a collective under sharding). The main process snapshots it and returns while
        the publication runs on (`Publisher`); its metrics line is written once the sampler has it.
        With max_staleness 0 it waits for it here, and the barrier keeps every rank from asking
        for the next batch before then."""
        acc = self.accelerator
        state_dict = acc.get_state_dict(self.model)
        if acc.is_main_process:
            metrics = {k: float(v) for k, v in list(self._step_metrics.items())[:MAX_METRICS]
                       if isinstance(v, (int, float)) and math.isfinite(v)}
            fetched = self.tandem_batches[-1] if self.tandem_batches else {}
            line = {"event": "step", "step": version - 1, "version": version, "optimizer_step": self.state.global_step,
                    **self._step_metrics, "train_s": time.time() - fetched.get("fetched_at", time.time()),
                    "skipped_no_signal": not self._batch_has_signal and self.skip_steps_without_signal,
                    "grad_norm": self._last_grad_norm}
            entry = {"version": version, "global_step": self.state.global_step}

            def done(info: dict[str, Any]) -> None:  # on the publisher's thread
                entry.update(at=time.time(), **info)
                self.tandem_publications.append(entry)
                self.metrics_log.write({**line, **{k: v for k, v in entry.items()
                                                   if k not in ("version", "path", "global_step", "at")}})

            entry.update(self.publisher.publish(version, version - 1, acc.unwrap_model(self.model), state_dict,
                                                self._probe_sample, metrics=metrics,
                                                resume_step=self.tandem_resume_step, done=done))
            if not contract.can_prefetch(self.sampler_config.max_staleness):
                entry["publish_wait_s"] += self.publisher.wait()
        del state_dict
        acc.wait_for_everyone()

    # -- evaluation through the sampler ------------------------------------------------------

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """`POST /eval` on the sampler and wait (main process); the result is logged with TRL's
        logging and returned on every rank as `{prefix}_reward`, `{prefix}_policy_version`, ..."""
        metrics: dict[str, Any] = {}
        if self.accelerator.is_main_process:
            started = time.monotonic()
            try:
                result = self._link.evaluate(self.eval_examples, self.eval_timeout)
                body = result.result or {}
                if result.status != "done":
                    raise RuntimeError(result.error or f"eval {result.eval_id} ended {result.status}")
                metrics = {f"{metric_key_prefix}_reward": eval_reward(body),
                           f"{metric_key_prefix}_policy_version": body.get("policy_version"),
                           f"{metric_key_prefix}_examples": body.get("num_examples")}
            except Exception as exc:  # noqa: BLE001 -- an eval must never take training down
                log.warning("eval through the sampler failed: %s", exc)
                metrics = {f"{metric_key_prefix}_reward": None, f"{metric_key_prefix}_error": str(exc)}
            metrics[f"{metric_key_prefix}_seconds"] = time.monotonic() - started
        if self.accelerator.num_processes > 1:
            holder = [metrics]
            broadcast_object_list(holder, from_process=0)
            metrics = holder[0]
        if self.accelerator.is_main_process:
            label = "periodic" if metric_key_prefix == "eval" else metric_key_prefix.removeprefix("eval_")
            self.metrics_log.write({"event": "eval", "label": label,
                                    "step": tandem_step(self.state.global_step, self.num_iterations),
                                    "version": metrics.get(f"{metric_key_prefix}_policy_version"),
                                    "reward": metrics.get(f"{metric_key_prefix}_reward"),
                                    "error": metrics.get(f"{metric_key_prefix}_error")})
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        # Trainer.log, not GRPOTrainer.log: the latter would fold (and clear) the training metrics
        # gathered since the last log line into this eval line when it runs mid-training.
        Trainer.log(self, numbers)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, numbers)
        return metrics

    def close(self) -> None:
        """Stop the publisher and the sampler link (their threads and connections) and close the
        metrics file."""
        self.publisher.close()
        self._link.close()
        self.metrics_log.close()


class _SkipStepsWithoutSignal(TrainerCallback):
    """Just before the optimizer step: when the batch carried no advantage signal, or the gradient
    norm is not finite, drop every gradient, so that AdamW leaves those parameters, their moments
    and their weight decay alone (it skips parameters without a gradient). Every rank decides
    alike (the signal is summed over ranks, the norm is the all-rank one), and every pass over the
    batch under num_iterations is skipped the same way when the batch has no signal."""

    def __init__(self, trainer: TandemGRPOTrainer):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        skip = trainer.skip_steps_without_signal and not trainer._batch_has_signal
        non_finite = not math.isfinite(trainer._last_grad_norm)
        if skip:
            trainer.skipped_steps_no_signal += 1
        elif non_finite:
            trainer.skipped_steps_non_finite += 1
            log.warning("optimizer step %d (batch %d): gradient norm %s is not finite; skipping the step, the "
                        "weights stay as they were (check the rewards, the learning rate and the precision)",
                        state.global_step, tandem_step(state.global_step, trainer.num_iterations),
                        trainer._last_grad_norm)
        if skip or non_finite:
            for param in trainer.model.parameters():
                param.grad = None
        trainer._metrics["train"]["tandem/skipped_no_signal"].append(float(skip))
        trainer._metrics["train"]["tandem/skipped_non_finite"].append(float(non_finite and not skip))


class _PublishEachVersion(TrainerCallback):
    """After optimizer step N's last pass: version N + 1 out. On a resumed run, the resumed
    version is announced again first (the previous run may have died between saving and
    publishing; the sampler answers 409 when it has it already, which is fine)."""

    def __init__(self, trainer: TandemGRPOTrainer):
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._note_checkpoint(args, state)  # a resumed run starts from one
        version = version_after(state.global_step, self.trainer.num_iterations)
        if state.global_step > 0 and version is not None:
            self.trainer.publish_version(version)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        version = version_after(state.global_step, self.trainer.num_iterations)
        if version is not None:
            self.trainer.publish_version(version)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The last version is out (or its error raised) before train() returns.
        if self.trainer.accelerator.is_main_process:
            self.trainer.publisher.wait()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._note_checkpoint(args, state)  # TRL calls this once the checkpoint is written

    def _note_checkpoint(self, args: Any, state: Any) -> None:
        """The batch a restart from TRL's newest checkpoint trains first, sent with every version
        so that the sampler keeps it (docs/sampler-api.md, `resume_step`). Without checkpoints
        (`save_strategy="no"`) there is nothing to resume, and the sampler keeps keep_batches."""
        saves = str(getattr(args.save_strategy, "value", args.save_strategy)) != "no"
        self.trainer.tandem_resume_step = tandem_step(state.global_step, self.trainer.num_iterations) if saves else None
