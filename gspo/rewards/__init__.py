"""Reward functions: ``fn(prompts, completions, **columns) -> list[float | None]``.

``None`` (or an exception, a wrong length, a non-number) means *unscorable*: that response gets
advantage 0, is counted in the metrics, and the run goes on. A bool scores 1.0 or 0.0.
"""

from gspo.rewards.functions import (
    REWARDS,
    RewardSpecError,
    numeric_match,
    register_reward,
    resolve_reward,
)
from gspo.rewards.scoring import RewardError, RewardScorer
from gspo.rewards.transcript import final_numeric_match  # registers final_numeric_match

__all__ = [
    "REWARDS",
    "RewardError",
    "RewardScorer",
    "RewardSpecError",
    "final_numeric_match",
    "numeric_match",
    "register_reward",
    "resolve_reward",
]
