import math

import pytest

from services.sampler.rollouts.advantages import NonFiniteAdvantages, group_advantages


def test_grpo_by_hand():
    # mean 0.5, sample std = sqrt((0.25*4)/3) = 0.57735
    adv = group_advantages([1.0, 0.0, 1.0, 0.0], "grpo")
    assert adv == pytest.approx([0.866025, -0.866025, 0.866025, -0.866025], abs=1e-5)


def test_no_std_and_rloo_by_hand():
    rewards = [1.0, 0.0, 0.0, 0.0]
    assert group_advantages(rewards, "no_std") == pytest.approx([0.75, -0.25, -0.25, -0.25])
    # leave-one-out: 1 - mean(0,0,0) = 1; 0 - mean(1,0,0) = -1/3
    assert group_advantages(rewards, "rloo") == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])


def test_equal_rewards_give_zero_advantage():
    for mode in ("grpo", "no_std", "rloo"):
        assert group_advantages([0.7] * 5, mode) == pytest.approx([0.0] * 5)
    assert group_advantages([1.0], "grpo") == [0.0]
    assert all(math.isfinite(a) for a in group_advantages([1e-9, 0.0], "grpo"))


def test_unknown_mode():
    with pytest.raises(ValueError, match="unknown advantage mode"):
        group_advantages([1.0, 0.0], "ppo")


@pytest.mark.parametrize("mode", ["grpo", "no_std", "rloo"])
def test_advantages_are_never_non_finite(mode):
    for rewards in ([1.0, float("nan")], [float("inf"), 0.0], [float("nan")], [float("-inf")] * 3):
        with pytest.raises(NonFiniteAdvantages, match="finite"):
            group_advantages(rewards, mode)
    # Huge but finite rewards: finite advantages (grpo is scale-free), or a clear error.
    try:
        advantages = group_advantages([1.7e308, -1.7e308, 0.0], mode)
    except NonFiniteAdvantages:
        assert mode != "grpo"
    else:
        assert all(math.isfinite(a) for a in advantages)
    assert group_advantages([1e200, -1e200], "grpo") == pytest.approx([0.7071067, -0.7071067])
