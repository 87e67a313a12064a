"""Tests for gspo.objectives.advantages."""

from __future__ import annotations

import math

import pytest
import torch

from gspo.objectives import ADVANTAGES, group_stats, grpo_advantages, rloo_advantages

NAN = float("nan")


def _t(values):
    return torch.tensor(values, dtype=torch.float64)


def test_grpo_hand_example():
    adv = grpo_advantages(_t([1, 0, 1, 0, 1, 1, 1, 0]), 4, eps=0.0)
    # group 0: mean 0.5, population std 0.5 -> +-1
    # group 1: mean 0.75, std sqrt((3 * 0.25^2 + 0.75^2) / 4) = sqrt(0.1875) = 0.4330127
    a, b = 0.25 / 0.4330127018922193, -0.75 / 0.4330127018922193
    torch.testing.assert_close(adv, _t([1, -1, 1, -1, a, a, a, b]))


def test_grpo_eps_in_denominator():
    adv = grpo_advantages(_t([1, 0]), 2, eps=0.5)
    torch.testing.assert_close(adv, _t([0.5 / 1.0, -0.5 / 1.0]))


def test_nan_rewards_are_excluded_and_get_zero():
    adv = grpo_advantages(_t([1, NAN, 0, 1]), 4, eps=0.0)
    # scorable [1, 0, 1]: mean 2/3, population std sqrt(2/9) = 0.47140452
    std = math.sqrt(2 / 9)
    torch.testing.assert_close(adv, _t([(1 / 3) / std, 0, -(2 / 3) / std, (1 / 3) / std]))
    assert not torch.isnan(adv).any()


def test_groups_without_signal_are_exactly_zero():
    rewards = _t([0.1, 0.1, 0.1, NAN, NAN, 1.0, 1.0, 0.0, NAN, NAN, NAN, NAN])
    for scale in ("group", "batch", "none"):
        adv = grpo_advantages(rewards, 3, scale=scale)
        assert torch.all(adv[:6] == 0), scale  # constant group; group with 1 scorable
        assert torch.all(adv[9:] == 0), scale  # all unscorable
        assert torch.all(adv[6:8] != 0), scale


def test_batch_and_none_scales():
    rewards = _t([1, 0, 3, 3])
    torch.testing.assert_close(grpo_advantages(rewards, 2, scale="none"), _t([0.5, -0.5, 0, 0]))
    # batch population std of [1, 0, 3, 3]: mean 1.75, var (0.5625+3.0625+1.5625*2)/4 = 1.6875
    std = math.sqrt(1.6875)
    adv = grpo_advantages(rewards, 2, scale="batch", eps=0.0)
    torch.testing.assert_close(adv, _t([0.5 / std, -0.5 / std, 0, 0]))


def test_batch_std_ignores_nan():
    adv = grpo_advantages(_t([1, 0, NAN, 3]), 2, scale="batch", eps=0.0)
    std = math.sqrt(((1 - 4 / 3) ** 2 + (4 / 3) ** 2 + (3 - 4 / 3) ** 2) / 3)
    torch.testing.assert_close(adv, _t([0.5 / std, -0.5 / std, 0, 0]))


@pytest.mark.parametrize("fn", [grpo_advantages, rloo_advantages])
def test_bad_arguments_raise(fn):
    with pytest.raises(ValueError, match="divisible"):
        fn(_t([1, 2, 3]), 2)
    with pytest.raises(ValueError):
        fn(_t([1, 2]), 0)
    with pytest.raises(ValueError):
        fn(_t([[1, 2]]), 2)
    with pytest.raises(ValueError, match="scale"):
        fn(_t([1, 2]), 2, scale="std")


def test_rloo_hand_example():
    adv = rloo_advantages(_t([3, 1, 2, 5, 5, 5]), 3)
    # 3 - (1+2)/2 = 1.5 ; 1 - (3+2)/2 = -1.5 ; 2 - (3+1)/2 = 0 ; constant group -> 0
    torch.testing.assert_close(adv, _t([1.5, -1.5, 0, 0, 0, 0]))


def test_rloo_with_nan_and_relation_to_grpo():
    adv = rloo_advantages(_t([3, NAN, 1, 2]), 4)
    torch.testing.assert_close(adv, _t([1.5, 0, -1.5, 0]))
    rewards = torch.rand(12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    k = 4
    torch.testing.assert_close(
        rloo_advantages(rewards, k), k / (k - 1) * grpo_advantages(rewards, k, scale="none")
    )


def test_rloo_group_scale():
    adv = rloo_advantages(_t([1, 0]), 2, scale="group", eps=0.0)
    # loo: 1 - 0 = 1, 0 - 1 = -1 ; group population std 0.5
    torch.testing.assert_close(adv, _t([2.0, -2.0]))


def test_output_is_constant_float32():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2], requires_grad=True)
    for fn in (grpo_advantages, rloo_advantages):
        adv = fn(rewards, 2)
        assert not adv.requires_grad and adv.dtype == torch.float32 and adv.shape == (4,)
    assert grpo_advantages(torch.tensor([1, 0, 1, 1]), 2).dtype == torch.float32


def test_group_stats():
    stats = group_stats(_t([1, 0, NAN, 1, 2, 2, 2, 2, NAN, NAN, NAN, 5]), 4)
    # group 0 scorable [1, 0, 1]: std sqrt(2/9); group 1 constant: std 0; group 2: 1 scorable
    assert stats["reward/mean"].item() == pytest.approx((2 + 8 + 5) / 8)
    assert stats["reward/std_within_group"].item() == pytest.approx(math.sqrt(2 / 9) / 2)
    assert stats["reward/frac_groups_zero_std"].item() == pytest.approx(2 / 3)
    assert stats["reward/unscorable_frac"].item() == pytest.approx(4 / 12)
    for v in stats.values():
        assert v.dtype == torch.float32 and v.dim() == 0 and not v.requires_grad


def test_registry_entries():
    assert ADVANTAGES["grpo"] is grpo_advantages
    assert ADVANTAGES["rloo"] is rloo_advantages


def test_the_configs_auto_scale_is_each_estimators_own():
    """objective.scale_rewards defaults to auto: each estimator's paper's scale (with the old
    default `group` passed to every estimator, reinforce_pp_baseline gave exactly grpo's
    advantages and rloo divided by the group std)."""
    from gspo.config import TrainConfig
    from gspo.objectives import compute_advantages

    assert TrainConfig().objective.scale_rewards == "auto"
    r = torch.tensor([0.0, 1.0, 1.0, 3.0, 2.0, 2.0, 2.0, 5.0])
    for name, own in [("grpo", "group"), ("rloo", "none"), ("reinforce_pp_baseline", "batch")]:
        auto = compute_advantages(name, r, 4)
        assert torch.equal(auto, ADVANTAGES[name](r, 4, scale=own)), name
        assert torch.equal(compute_advantages(name, r, 4, scale="group"),
                           ADVANTAGES[name](r, 4, scale="group"))
    assert not torch.allclose(compute_advantages("reinforce_pp_baseline", r, 4),
                              compute_advantages("grpo", r, 4))
