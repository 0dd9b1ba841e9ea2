"""Start-up checks: a TRL `GRPOConfig` against the sampler's `GET /status` config block.

The rules are the contract's (shared/contract.py), the same functions the native trainer and
the sampler call; this module only maps TRL's names onto them:

| contract                 | GRPOConfig                                         |
|--------------------------|----------------------------------------------------|
| per_device_batch_size    | per_device_train_batch_size                        |
| grad_accum_steps         | gradient_accumulation_steps (= steps_per_generation) |
| world_size               | accelerate's num_processes                         |
| num_iterations (trainer) | num_iterations                                     |
| temperature              | temperature                                        |

Everything is checked before a model is loaded, and a refusal is a `ContractError` (a
ValueError) that names the numbers and what to change.
"""

from __future__ import annotations

from typing import Any

from shared import contract
from shared.contract import ContractError, SamplerConfig


def check_grpo_config(args: Any, config: SamplerConfig, world_size: int) -> None:
    """Refuse a GRPOConfig that cannot train on this sampler's batches, naming what to change."""
    if getattr(args, "use_vllm", False):
        raise ContractError(
            "use_vllm=True: the Tandem sampler generates the completions, so TRL must not start its own "
            "vLLM generation; set use_vllm=False (the behaviour logprobs still drive the importance-sampling "
            "correction)"
        )
    if args.steps_per_generation != args.gradient_accumulation_steps:
        raise ContractError(
            f"steps_per_generation ({args.steps_per_generation}) differs from gradient_accumulation_steps "
            f"({args.gradient_accumulation_steps}): one sealed batch feeds exactly one optimizer step, so leave "
            "steps_per_generation and generation_batch_size unset"
        )
    contract.check_batch_shape(args.per_device_train_batch_size, args.gradient_accumulation_steps, world_size,
                               config.prompts_per_step, config.num_generations)
    if args.num_generations != config.num_generations:
        raise ContractError(
            f"num_generations mismatch: the GRPOConfig says {args.num_generations}, the sampler generates "
            f"{config.num_generations} completions per prompt; set num_generations={config.num_generations}"
        )
    share = args.per_device_train_batch_size * args.gradient_accumulation_steps
    if share % config.num_generations:
        raise ContractError(
            f"each of the {world_size} ranks gets {share} samples of a batch, which splits groups of "
            f"{config.num_generations}; make per_device_train_batch_size x gradient_accumulation_steps a multiple "
            f"of num_generations ({config.num_generations}), e.g. fewer processes"
        )
    contract.check_reuse(args.num_iterations, config.num_iterations)
    contract.check_untruncated_sampling(config.truncation(), "TRL's GRPOTrainer")
    sampler_t = config.temperature if config.temperature is not None else 1.0
    if sampler_t <= 0:
        raise ContractError(f"the sampler samples with temperature {sampler_t}: greedy decoding has no sampling "
                            "distribution to train on; set the sampler's temperature > 0")
    if abs(float(args.temperature) - float(sampler_t)) > 1e-6:
        raise ContractError(
            f"temperature mismatch: the GRPOConfig's temperature {args.temperature} differs from the sampler's "
            f"{sampler_t}; the behaviour logprobs are after the sampler's temperature, so set "
            f"temperature={sampler_t}"
        )
    if args.max_steps is None or args.max_steps <= 0:
        raise ContractError("max_steps must be set (> 0): the sampler, not a dataset, decides what a step "
                            "trains on, so there is no epoch to count")
    if args.max_steps % args.num_iterations:
        raise ContractError(
            f"max_steps ({args.max_steps}) is not a multiple of num_iterations ({args.num_iterations}): each "
            f"sampler step is trained for {args.num_iterations} optimizer steps and publishes one version after "
            "the last, so the run would end mid-step"
        )


def tandem_step(global_step: int, num_iterations: int) -> int:
    """The sampler step (batch and version arithmetic) that optimizer step `global_step` belongs to:
    with TRL's num_iterations mu, mu optimizer passes train batch N, as the native trainer's
    `num_iterations` does inside its one step N."""
    return global_step // num_iterations


def version_after(optimizer_steps_done: int, num_iterations: int) -> int | None:
    """The version to publish once `optimizer_steps_done` optimizer steps exist: N + 1 after the last
    pass over batch N, nothing in between (the weights of a step's middle passes are never served)."""
    if optimizer_steps_done % num_iterations:
        return None
    return optimizer_steps_done // num_iterations


def grpo_config_values(status: dict[str, Any], world_size: int, per_device_train_batch_size: int) -> dict[str, Any]:
    """The GRPOConfig fields the sampler decides, for a script that wants to start from them: the batch
    shape (gradient_accumulation_steps so that one batch feeds one optimizer step), num_generations,
    temperature, and max_completion_length = the sampler's max_tokens (Dr. GRPO's constant)."""
    config = SamplerConfig.from_status(status)
    total = contract.batch_size(config.prompts_per_step, config.num_generations)
    per_rank, rest = divmod(total, world_size)
    if rest or per_rank % per_device_train_batch_size:
        raise ContractError(
            f"the sampler's batch of {total} samples (prompts_per_step {config.prompts_per_step} x num_generations "
            f"{config.num_generations}) does not split into {world_size} ranks x micro-batches of "
            f"{per_device_train_batch_size}; pick a per-device batch size that divides {total // max(world_size, 1)}"
        )
    values: dict[str, Any] = {
        "per_device_train_batch_size": per_device_train_batch_size,
        "gradient_accumulation_steps": per_rank // per_device_train_batch_size,
        "num_generations": config.num_generations,
        "temperature": config.temperature if config.temperature is not None else 1.0,
    }
    if config.max_tokens is not None:
        values["max_completion_length"] = config.max_tokens
    return values
