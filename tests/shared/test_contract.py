"""The rules both sides agree on (shared/contract.py)."""

from __future__ import annotations

import pytest

from shared import contract
from shared.contract import ContractError, SamplerConfig


def test_shape_mismatch_names_every_number() -> None:
    with pytest.raises(ContractError) as info:
        contract.check_batch_shape(per_device_batch_size=3, grad_accum_steps=5, world_size=2,
                                   prompts_per_step=7, num_generations=11)
    message = str(info.value)
    for needle in ("per_device_batch_size (3)", "grad_accum_steps (5)", "world_size (2)", "= 30",
                   "prompts_per_step (7)", "num_generations (11)", "= 77"):
        assert needle in message, (needle, message)


def test_shape_match_and_hint() -> None:
    assert contract.check_batch_shape(4, 4, 2, 8, 4) == 32
    with pytest.raises(ContractError, match="--grad-accum-steps 8"):
        contract.check_batch_shape(4, 2, 1, 8, 4)


def test_batch_reuse_in_both_places_is_refused() -> None:
    contract.check_reuse(1, 4)
    contract.check_reuse(3, 1)
    with pytest.raises(ContractError, match="trained on 6 times"):
        contract.check_reuse(3, 2)


def test_staleness_bound_and_reuse_window() -> None:
    assert contract.resolve_max_staleness(3, on_policy=True) == 0
    assert contract.resolve_max_staleness(3, on_policy=False) == 3
    # max_staleness 1: batch 5 may come from version 4; never below version 0.
    assert [contract.oldest_allowed_version(s, 1) for s in (0, 1, 5)] == [0, 0, 4]
    # Reuse over 3 steps: steps 6, 7, 8 serve step 6's samples, so they share its bound.
    assert [contract.base_step(s, 3) for s in (6, 7, 8, 9)] == [6, 6, 6, 9]
    assert [contract.oldest_allowed_version(s, 2, 3) for s in (6, 7, 8)] == [4, 4, 4]
    assert [contract.use_count_after_reuse(1, s, contract.base_step(s, 3)) for s in (6, 7, 8)] == [1, 2, 3]
    assert contract.staleness(7, 5) == 2
    assert not contract.can_prefetch(0) and contract.can_prefetch(1)


def test_status_config_block_is_validated() -> None:
    config = SamplerConfig.from_status({"config": {"prompts_per_step": 2, "num_generations": 4, "future": 1}})
    assert (config.prompts_per_step, config.num_generations, config.max_staleness) == (2, 4, 0)
    with pytest.raises(ContractError, match="prompts_per_step"):
        SamplerConfig.from_status({"steps": {}})
    with pytest.raises(ContractError, match="max_staleness"):
        SamplerConfig.from_status({"config": {"prompts_per_step": 2, "num_generations": 4, "max_staleness": -1}})
    with pytest.raises(ContractError):
        SamplerConfig.from_status(["not", "a", "status"])


def test_truncation_of_the_samplers_sampling() -> None:
    Truncation = contract.Truncation
    assert Truncation.of_sampling(1.0, None, None) == Truncation()
    assert not Truncation.of_sampling(None, -1, 0.0).active  # vLLM's "off" values
    truncation = Truncation.of_sampling(0.9, 20, 0.05)
    assert truncation == Truncation(top_k=20, top_p=0.9, min_p=0.05) and truncation.active
    assert truncation.describe() == "min_p 0.05, top_k 20, top_p 0.9"
    config = SamplerConfig.from_status({"config": {"prompts_per_step": 2, "num_generations": 4, "top_p": 0.8}})
    assert config.truncation() == Truncation(top_p=0.8)
    with pytest.raises(ContractError, match=r"top_k -3 .*top_p 1\.5"):
        Truncation.of_sampling(1.5, -3, None)


def test_a_scorer_of_the_full_distribution_refuses_truncation_naming_the_settings() -> None:
    contract.check_untruncated_sampling(contract.Truncation(), "TRL's GRPOTrainer")
    with pytest.raises(ContractError, match=r"top_k 20, top_p 0\.9: .*while TRL's GRPOTrainer scores"):
        contract.check_untruncated_sampling(contract.Truncation.of_sampling(0.9, 20, None), "TRL's GRPOTrainer")


def test_checkpoint_every_against_keep_batches_of_a_sampler_that_does_not_hold_resume_steps() -> None:
    """An older sampler keeps only keep_batches behind the published version: a trainer killed just
    before checkpoint step 19 restarts at step 10, 9 versions back; keep_batches 8 cannot serve it."""
    old = SamplerConfig(prompts_per_step=8, num_generations=8, keep_batches=8)
    with pytest.raises(contract.ContractError) as caught:
        contract.check_retention(10, old)
    message = str(caught.value)
    assert "checkpoint_every 10" in message and "keep_batches 8" in message
    assert "checkpoint_every <= 9" in message and "keep_batches >= 9" in message
    contract.check_retention(9, old)
    contract.check_retention(10, SamplerConfig(prompts_per_step=8, num_generations=8, keep_batches=9))
    # A sampler that holds the trainer's resume step works with any cadence.
    contract.check_retention(1000, SamplerConfig(prompts_per_step=8, num_generations=8, keep_batches=1,
                                                 holds_resume_step=True))
