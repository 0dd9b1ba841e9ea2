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

`SamplerConfig` is the `config` block of `GET /status`: the sampler serves it, the trainer
validates it before it loads a model. Importing this module never imports torch.
"""

from __future__ import annotations

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
    may be generated from version N, which is published before step N's training ends."""
    return max_staleness >= 1


# -- sampling the trainer can score -------------------------------------------------------


def check_untruncated_sampling(top_p: float | None, top_k: int | None, min_p: float | None) -> None:
    """The trainer scores completions under the full (temperature-scaled) distribution. With
    top_p < 1, top_k or min_p the inference server samples from a truncated one and reports
    logprobs renormalised over it, so every importance weight pi_old / pi_behaviour would be
    shifted (by -0.10 nats on average at top_p 0.9). Until the trainer applies the same
    truncation, such a sampler is refused, naming the settings."""
    truncating = []
    if top_p is not None and top_p < 1.0:
        truncating.append(f"top_p {top_p}")
    if top_k is not None and top_k > 0:
        truncating.append(f"top_k {top_k}")
    if min_p is not None and min_p > 0.0:
        truncating.append(f"min_p {min_p}")
    if truncating:
        raise ContractError(
            f"the sampler samples with {', '.join(truncating)}: the behaviour logprobs are renormalised "
            "over the truncated distribution while the trainer scores the full one, which biases every "
            "importance weight; set the sampler's top_p to 1 (and top_k / min_p off) to train on its batches"
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
    filter_zero_variance: bool | None = None
    inference_urls: list[str] | None = None

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
