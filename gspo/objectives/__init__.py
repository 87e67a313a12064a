"""Policy losses (GSPO, GSPO-token, GRPO, ...) and group advantage estimators.

Importing this package registers every objective in :data:`OBJECTIVES` (with its row-weight
rule in :data:`ROW_WEIGHTS`) and every advantage estimator in :data:`ADVANTAGES`.
:func:`bind_objective` binds an objective from config into an :class:`Objective`.
"""

from gspo.objectives.advantages import (
    SCALES,
    group_stats,
    grpo_advantages,
    rloo_advantages,
)
from gspo.objectives.corrections import (
    CORRECTION_STAT_KINDS,
    CORRECTIONS,
    BoundCorrection,
    bind_correction,
)
from gspo.objectives.policy_losses import (
    LOG_RATIO_CLAMP,
    STAT_KEYS,
    STAT_KIND_NAMES,
    STAT_KINDS,
    cispo_loss,
    gmpo_loss,
    grpo_loss,
    gspo_loss,
    gspo_row_weights,
    gspo_token_loss,
    valid_row_weights,
)
from gspo.objectives.registry import (
    ADVANTAGES,
    OBJECTIVES,
    ROW_WEIGHTS,
    AdvantageFn,
    PolicyLossFn,
    Registry,
    RowWeightFn,
    UnknownNameError,
)
from gspo.objectives.spec import (
    TRAINER_FIELDS,
    Objective,
    bind_objective,
    loss_options,
    objective_from_config,
    token_ratio_mean,
)

__all__ = [
    "ADVANTAGES",
    "CORRECTIONS",
    "CORRECTION_STAT_KINDS",
    "LOG_RATIO_CLAMP",
    "OBJECTIVES",
    "ROW_WEIGHTS",
    "SCALES",
    "STAT_KEYS",
    "STAT_KINDS",
    "STAT_KIND_NAMES",
    "TRAINER_FIELDS",
    "AdvantageFn",
    "BoundCorrection",
    "Objective",
    "PolicyLossFn",
    "Registry",
    "RowWeightFn",
    "UnknownNameError",
    "bind_correction",
    "bind_objective",
    "cispo_loss",
    "gmpo_loss",
    "group_stats",
    "grpo_advantages",
    "grpo_loss",
    "gspo_loss",
    "gspo_row_weights",
    "gspo_token_loss",
    "loss_options",
    "objective_from_config",
    "rloo_advantages",
    "token_ratio_mean",
    "valid_row_weights",
]
