"""Agreeing with the sampler at start-up: its config block of `GET /status` against the
trainer's settings, by the contract's rules (shared/contract.py: batch shape, batch reuse,
retention, truncation), and the temperature to score with. A disagreement is a SettingsError
(exit status 2) naming the numbers.
"""

from __future__ import annotations

import logging
from typing import Any

from services.trainer.config import TrainerSettings
from shared import contract
from shared.contract import SamplerConfig
from shared.settings import SettingsError

log = logging.getLogger("tandem.trainer")


def accept_sampler_config(status: Any, settings: TrainerSettings, world_size: int) -> SamplerConfig:
    """The sampler's config block from `GET /status`, once it agrees with these settings on the
    contract (shared/contract.py): batch shape, batch reuse, retention, a valid truncation. Refuses with SettingsError
    (exit status 2) naming the numbers."""
    try:
        config = SamplerConfig.from_status(status)
        contract.check_batch_shape(settings.per_device_batch_size, settings.grad_accum_steps, world_size,
                                   config.prompts_per_step, config.num_generations)
        contract.check_reuse(settings.num_iterations, config.num_iterations)
        contract.check_retention(settings.checkpoint_every, config)
        config.truncation()  # impossible values refused here; the trainer applies the rest
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
