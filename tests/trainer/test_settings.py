"""Start-up checks: settings, the batch-shape agreement with the sampler, temperature."""

from __future__ import annotations

import pytest

from services.trainer.config import TrainerSettings
from services.trainer.entrypoint import main
from services.trainer.trainer import (
    check_batch_shape,
    learning_rate,
    resolve_temperature,
    sampler_config,
)
from shared.settings import SettingsError, build


def test_shape_mismatch_names_every_number() -> None:
    with pytest.raises(SystemExit) as info:
        check_batch_shape(per_device_batch_size=3, grad_accum_steps=5, world_size=2,
                          prompts_per_step=7, num_generations=11)
    assert info.value.code == 2
    message = str(info.value)
    for needle in ("per_device_batch_size (3)", "grad_accum_steps (5)", "world_size (2)", "= 30",
                   "prompts_per_step (7)", "num_generations (11)", "= 77"):
        assert needle in message, (needle, message)


def test_shape_match_and_hint() -> None:
    assert check_batch_shape(4, 4, 2, 8, 4) == 32
    with pytest.raises(SettingsError, match="--grad-accum-steps 8"):
        check_batch_shape(4, 2, 1, 8, 4)


def test_status_without_config_is_refused() -> None:
    with pytest.raises(SettingsError, match="prompts_per_step"):
        sampler_config({"steps": {}})
    assert sampler_config({"config": {"prompts_per_step": 2, "num_generations": 4}})["num_generations"] == 4


def test_temperature_comes_from_the_sampler_and_must_match() -> None:
    settings = build(TrainerSettings, {"model": "m"})
    assert resolve_temperature(settings, {"temperature": 0.7}) == 0.7
    with pytest.raises(SettingsError, match="greedy"):
        resolve_temperature(settings, {"temperature": 0.0})
    pinned = build(TrainerSettings, {"model": "m", "temperature": "0.9"})
    with pytest.raises(SettingsError, match=r"--temperature 0.9 differs from the sampler's temperature 0.7"):
        resolve_temperature(pinned, {"temperature": 0.7})


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


def test_batch_reuse_in_both_places_is_refused():
    from services.trainer.trainer import check_reuse
    from shared.settings import SettingsError

    check_reuse(1, 4)
    check_reuse(3, 1)
    with pytest.raises(SettingsError, match="trained on 6 times"):
        check_reuse(3, 2)
