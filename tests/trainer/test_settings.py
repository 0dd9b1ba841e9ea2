"""Start-up checks: settings, the batch-shape agreement with the sampler, temperature."""

from __future__ import annotations

import pytest

from services.trainer.config import TrainerSettings
from services.trainer.entrypoint import main
from services.trainer.agreement import accept_sampler_config, resolve_temperature
from services.trainer.step_record import learning_rate
from shared.contract import SamplerConfig
from shared.settings import SettingsError, build


def test_sampler_config_is_checked_against_the_trainer_settings() -> None:
    """The contract's refusals reach the trainer's user as SettingsError (exit status 2)."""
    settings = build(TrainerSettings, {"model": "m", "per_device_batch_size": "4", "grad_accum_steps": "2"})
    config = accept_sampler_config({"config": {"prompts_per_step": 2, "num_generations": 4}}, settings, 1)
    assert config.num_generations == 4 and config.max_staleness == 0
    with pytest.raises(SystemExit) as info:
        accept_sampler_config({"config": {"prompts_per_step": 4, "num_generations": 4}}, settings, 1)
    assert info.value.code == 2 and "--grad-accum-steps 4" in str(info.value)
    with pytest.raises(SettingsError, match="prompts_per_step"):
        accept_sampler_config({"steps": {}}, settings, 1)
    with pytest.raises(SettingsError, match="num_generations"):
        accept_sampler_config({"config": {"prompts_per_step": 2, "num_generations": "many"}}, settings, 1)
    # An older sampler (no resume-step hold) whose keep_batches the checkpoint cadence outruns.
    old_sampler = {"config": {"prompts_per_step": 2, "num_generations": 4, "keep_batches": 8}}
    with pytest.raises(SettingsError, match="checkpoint_every 10 and the sampler's keep_batches 8"):
        accept_sampler_config(old_sampler, settings, 1)
    accept_sampler_config({"config": {**old_sampler["config"], "holds_resume_step": True}}, settings, 1)
    reusing = build(TrainerSettings, {"model": "m", "per_device_batch_size": "4", "grad_accum_steps": "2",
                                      "num_iterations": "3"})
    with pytest.raises(SettingsError, match="trained on 6 times"):
        accept_sampler_config({"config": {"prompts_per_step": 2, "num_generations": 4, "num_iterations": 2}},
                              reusing, 1)


def test_temperature_comes_from_the_sampler_and_must_match() -> None:
    settings = build(TrainerSettings, {"model": "m"})
    def sampled_at(temperature: float) -> SamplerConfig:
        return SamplerConfig(prompts_per_step=1, num_generations=1, temperature=temperature)

    assert resolve_temperature(settings, sampled_at(0.7)) == 0.7
    with pytest.raises(SettingsError, match="greedy"):
        resolve_temperature(settings, sampled_at(0.0))
    pinned = build(TrainerSettings, {"model": "m", "temperature": "0.9"})
    with pytest.raises(SettingsError, match=r"--temperature 0.9 differs from the sampler's temperature 0.7"):
        resolve_temperature(pinned, sampled_at(0.7))


def test_settings_flags_and_disabling() -> None:
    s = build(TrainerSettings, {"model": "m", "tis_cap": "0", "max_grad_norm": "0", "epsilon_high": "0.28"})
    assert s.tis_cap is None and s.max_grad_norm is None and s.clip_high == 0.28
    assert build(TrainerSettings, {"model": "m"}).tis_cap == 2.0
    with pytest.raises(SettingsError, match="loss"):
        build(TrainerSettings, {"model": "m", "loss": "ppo"})
    warm = build(TrainerSettings, {"model": "m", "warmup_steps": "4", "learning_rate": "1e-3"})
    assert [learning_rate(warm, k) for k in (0, 3, 10)] == pytest.approx([2.5e-4, 1e-3, 1e-3])


def test_cli_without_model_exits_2_with_a_reason(capsys) -> None:
    assert main([], prog="tandem trainer") == 2
    assert "model is required" in capsys.readouterr().err
