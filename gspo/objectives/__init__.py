"""Policy losses (GSPO, GSPO-token, GRPO, ...) and group advantage estimators.

Importing this package registers every objective in :data:`OBJECTIVES` and every
advantage estimator in :data:`ADVANTAGES`.
"""

from gspo.objectives.advantages import (
    SCALES,
    group_stats,
    grpo_advantages,
    rloo_advantages,
)
from gspo.objectives.policy_losses import (
    LOG_RATIO_CLAMP,
    STAT_KEYS,
    cispo_loss,
    gmpo_loss,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
)
from gspo.objectives.registry import (
    ADVANTAGES,
    OBJECTIVES,
    AdvantageFn,
    PolicyLossFn,
    Registry,
    UnknownNameError,
)

__all__ = [
    "ADVANTAGES",
    "LOG_RATIO_CLAMP",
    "OBJECTIVES",
    "SCALES",
    "STAT_KEYS",
    "AdvantageFn",
    "PolicyLossFn",
    "Registry",
    "UnknownNameError",
    "cispo_loss",
    "gmpo_loss",
    "group_stats",
    "grpo_advantages",
    "grpo_loss",
    "gspo_loss",
    "gspo_token_loss",
    "rloo_advantages",
]
