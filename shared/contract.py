"""Every rule the sampler and the trainer must agree on, in one place.

Both services (and the demo, which starts both) import this module; nothing else re-states
these rules. The words are the ones docs/staleness.md and docs/settings.md use:

* **step N**: the N-th optimizer step; batch N is the batch it trains on.
* **version**: the number of optimizer updates in a set of weights; training on batch N
  publishes version N + 1.
* **staleness** of a sample in batch N: N - its `policy_version` (the oldest version that
  produced any of its tokens). Always a measurement, never a setting.
* **max_staleness**: the bound. Batch N may only hold fresh samples from weights of version
  >= N - max_staleness. 0 is synchronous on-policy training; `on_policy = true` is a
  shorthand for exactly that and is resolved by `resolve_max_staleness` when settings load.
* **num_iterations** (batch reuse): each generated batch is served for this many steps in a
  row. Reuse happens on one side only: the sampler's steps, or the trainer's passes.
* **batch shape**: one sealed batch feeds exactly one optimizer step, so
  prompts_per_step x num_generations = per_device_batch_size x grad_accum_steps x world_size.
* **truncation** (`Truncation`): min_p / top_k / top_p of the sampling. The behaviour logprobs
  are of the truncated distribution, so the trainer scores that one too (shared/truncation.py).

`SamplerConfig` is the `config` block of `GET /status`: the sampler serves it, the trainer
validates it before it loads a model. Importing this module never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# The trainer's loss functions (services/trainer/loss.py); the demo offers the same names.
LossName = Literal["grpo", "dapo", "dr_grpo"]
LOSS_NAMES: tuple[str, ...] = get_args(LossName)


class ContractError(ValueError):
    """The two sides disagree; the message names the numbers and the fix. A ValueError, so a
    settings validator turns it into an ordinary validation error."""


# -- batch shape ---------------------------------------------------------------------------


def batch_size(prompts_per_step: int, num_generations: int) -> int:
    """Samples in one sealed batch."""
    return prompts_per_step * num_generations


def check_batch_shape(per_device_batch_size: int, grad_accum_steps: int, world_size: int,
                      prompts_per_step: int, num_generations: int) -> int:
    """The batch size both sides agree on, or ContractError naming every number."""
    trainer_side = per_device_batch_size * grad_accum_steps * world_size
    sampler_side = batch_size(prompts_per_step, num_generations)
    if trainer_side != sampler_side:
        hint = ""
        per_rank = sampler_side / world_size
        if per_rank == int(per_rank) and int(per_rank) % per_device_batch_size == 0:
            hint = f"; e.g. --grad-accum-steps {int(per_rank) // per_device_batch_size}"
        raise ContractError(
            "batch shape mismatch: the trainer consumes per_device_batch_size "
            f"({per_device_batch_size}) x grad_accum_steps ({grad_accum_steps}) x world_size "
            f"({world_size}) = {trainer_side} samples per step, but the sampler seals "
            f"prompts_per_step ({prompts_per_step}) x num_generations ({num_generations}) = "
            f"{sampler_side}; one sealed batch must feed exactly one optimizer step, so make "
            f"the two products equal{hint}"
        )
    return trainer_side


# -- staleness and versions ----------------------------------------------------------------


def resolve_max_staleness(max_staleness: int, on_policy: bool) -> int:
    """The bound in force: `on_policy` is a shorthand for max_staleness 0."""
    return 0 if on_policy else max_staleness


def staleness(step: int, policy_version: int) -> int:
    """How many versions behind batch `step` a sample from `policy_version` is."""
    return step - policy_version


def base_step(step: int, num_iterations: int) -> int:
    """The step whose generated samples batch `step` serves: itself unless batches are
    reused, then the first step of its reuse window."""
    return step - step % num_iterations


def oldest_allowed_version(step: int, max_staleness: int, num_iterations: int = 1) -> int:
    """The oldest weights version fresh samples of batch `step` may come from. `GET /batch`
    answers 409 while the published version is below it."""
    return max(0, base_step(step, num_iterations) - max_staleness)


def can_prefetch(max_staleness: int) -> bool:
    """Whether the trainer may fetch batch N + 1 while it trains on N: only when that batch
    may be generated from version N, which is published (in the background) while step N
    trains; the trainer asks for it once that publication's POST has answered."""
    return max_staleness >= 1


# -- sampling the trainer can score -------------------------------------------------------


@dataclass(frozen=True)
class Truncation:
    """How the sampler truncates the sampling distribution (after temperature, in vLLM's order:
    min_p, then top_k, then top_p). The inference server reports logprobs renormalised over what
    is left (vLLM's `processed_logprobs`), so the trainer scores the same truncated distribution
    (shared/truncation.py holds the rule both apply). Off: top_k 0, top_p 1, min_p 0."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @classmethod
    def of_sampling(cls, top_p: float | None, top_k: int | None, min_p: float | None) -> Truncation:
        """From the sampler's request sampling (GET /status), None and vLLM's -1 meaning off;
        ContractError for values no server accepts."""
        top_k = 0 if top_k is None or top_k == -1 else top_k
        top_p = 1.0 if top_p is None else top_p
        min_p = 0.0 if min_p is None else min_p
        problems = []
        if top_k < 0:
            problems.append(f"top_k {top_k} (want -1, 0 or a positive count)")
        if not 0.0 < top_p <= 1.0:
            problems.append(f"top_p {top_p} (want 0 < top_p <= 1)")
        if not 0.0 <= min_p <= 1.0:
            problems.append(f"min_p {min_p} (want 0 <= min_p <= 1)")
        if problems:
            raise ContractError(f"the sampler samples with {', '.join(problems)}; fix its sampling settings")
        return cls(top_k=int(top_k), top_p=float(top_p), min_p=float(min_p))

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def describe(self) -> str:
        parts = [f"min_p {self.min_p}" if self.min_p > 0 else "", f"top_k {self.top_k}" if self.top_k > 0 else "",
                 f"top_p {self.top_p}" if self.top_p < 1.0 else ""]
        return ", ".join(part for part in parts if part) or "none"


def check_untruncated_sampling(truncation: Truncation, scorer: str) -> None:
    """For a trainer that scores the full distribution (`scorer` names it): refuse a sampler that
    truncates, since every importance weight pi_old / pi_behaviour would then be biased."""
    if truncation.active:
        raise ContractError(
            f"the sampler samples with {truncation.describe()}: the behaviour logprobs are renormalised "
            f"over the truncated distribution while {scorer} scores the full one, which biases every "
            "importance weight; set the sampler's top_p to 1 (and top_k / min_p off), or train with "
            "Tandem's own trainer, which applies the same truncation"
        )


# -- batch reuse ---------------------------------------------------------------------------


def use_count_after_reuse(use_count: int, step: int, base: int) -> int:
    """A sample generated for step `base` and served again at `step` (sampler-side reuse)
    counts one more use per step since `base`; its staleness grows the same way and is
    reported per step."""
    return use_count + (step - base)


def check_reuse(trainer_iterations: int, sampler_iterations: int) -> None:
    """Reuse in one place: the sampler (its steps serve a batch again) or the trainer (several
    updates per step), never both, which would square the reuse silently."""
    if trainer_iterations > 1 and sampler_iterations > 1:
        raise ContractError(
            f"both the trainer (num_iterations {trainer_iterations}) and the sampler (num_iterations "
            f"{sampler_iterations}) reuse batches: each batch would be trained on "
            f"{trainer_iterations * sampler_iterations} times; set one of them to 1"
        )


# -- the config block of GET /status ------------------------------------------------------


class SamplerConfig(BaseModel):
    """What the trainer needs to know of the sampler's settings, served in `GET /status`.

    Fields the trainer relies on are required; the rest describe the run for people and
    dashboards. Extra fields are allowed so that a newer sampler can add some."""

    model_config = ConfigDict(extra="allow")

    prompts_per_step: int = Field(ge=1)
    num_generations: int = Field(ge=1)
    batch_size: int | None = Field(default=None, ge=1)
    max_staleness: int = Field(default=0, ge=0, description="the bound in force (0 when on_policy)")
    on_policy: bool = False
    num_iterations: int = Field(default=1, ge=1)
    temperature: float | None = Field(default=None, ge=0, description="the sampler's sampling temperature")
    max_tokens: int | None = Field(default=None, ge=1, description="completion length cap the sampler asks for")
    namespace: str | None = None
    env: str | None = None
    strategy: str | None = None
    top_p: float | None = Field(default=None, description="the sampling every request starts from")
    top_k: int | None = None
    min_p: float | None = None
    max_concurrency: int | None = None
    advantage: str | None = None
    seed: int | None = None
    keep_batches: int | None = None
    holds_resume_step: bool = Field(
        default=False, description="keeps every batch from the trainer's resume_step on (older samplers: "
        "keep_batches alone decides)")
    filter_zero_variance: bool | None = None
    inference_urls: list[str] | None = None

    def truncation(self) -> Truncation:
        """The truncation every request starts from (ContractError for impossible values)."""
        return Truncation.of_sampling(self.top_p, self.top_k, self.min_p)

    @classmethod
    def from_status(cls, status: object) -> SamplerConfig:
        """The config block of a `GET /status` body, or ContractError saying what is wrong."""
        config = status.get("config") if isinstance(status, dict) else None
        if not isinstance(config, dict):
            keys = sorted(status) if isinstance(status, dict) else type(status).__name__
            raise ContractError(
                "the sampler's GET /status has no config with prompts_per_step and num_generations; "
                f"cannot check the batch shape (got keys {keys}). Is the URL a Tandem sampler?"
            )
        try:
            return cls.model_validate(config)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
            raise ContractError(
                f"the sampler's GET /status config does not fit this trainer ({problems}); "
                "run a sampler and trainer of the same Tandem version"
            ) from None


def check_retention(checkpoint_every: int, config: SamplerConfig) -> None:
    """A killed trainer restarts at the step after its newest full checkpoint, up to
    `checkpoint_every - 1` steps behind the version it last published. A sampler that keeps
    batches from the trainer's resume step on (`holds_resume_step`) always has them; an older
    one keeps only `keep_batches` behind the published version, which must then cover that gap."""
    if config.holds_resume_step or config.keep_batches is None:
        return
    if checkpoint_every - 1 > config.keep_batches:
        raise ContractError(
            f"the trainer's checkpoint_every {checkpoint_every} and the sampler's keep_batches "
            f"{config.keep_batches} cannot work together: this sampler keeps only {config.keep_batches} batches "
            f"behind the published version, and a trainer killed before its next checkpoint would restart up to "
            f"{checkpoint_every - 1} steps back, on batches already deleted. Set checkpoint_every <= "
            f"{config.keep_batches + 1} or the sampler's keep_batches >= {checkpoint_every - 1} (or run a "
            "sampler that holds the trainer's resume step)"
        )
