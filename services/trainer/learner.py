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

import contextlib
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.trainer.collate import MicroBatch, split_micro_batches
from services.trainer.corrections import Correction
from services.trainer.logprobs import truncated_token_logprobs
from services.trainer.loss import (
    IMPORTANCE_SAMPLING_LEVELS,
    PER_SEQUENCE,
    loss_normalizer,
    policy_loss,
)
from services.trainer.sharding import Sharding, make_sharding
from shared import contract
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
    # Off-policy corrections (loss.Correction, docs/corrections.md).
    is_mode: str = "truncate"
    is_low: float = 0.5
    is_high: float = 5.0
    seq_reject_low: float | None = None
    seq_reject_high: float | None = None
    mask_truncated_completions: bool = False
    logprob_chunk_size: int = 1024
    # The sampler's min_p / top_k / top_p: logprobs are scored over the same truncated set.
    truncation: Truncation | None = None

    @classmethod
    def from_settings(cls, s: Any, *, temperature: float, truncation: Truncation | None,
                      max_tokens: int | None) -> LossConfig:
        """The trainer's settings `s` (TrainerSettings) as a loss configuration; the completion
        length defaults to the sampler's `max_tokens`."""
        return cls(loss_type=s.loss, epsilon_low=s.epsilon_low, epsilon_high=s.epsilon_high, tis_cap=s.tis_cap,
                   beta=s.beta, temperature=temperature, max_completion_length=s.max_completion_length or max_tokens,
                   importance_sampling_level=s.importance_sampling_level, is_mode=s.is_mode, is_low=s.is_low,
                   is_high=s.is_high, seq_reject_low=s.seq_reject_low, seq_reject_high=s.seq_reject_high,
                   mask_truncated_completions=s.mask_truncated_completions,
                   logprob_chunk_size=s.logprob_chunk_size, truncation=truncation)

    def __post_init__(self) -> None:
        self.correction  # noqa: B018 - validates the correction settings
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"unknown importance_sampling_level {self.importance_sampling_level!r}; "
                             f"expected one of {IMPORTANCE_SAMPLING_LEVELS}")
        if self.loss_type not in LOSS_NAMES:
            raise ValueError(f"unknown loss {self.loss_type!r}; expected one of {LOSS_NAMES}")
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0")
        if self.loss_type == "dr_grpo" and not self.max_completion_length:
            raise ValueError("loss dr_grpo needs max_completion_length (the sampler's max_tokens)")

    @property
    def correction(self) -> Correction:
        return Correction.of(self)


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
    (logprobs.truncated_token_logprobs)."""
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


def carrying_split(micro_batches: Sequence[MicroBatch]) -> list[MicroBatch]:
    """Each micro-batch as its rows that can move the weights and, apart, those that cannot.

    Without a KL term every loss term of a row is multiplied by its advantage, so a row whose
    advantage is 0 adds exactly 0 to the gradient, yet its backward costs about twice its
    forward. Such rows are forwarded without a graph: the metrics, the normaliser and the
    corrections still see the whole batch, and the gradient is the same sum. Early in a run
    (nothing solved yet) and late (everything solved) most groups are like that."""
    out: list[MicroBatch] = []
    for mb in micro_batches:
        silent = (mb.advantages == 0).tolist()
        if not any(silent):
            out.append(mb)
            continue
        carrying = [k for k, quiet in enumerate(silent) if not quiet]
        if carrying:
            out.append(mb.rows(carrying, carries_gradient=True))
        out.append(mb.rows([k for k, quiet in enumerate(silent) if quiet], carries_gradient=False))
    return out


class Learner:
    def __init__(
        self,
        model: Any,
        optimizer: torch.optim.Optimizer,
        cfg: LossConfig,
        *,
        device: torch.device | str = "cpu",
        ref_model: Any = None,
        reference: Callable[[], contextlib.AbstractContextManager] | None = None,
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
        # Entered around every reference forward: a LoRA run's reference is the trained model
        # itself with its adapter disabled (services/trainer/lora.py), not a second copy.
        self.reference = reference or contextlib.nullcontext
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
        groups: list[torch.Tensor] | None = None,
    ) -> tuple[dict[str, Any], list[torch.Tensor], list[torch.Tensor] | None]:
        """Zero the gradients, then forward+backward every micro-batch (one pass); with
        `backward` False only the forwards, without gradients (a step that will not update).

        Returns local metric sums, pi_old per micro-batch (this pass's logprobs when `old`
        is None: the first pass, before any update) and the reference logprobs. `groups`: each
        micro-batch's staleness group per sequence (0, 1, 2 for 2+), for the per-staleness
        correction metrics (`sums["groups"]`: [3, len(PER_SEQUENCE)] sums, maxima for w_raw_max).
        """
        cfg = self.cfg
        correction = cfg.correction
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, Any] = dict.fromkeys(
            ("loss", "tokens", "kept", "clipped", "is_weight_sum", "is_weight_max", "is_truncated", "kl_sum",
             "ratio_sum", "forward_tokens", "logp_sum", "mismatch_sum", "outside_truncation", "normalizer_part",
             "signal"), 0.0)
        by_group = torch.zeros(len(STALENESS_GROUPS), len(PER_SEQUENCE), dtype=torch.float64)
        new_old: list[torch.Tensor] = []
        new_ref: list[torch.Tensor] | None = [] if cfg.beta else None
        for k, cpu_mb in enumerate(micro_batches):
            mb = cpu_mb.to(self.device)
            ref_k = None
            if cfg.beta:
                if ref is not None:
                    ref_k = ref[k]
                else:
                    with torch.no_grad(), self.reference():
                        ref_k = self._logprobs(self.ref_model, mb)[0]
                        self.sharding.reshard(self.ref_model)
                    new_ref.append(ref_k)
            # Under fsdp every backward reduce-scatters its gradients into the shards: deferring
            # that to the last micro-batch would keep a full float32 gradient on every rank.
            grad = backward and mb.carries_gradient
            with torch.set_grad_enabled(grad):
                logp, outside = self._logprobs(self.model, mb)
            old_k = old[k] if old is not None else logp.detach()
            new_old.append(old_k)
            out = policy_loss(
                logp, old_k, mb.behaviour_logprobs, mb.advantages, mb.loss_mask,
                loss_type=cfg.loss_type, normalizer=normalizer,
                epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high,
                tis_cap=cfg.tis_cap, beta=cfg.beta, ref=ref_k,
                importance_sampling_level=cfg.importance_sampling_level,
                correction=correction, max_completion_length=cfg.max_completion_length,
            )
            if grad:
                out.loss.backward()
            else:
                self.sharding.reshard(self.model)
            with torch.no_grad():
                mask = mb.loss_mask
                sums["tokens"] += float((mask > 0).sum())
                sums["logp_sum"] += float((logp.detach() * mask).sum())
                sums["mismatch_sum"] += float(((old_k - mb.behaviour_logprobs).abs() * mask).sum())
                sums["outside_truncation"] += float((outside & (mask > 0)).sum())
                _add_by_group(by_group, out.per_sequence, groups[k] if groups is not None else None)
            sums["loss"] += float(out.loss.detach())
            sums["kept"] += out.tokens
            sums["clipped"] += out.clipped
            sums["is_weight_sum"] += out.is_weight_sum
            sums["is_weight_max"] = max(sums["is_weight_max"], out.is_weight_max)
            sums["is_truncated"] += out.is_truncated
            sums["kl_sum"] += out.kl_sum
            sums["ratio_sum"] += out.ratio_sum
            sums["normalizer_part"] += out.normalizer_part
            sums["signal"] += out.signal
            sums["forward_tokens"] += mb.num_tokens
        sums["groups"] = by_group
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
        step: int | None = None,
    ) -> dict[str, float]:
        """Run `num_iterations` optimizer updates on this rank's `samples`; return global
        (all-rank) metrics of the first pass plus the last pass's grad norm, and whether the
        step was skipped (`skipped_no_signal`, `skipped_non_finite`: 0 or 1). `step`: the
        batch's step, for the per-staleness correction metrics (step - policy_version)."""
        # Eval mode (no dropout) keeps pass-2 ratios free of dropout noise; gradient
        # checkpointing in transformers only engages in train mode, so it keeps that.
        self.model.train(self.train_mode)
        micro_batches = split_micro_batches(samples, grad_accum_steps, self.pad_token_id,
                                            mask_truncated=self.cfg.mask_truncated_completions)
        if not self.cfg.beta and self.sharding.kind != "fsdp":
            # (fsdp: every forward is collective, so every rank must run as many.)
            micro_batches = carrying_split(micro_batches)
        groups = None
        if step is not None:
            last = len(STALENESS_GROUPS) - 1
            group_of = [min(max(contract.staleness(step, s.policy_version), 0), last) for s in samples]
            groups = [torch.tensor([group_of[i] for i in mb.indices]) for mb in micro_batches]
        # Masking and rejection decide what carries loss from pi_old, which each micro-batch's
        # forward computes: the loss is then taken over a normaliser of 1 and the gradients
        # divided by the real one (summed as the forwards go) once they are all done.
        deferred = self.cfg.correction.depends_on_forward
        normalizer = 1.0 if deferred else self.global_normalizer(micro_batches)
        signal = self.has_signal(micro_batches)  # before corrections: with them, an upper bound
        old = ref = None
        first: dict[str, Any] | None = None
        grad_norms: list[float] = []
        forward_tokens = 0.0
        non_finite = False
        for _ in range(num_iterations if signal else 1):
            sums, old, ref = self.accumulate(micro_batches, normalizer, old, ref, backward=signal, groups=groups)
            forward_tokens += sums["forward_tokens"]
            if first is None:
                first = sums
            else:
                # Clipping only happens after the first update; report the later passes' rate.
                first["clipped_later"] = first.get("clipped_later", 0.0) + sums["clipped"]
            if signal and deferred:
                total = self._all_reduce(torch.tensor([sums["normalizer_part"], sums["signal"]], dtype=torch.float64))
                kept_normalizer, kept_signal = total.tolist()
                if kept_signal == 0:
                    # Everything that could move the weights was masked or rejected.
                    self.optimizer.zero_grad(set_to_none=True)
                    signal = False
                else:
                    for p in self.params:
                        if p.grad is not None:
                            p.grad.div_(kept_normalizer)
                    sums["loss"] /= kept_normalizer
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

    def _global_metrics(self, sums: dict[str, Any], grad_norms: list[float],
                        forward_tokens: float, num_iterations: int) -> dict[str, float]:
        keys = ["loss", "tokens", "kept", "clipped", "clipped_later", "is_weight_sum", "is_truncated",
                "kl_sum", "ratio_sum", "logp_sum", "mismatch_sum", "outside_truncation"]
        groups = sums["groups"]
        w_max = PER_SEQUENCE.index("w_raw_max")
        total = self._all_reduce(torch.cat([torch.tensor([sums.get(k, 0.0) for k in keys] + [forward_tokens],
                                                         dtype=torch.float64), groups.flatten()]))
        peaks = self._all_reduce(torch.cat([torch.tensor([sums["is_weight_max"]], dtype=torch.float64),
                                            groups[:, w_max]]), "max")
        t = dict(zip(keys + ["forward_tokens"], total[: len(keys) + 1].tolist()))
        by_group = total[len(keys) + 1:].view_as(groups)
        by_group[:, w_max] = peaks[1:]
        tokens = max(t["tokens"], 1.0)
        kept = max(t["kept"], 1.0)
        later_tokens = max(t["kept"] * (num_iterations - 1), 1.0)
        out = {
            "loss": t["loss"],
            "loss_tokens": t["tokens"],
            "forward_tokens": t["forward_tokens"],
            "grad_norm": grad_norms[0],
            "grad_norm_last": grad_norms[-1],
            "clip_fraction": (t["clipped_later"] / later_tokens) if num_iterations > 1 else t["clipped"] / kept,
            "is_weight_mean": t["is_weight_sum"] / kept,
            "is_weight_max": float(peaks[0].item()),
            "is_truncated_fraction": t["is_truncated"] / kept,
            "ratio_mean": t["ratio_sum"] / kept,
            "logprob_mean": t["logp_sum"] / tokens,
            "behaviour_mismatch": t["mismatch_sum"] / tokens,
        }
        if self.cfg.beta:
            out["kl"] = t["kl_sum"] / kept
        if self.cfg.truncation is not None and self.cfg.truncation.active:
            # Loss tokens the sampler drew that the trainer's truncated policy (pass 1) excludes.
            out["outside_truncation_fraction"] = t["outside_truncation"] / tokens
        if self.cfg.correction.depends_on_forward:
            out["kept_tokens"] = t["kept"]
        out.update(correction_metrics(by_group.sum(0), by_group[:, w_max].max()))
        present = [g for g in range(len(STALENESS_GROUPS)) if by_group[g, PER_SEQUENCE.index("present")] > 0]
        if len(present) > 1:  # the batch mixes staleness values: the same numbers per staleness
            for g in present:
                for name, value in correction_metrics(by_group[g], by_group[g, w_max]).items():
                    out[f"{name}_stale{STALENESS_GROUPS[g]}"] = value
        return out


STALENESS_GROUPS = ("0", "1", "2plus")  # step - policy_version: 0, 1, 2 or more


def _add_by_group(by_group: torch.Tensor, per_sequence: dict[str, torch.Tensor], groups: torch.Tensor | None) -> None:
    """Add one micro-batch's per-sequence correction sums into [group, PER_SEQUENCE] (max for
    w_raw_max); all sequences count as staleness 0 when `groups` is None."""
    rows = torch.stack([per_sequence[name].cpu() for name in PER_SEQUENCE], dim=1)  # [B, metrics]
    g = groups if groups is not None else torch.zeros(rows.shape[0], dtype=torch.long)
    w_max = PER_SEQUENCE.index("w_raw_max")
    for group in g.unique().tolist():
        picked = rows[g == group]
        peak = torch.maximum(by_group[group, w_max], picked[:, w_max].max())
        by_group[group] += picked.sum(0)
        by_group[group, w_max] = peak


def correction_metrics(row: torch.Tensor, w_max: torch.Tensor | float) -> dict[str, float]:
    """The mismatch and correction metrics of one row of PER_SEQUENCE sums (docs/corrections.md)."""
    v = dict(zip(PER_SEQUENCE, row.tolist()))
    tokens, sequences = max(v["tokens"], 1.0), max(v["present"], 1.0)
    return {
        "mismatch_k1": v["k1"] / tokens,
        "mismatch_k2": v["k2"] / tokens,
        "mismatch_k3": v["k3"] / tokens,
        "is_weight_raw_mean": v["w_raw_sum"] / tokens,
        "is_weight_raw_max": float(w_max),
        "is_masked_fraction": v["masked"] / tokens,
        "rejected_fraction": v["rejected"] / sequences,
    }
