"""One optimizer step on one batch: micro-batching, losses, gradient reduction, clipping.

`Learner.train_on_samples(samples, ...)` is everything the trainer does with a batch
once it has it, with no HTTP involved, so tests drive it directly:

1. split this rank's samples into `grad_accum_steps` micro-batches (`collate`);
2. add up the loss normaliser over all micro-batches and (all-reduce) all ranks, so each
   micro-batch's loss is its partial sum over the *global* normaliser (`loss.py`);
3. pass 1: forward every micro-batch, keep its logprobs detached as pi_old (and the
   reference model's logprobs when beta > 0), backward; passes 2..mu reuse pi_old;
4. after each pass: sum gradients over ranks (services/trainer/sharding.py: a bucketed
   all-reduce under ddp, FSDP's reduce-scatter under fsdp), clip, AdamW step.

Gradients are summed, not averaged, across ranks, because every rank's loss is
already divided by the global normaliser.

Two kinds of step leave the weights exactly as they were (no AdamW step, so neither
momentum nor weight decay moves them), and say so in the metrics:

* **no signal** (`skipped_no_signal`): no loss token anywhere in the batch (all ranks)
  carries a non-zero advantage and there is no KL term. The gradient would be zero, but
  AdamW would still move the weights with its momentum and decay, which is how a run that
  has solved its task forgets it. Only the forward runs, for the metrics.
* **non-finite** (`skipped_non_finite`): the loss or the gradient norm is NaN or infinite
  on some rank. The gradients are dropped, so one bad batch never reaches the weights.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.trainer.collate import MicroBatch, split_micro_batches
from services.trainer.loss import (
    IMPORTANCE_SAMPLING_LEVELS,
    loss_normalizer,
    policy_loss,
    truncated_token_logprobs,
)
from services.trainer.sharding import Sharding, make_sharding
from shared.contract import LOSS_NAMES, Truncation
from shared.wire import Sample

log = logging.getLogger("tandem.trainer.learner")


@dataclass
class LossConfig:
    loss_type: str = "grpo"
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    tis_cap: float | None = 2.0
    beta: float = 0.0
    temperature: float = 1.0
    max_completion_length: int | None = None
    importance_sampling_level: str = "token"  # or "sequence" (loss.py)
    mask_truncated_completions: bool = False
    logprob_chunk_size: int = 1024
    # The sampler's min_p / top_k / top_p: logprobs are scored over the same truncated set.
    truncation: Truncation | None = None

    def __post_init__(self) -> None:
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"unknown importance_sampling_level {self.importance_sampling_level!r}; "
                             f"expected one of {IMPORTANCE_SAMPLING_LEVELS}")
        if self.loss_type not in LOSS_NAMES:
            raise ValueError(f"unknown loss {self.loss_type!r}; expected one of {LOSS_NAMES}")
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0")
        if self.loss_type == "dr_grpo" and not self.max_completion_length:
            raise ValueError("loss dr_grpo needs max_completion_length (the sampler's max_tokens)")


def _accepts(model: Any, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def forward_logprobs(model: Any, mb: MicroBatch, temperature: float, chunk_size: int = 1024,
                     truncation: Truncation | None = None) -> torch.Tensor:
    """Logprobs [B, T] of `mb.targets` under `model`, over the window `mb.start:`."""
    return forward_logprobs_outside(model, mb, temperature, chunk_size, truncation)[0]


def forward_logprobs_outside(model: Any, mb: MicroBatch, temperature: float, chunk_size: int = 1024,
                             truncation: Truncation | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`forward_logprobs` and whether each target lies outside the truncated set
    (loss.truncated_token_logprobs)."""
    T = mb.targets.shape[1]
    kwargs: dict[str, Any] = {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask, "use_cache": False}
    if _accepts(model, "logits_to_keep"):
        # Only positions start..start+T-1 predict a completion token: the LM head runs on those
        # alone, and the logits need no slicing (a slice's backward builds a zero-filled gradient
        # of the whole unsliced logits, the memory token_logprobs's chunking saves).
        kwargs["logits_to_keep"] = torch.arange(mb.start, mb.start + T, device=mb.input_ids.device)
        logits = model(**kwargs).logits
    else:
        logits = model(**kwargs).logits[:, mb.start : mb.start + T]
    return truncated_token_logprobs(logits, mb.targets, temperature, chunk_size=chunk_size, truncation=truncation)


class Learner:
    def __init__(
        self,
        model: Any,
        optimizer: torch.optim.Optimizer,
        cfg: LossConfig,
        *,
        device: torch.device | str = "cpu",
        ref_model: Any = None,
        max_grad_norm: float | None = None,
        pad_token_id: int = 0,
        sharding: Sharding | None = None,
        train_mode: bool = False,
    ):
        if cfg.beta and ref_model is None:
            raise ValueError("beta > 0 needs a reference model")
        self.model = model
        self.optimizer = optimizer
        self.cfg = cfg
        self.device = torch.device(device)
        self.ref_model = ref_model
        self.max_grad_norm = max_grad_norm
        self.pad_token_id = pad_token_id
        self.sharding = sharding or make_sharding("single", distributed=False, rank=0, world_size=1,
                                                  device=self.device)
        self.distributed = self.sharding.distributed
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Set when gradient checkpointing is on (transformers only checkpoints in train mode).
        self.train_mode = train_mode

    def _all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return self.sharding.all_reduce(tensor, op)

    def _logprobs(self, model: Any, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        with self.sharding.autocast(self.device):
            return forward_logprobs_outside(model, mb, cfg.temperature, cfg.logprob_chunk_size, cfg.truncation)

    def global_normalizer(self, micro_batches: Sequence[MicroBatch]) -> float:
        local = sum(
            loss_normalizer(self.cfg.loss_type, mb.tokens_per_sequence, self.cfg.max_completion_length)
            for mb in micro_batches
        )
        total = self._all_reduce(torch.tensor([local], dtype=torch.float64))
        return float(total.item())

    def has_signal(self, micro_batches: Sequence[MicroBatch]) -> bool:
        """Whether any loss token of the whole batch (all ranks) can move the weights: one with a
        non-zero advantage, or any at all when a KL term pulls towards the reference model."""
        local = 0.0
        for mb in micro_batches:
            tokens = mb.loss_mask > 0
            if not self.cfg.beta:
                tokens = tokens & (mb.advantages != 0).unsqueeze(-1)
            local += float(tokens.sum())
        return float(self._all_reduce(torch.tensor([local], dtype=torch.float64)).item()) > 0

    def accumulate(
        self,
        micro_batches: Sequence[MicroBatch],
        normalizer: float,
        old: list[torch.Tensor] | None = None,
        ref: list[torch.Tensor] | None = None,
        *,
        backward: bool = True,
    ) -> tuple[dict[str, float], list[torch.Tensor], list[torch.Tensor] | None]:
        """Zero the gradients, then forward+backward every micro-batch (one pass); with
        `backward` False only the forwards, without gradients (a step that will not update).

        Returns local metric sums, pi_old per micro-batch (this pass's logprobs when `old`
        is None: the first pass, before any update) and the reference logprobs.
        """
        cfg = self.cfg
        self.optimizer.zero_grad(set_to_none=True)
        sums = dict.fromkeys(("loss", "tokens", "clipped", "is_weight_sum", "is_weight_max", "is_truncated",
                              "kl_sum", "ratio_sum", "forward_tokens", "logp_sum", "mismatch_sum",
                              "outside_truncation"), 0.0)
        new_old: list[torch.Tensor] = []
        new_ref: list[torch.Tensor] | None = [] if cfg.beta else None
        for k, cpu_mb in enumerate(micro_batches):
            mb = cpu_mb.to(self.device)
            ref_k = None
            if cfg.beta:
                if ref is not None:
                    ref_k = ref[k]
                else:
                    with torch.no_grad():
                        ref_k = self._logprobs(self.ref_model, mb)[0]
                    self.sharding.reshard(self.ref_model)
                    new_ref.append(ref_k)
            # Under fsdp every backward reduce-scatters its gradients into the shards: deferring
            # that to the last micro-batch would keep a full float32 gradient on every rank.
            with torch.set_grad_enabled(backward):
                logp, outside = self._logprobs(self.model, mb)
            old_k = old[k] if old is not None else logp.detach()
            new_old.append(old_k)
            out = policy_loss(
                logp, old_k, mb.behaviour_logprobs, mb.advantages, mb.loss_mask,
                loss_type=cfg.loss_type, normalizer=normalizer,
                epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high,
                tis_cap=cfg.tis_cap, beta=cfg.beta, ref=ref_k,
                importance_sampling_level=cfg.importance_sampling_level,
            )
            if backward:
                out.loss.backward()
            else:
                self.sharding.reshard(self.model)
            with torch.no_grad():
                mask = mb.loss_mask
                sums["logp_sum"] += float((logp.detach() * mask).sum())
                sums["mismatch_sum"] += float(((old_k - mb.behaviour_logprobs).abs() * mask).sum())
                sums["outside_truncation"] += float((outside & (mask > 0)).sum())
            sums["loss"] += float(out.loss.detach())
            sums["tokens"] += out.tokens
            sums["clipped"] += out.clipped
            sums["is_weight_sum"] += out.is_weight_sum
            sums["is_weight_max"] = max(sums["is_weight_max"], out.is_weight_max)
            sums["is_truncated"] += out.is_truncated
            sums["kl_sum"] += out.kl_sum
            sums["ratio_sum"] += out.ratio_sum
            sums["forward_tokens"] += mb.num_tokens
        return sums, (old if old is not None else new_old), (ref if ref is not None else new_ref)

    def clip_and_step(self, loss: float, lr: float | None = None) -> tuple[float, bool]:
        """Clip the (reduced) gradients and apply AdamW, unless the loss (summed over ranks) or
        the gradient norm is not finite: then the gradients are dropped and nothing moves.
        Returns the pre-clip gradient norm and whether the step was applied."""
        norm = self.sharding.clip_grad_norm(self.params, self.max_grad_norm)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return norm, False
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()
        return norm, True

    def train_on_samples(
        self,
        samples: Sequence[Sample],
        *,
        grad_accum_steps: int,
        num_iterations: int = 1,
        lr: float | None = None,
    ) -> dict[str, float]:
        """Run `num_iterations` optimizer updates on this rank's `samples`; return global
        (all-rank) metrics of the first pass plus the last pass's grad norm, and whether the
        step was skipped (`skipped_no_signal`, `skipped_non_finite`: 0 or 1)."""
        # Eval mode (no dropout) keeps pass-2 ratios free of dropout noise; gradient
        # checkpointing in transformers only engages in train mode, so it keeps that.
        self.model.train(self.train_mode)
        micro_batches = split_micro_batches(samples, grad_accum_steps, self.pad_token_id,
                                            mask_truncated=self.cfg.mask_truncated_completions)
        normalizer = self.global_normalizer(micro_batches)
        signal = self.has_signal(micro_batches)
        old = ref = None
        first: dict[str, float] | None = None
        grad_norms: list[float] = []
        forward_tokens = 0.0
        non_finite = False
        for _ in range(num_iterations if signal else 1):
            sums, old, ref = self.accumulate(micro_batches, normalizer, old, ref, backward=signal)
            forward_tokens += sums["forward_tokens"]
            if first is None:
                first = sums
            else:
                # Clipping only happens after the first update; report the later passes' rate.
                first["clipped_later"] = first.get("clipped_later", 0.0) + sums["clipped"]
            if not signal:
                grad_norms.append(0.0)
                break
            self.sharding.reduce_gradients(self.params)
            loss = float(self._all_reduce(torch.tensor([sums["loss"]], dtype=torch.float64)).item())
            norm, applied = self.clip_and_step(loss, lr)
            grad_norms.append(norm)
            if not applied:
                non_finite = True
                log.warning("loss %s, gradient norm %s: not finite, so this step leaves the weights as "
                            "they were (skipped)", loss, norm)
                break
        assert first is not None
        out = self._global_metrics(first, grad_norms, forward_tokens, num_iterations)
        out["skipped_no_signal"] = 0.0 if signal else 1.0
        out["skipped_non_finite"] = 1.0 if non_finite else 0.0
        return out

    def _global_metrics(self, sums: dict[str, float], grad_norms: list[float],
                        forward_tokens: float, num_iterations: int) -> dict[str, float]:
        keys = ["loss", "tokens", "clipped", "clipped_later", "is_weight_sum", "is_truncated",
                "kl_sum", "ratio_sum", "logp_sum", "mismatch_sum", "outside_truncation"]
        total = self._all_reduce(torch.tensor([sums.get(k, 0.0) for k in keys] + [forward_tokens],
                                              dtype=torch.float64))
        peak = self._all_reduce(torch.tensor([sums["is_weight_max"]], dtype=torch.float64), "max")
        t = dict(zip(keys + ["forward_tokens"], total.tolist()))
        tokens = max(t["tokens"], 1.0)
        later_tokens = max(t["tokens"] * (num_iterations - 1), 1.0)
        out = {
            "loss": t["loss"],
            "loss_tokens": t["tokens"],
            "forward_tokens": t["forward_tokens"],
            "grad_norm": grad_norms[0],
            "grad_norm_last": grad_norms[-1],
            "clip_fraction": (t["clipped_later"] / later_tokens) if num_iterations > 1 else t["clipped"] / tokens,
            "is_weight_mean": t["is_weight_sum"] / tokens,
            "is_weight_max": float(peak.item()),
            "is_truncated_fraction": t["is_truncated"] / tokens,
            "ratio_mean": t["ratio_sum"] / tokens,
            "logprob_mean": t["logp_sum"] / tokens,
            "behaviour_mismatch": t["mismatch_sum"] / tokens,
        }
        if self.cfg.beta:
            out["kl"] = t["kl_sum"] / tokens
        if self.cfg.truncation is not None and self.cfg.truncation.active:
            # Loss tokens the sampler drew that the trainer's truncated policy (pass 1) excludes.
            out["outside_truncation_fraction"] = t["outside_truncation"] / tokens
        return out
