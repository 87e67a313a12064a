"""The reward registry behind register_reward / resolve_reward."""

from __future__ import annotations

import pytest

import gspo.rewards.functions as reward_functions
from gspo.registry import Registry, UnknownNameError
from gspo.rewards import (
    REWARDS,
    RewardScorer,
    RewardSpecError,
    numeric_match,
    register_reward,
    resolve_reward,
)

BUILTIN = ["boxed_format", "code", "countdown", "final_numeric_match", "math_verify",
           "numeric_match", "reasoning_gym"]


@pytest.fixture
def rewards(monkeypatch: pytest.MonkeyPatch) -> Registry:
    """A fresh copy of REWARDS that register_reward / resolve_reward use, so nothing leaks."""
    fresh: Registry = Registry("reward function")
    for name, fn in REWARDS.items():
        fresh.register(name)(fn)
    monkeypatch.setattr(reward_functions, "REWARDS", fresh)
    return fresh


def test_builtin_names():
    assert isinstance(REWARDS, Registry)
    assert REWARDS.names() == BUILTIN


def test_duplicate_name_raises_and_keeps_the_first():
    with pytest.raises(ValueError, match="reward function 'numeric_match' is already registered"):
        register_reward("numeric_match")(lambda p, c, **_: [])
    assert REWARDS["numeric_match"] is numeric_match


def test_unknown_name_lists_the_registered_ones(rewards):
    register_reward("mine")(lambda p, c, **_: [1.0] * len(c))
    with pytest.raises(RewardSpecError) as info:
        resolve_reward("nope")
    assert str(info.value) == ("unknown reward 'nope'; choose one of: boxed_format, code, "
                               "countdown, final_numeric_match, math_verify, mine, "
                               "numeric_match, reasoning_gym "
                               "or give 'module:function'")
    with pytest.raises(UnknownNameError, match="choose one of: boxed_format, code, countdown"):
        REWARDS["nope"]


def test_user_registered_reward_resolves_by_name(rewards):
    @register_reward("length")
    def length(prompts, completions, **_):
        return [float(len(c)) for c in completions]

    assert rewards["length"] is length and resolve_reward("length") is length
    total, per_fn = RewardScorer.from_specs(["length"])(["p", "q"], ["ab", "abc"], {})
    assert total == [2.0, 3.0] and per_fn == {"length": [2.0, 3.0]}
    assert "length" not in REWARDS  # the fixture's copy took it, not the global registry
