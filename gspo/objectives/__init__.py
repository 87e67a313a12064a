"""Policy losses (GSPO, GSPO-token, GRPO, ...) and group advantage estimators.

Importing this package registers every objective in :data:`OBJECTIVES` (with its row-weight
rule in :data:`ROW_WEIGHTS`) and every advantage estimator in :data:`ADVANTAGES`.
:func:`bind_objective` binds an objective from config into an :class:`Objective`.
"""

from gspo.objectives.advantages import (
    SCALES,
    group_stats,
    grpo_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from gspo.objectives.corrections import (
    CORRECTION_STAT_KINDS,
    CORRECTIONS,
    BoundCorrection,
    bind_correction,
)
from gspo.objectives.family import (
    binary_kl,
    clip_cov_loss,
    dppo_kl_loss,
    dppo_tv_loss,
    gpg_loss,
    kl_cov_loss,
    luspo_loss,
    sapo_loss,
    token_covariance,
)
from gspo.objectives.policy_losses import (
    LOG_RATIO_CLAMP,
    STAT_KEYS,
    STAT_KIND_NAMES,
    STAT_KINDS,
    aggregation_row_weights,
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
    EXTRA_STAT_KINDS,
    OBJECTIVES,
    OPTION_CHECKS,
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
    "EXTRA_STAT_KINDS",
    "LOG_RATIO_CLAMP",
    "OBJECTIVES",
    "OPTION_CHECKS",
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
    "aggregation_row_weights",
    "binary_kl",
    "bind_correction",
    "bind_objective",
    "cispo_loss",
    "clip_cov_loss",
    "dppo_kl_loss",
    "dppo_tv_loss",
    "gmpo_loss",
    "gpg_loss",
    "group_stats",
    "grpo_advantages",
    "grpo_loss",
    "gspo_loss",
    "gspo_row_weights",
    "gspo_token_loss",
    "kl_cov_loss",
    "loss_options",
    "luspo_loss",
    "objective_from_config",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "sapo_loss",
    "token_covariance",
    "token_ratio_mean",
    "valid_row_weights",
]
