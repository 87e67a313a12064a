"""An objective bound from config: the registered loss with its options, and what the
trainer must know about it (row weights, stat reduction kinds), so that the trainer never
branches on an objective's name.

    objective = bind_objective(cfg.objective.name, asdict(cfg.objective),
                               asdict(ObjectiveConfig()))
    loss, stats = objective.loss(logprobs, old_logprobs, advantages, mask, ref_logprobs=ref)
    w = objective.row_weights(mask)  # [N] weights of the loss's mean over rows
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from gspo.config import ConfigError, CorrectionConfig, ObjectiveConfig
from gspo.objectives.corrections import CORRECTION_STAT_KINDS, BoundCorrection, apply_weights
from gspo.objectives.corrections import bind_correction as _bind_correction
from gspo.objectives.loss_terms import LOG_RATIO_CLAMP
from gspo.objectives.policy_losses import STAT_KINDS, valid_row_weights
from gspo.objectives.registry import (
    ADVANTAGES,
    EXTRA_STAT_KINDS,
    OBJECTIVES,
    OPTION_CHECKS,
    ROW_WEIGHTS,
    PolicyLossFn,
)

__all__ = ["TRAINER_FIELDS", "Objective", "bind_objective", "loss_options", "token_ratio_mean"]

TRAINER_FIELDS: tuple[str, ...] = (
    "name", "advantage", "scale_rewards", "num_minibatches", "epochs", "old_logprobs",
    "correction")
"""Fields of :class:`gspo.config.ObjectiveConfig` that configure the trainer, not the loss:
never passed to it. Every other field is an option of some loss."""

_TENSOR_ARGUMENTS = ("ref_logprobs",)  # keyword-only, but data rather than an option


def _option_defaults(name: str, fn: PolicyLossFn) -> dict[str, Any]:
    """Option -> default (``inspect.Parameter.empty`` if required), in signature order."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        raise TypeError(f"objective {name!r} takes **kwargs; a loss must declare each option "
                        "as a keyword-only parameter")
    return {p.name: p.default for p in params
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in _TENSOR_ARGUMENTS}


def loss_options(name: str) -> tuple[str, ...]:
    """Sorted option names of the loss registered as ``name``: its keyword-only parameters
    other than ``ref_logprobs``. Raises :class:`gspo.objectives.UnknownNameError`."""
    return tuple(sorted(_option_defaults(name, OBJECTIVES[name])))


def token_ratio_mean(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Mean token ratio w_it over response tokens (detached, float32); with
    ``objective/token_ratio_std`` it lets the std be pooled exactly across ranks."""
    on = mask > 0
    log_w = torch.where(on, logprobs.detach() - old_logprobs, 0.0)
    log_w = log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.where(on, log_w.exp(), 0.0).sum() / on.sum().clamp(min=1)).to(torch.float32)


@dataclass(frozen=True)
class Objective:
    """The loss registered as ``name`` with its options bound.

    ``options`` may leave out options that have a default; after construction it holds every
    option of the loss (defaults filled in). An unknown name raises
    :class:`gspo.objectives.UnknownNameError`, an option the loss does not take or a missing
    required one ``TypeError``. ``correction``: a bound behaviour correction
    (:mod:`gspo.objectives.corrections`) or None (the loss as registered).
    """

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    correction: BoundCorrection | None = None

    def __post_init__(self) -> None:
        defaults = _option_defaults(self.name, OBJECTIVES[self.name])
        unknown = sorted(set(self.options) - set(defaults))
        if unknown:
            raise TypeError(f"objective {self.name!r} does not take option(s) "
                            f"{', '.join(unknown)} (its options: {', '.join(sorted(defaults))})")
        missing = [k for k, d in defaults.items()
                   if d is inspect.Parameter.empty and k not in self.options]
        if missing:
            raise TypeError(f"objective {self.name!r} needs option(s) {', '.join(missing)}")
        resolved = {k: self.options[k] if k in self.options else d for k, d in defaults.items()}
        object.__setattr__(self, "options", resolved)

    @property
    def fn(self) -> PolicyLossFn:
        """The registered loss function."""
        return OBJECTIVES[self.name]

    @property
    def stat_kinds(self) -> Mapping[str, str]:
        """Reduction kind of every stat key :meth:`loss` can return (see ``STAT_KINDS``),
        with the loss's own extra stats (``EXTRA_STAT_KINDS``) where it declares any and the
        correction's (``CORRECTION_STAT_KINDS``) where one is bound."""
        extra = EXTRA_STAT_KINDS.get(self.name, None)
        kinds = dict(STAT_KINDS if extra is None else {**STAT_KINDS, **extra()})
        if self.correction is not None:
            kinds.update(CORRECTION_STAT_KINDS)
        return MappingProxyType(kinds)

    def loss(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
             *, ref_logprobs: Tensor | None = None, rollout_logprobs: Tensor | None = None
             ) -> tuple[Tensor, dict[str, Tensor]]:
        """The registered loss's ``(loss, stats)`` with the bound options; ``stats`` also
        holds ``objective/token_ratio_mean`` (see :func:`token_ratio_mean`).

        With a ``correction``, ``rollout_logprobs`` [B, T] (log π_rollout) is required: the
        advantages are multiplied by the correction's detached weights (per sequence [B] or
        per token [B, T]) and its stats are added."""
        fn, options = self.fn, self.options
        advantages, extra = self._corrected(logprobs, old_logprobs, advantages, mask,
                                            rollout_logprobs)
        if self.correction is not None and self.correction.via != self.name:
            fn = OBJECTIVES[self.correction.via]  # a token-level correction's token form
            options = {k: v for k, v in options.items()
                       if k in _option_defaults(self.correction.via, fn)}
        loss, stats = fn(logprobs, old_logprobs, advantages, mask,
                         ref_logprobs=ref_logprobs, **options)
        ratio = token_ratio_mean(logprobs, old_logprobs, mask)
        return loss, {**stats, **extra, "objective/token_ratio_mean": ratio}

    def seen_advantages(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                        mask: Tensor, *, rollout_logprobs: Tensor | None = None) -> Tensor:
        """The advantages :meth:`loss` weighs its terms by (detached): ``advantages`` times the
        bound correction's weights ([B], or [B, T] for token weights), ``advantages`` without
        one. A row whose advantages are all 0 here is not a signal row of the loss's stats
        (``objective/clip_frac_*_signal``), whatever its reward."""
        return self._corrected(logprobs, old_logprobs, advantages, mask,
                               rollout_logprobs)[0].detach()

    def _corrected(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                   mask: Tensor, rollout_logprobs: Tensor | None
                   ) -> tuple[Tensor, dict[str, Tensor]]:
        """(advantages × the correction's weights, its stats); the inputs without one."""
        if self.correction is None:
            return advantages, {}
        if rollout_logprobs is None:
            raise ValueError(f"objective {self.name!r} with correction "
                             f"{self.correction.name!r} needs rollout_logprobs")
        weights, extra = self.correction.weights(old_logprobs, rollout_logprobs, logprobs,
                                                 advantages, mask)
        return apply_weights(advantages, weights), extra

    def row_weights(self, mask: Tensor) -> Tensor:
        """w_i [N] float32 of the loss's mean over rows, Σ_i w_i term_i / Σ_i w_i, for the
        response mask [N, T] (the rule registered in ``ROW_WEIGHTS``; default: 1 per row with
        a response token)."""
        return ROW_WEIGHTS.get(self.name, valid_row_weights)(mask, self.options)


def bind_objective(name: str, values: Mapping[str, Any],
                   defaults: Mapping[str, Any]) -> Objective:
    """Bind the loss registered as ``name`` to the config's objective fields.

    ``values``: the fields of a :class:`gspo.config.ObjectiveConfig` (``dataclasses.asdict``);
    ``defaults``: the same for ``ObjectiveConfig()``. A field named like one of the loss's
    options is passed to it; :data:`TRAINER_FIELDS` never are; any other field must keep its
    default, else :class:`gspo.config.ConfigError` names the field and the loss; so does a
    value the loss's ``OPTION_CHECKS`` entry refuses. An unknown name raises
    :class:`gspo.objectives.UnknownNameError`.
    """
    takes = loss_options(name)
    options: dict[str, Any] = {}
    for key, value in values.items():
        if key in takes:
            options[key] = value
        elif key == "norm_constant" and values.get("aggregation") == "constant":
            raise ConfigError(f"objective.aggregation=constant: objective {name!r} has no "
                              "constant aggregation (its options: "
                              f"{', '.join(takes)}); a token-level loss such as grpo has")
        elif key not in TRAINER_FIELDS and (key not in defaults or value != defaults[key]):
            raise ConfigError(f"objective.{key}={value!r}: objective {name!r} does not take "
                              f"this option (its options: {', '.join(takes)})")
    try:
        OPTION_CHECKS.get(name, lambda **_: None)(**options)
    except ValueError as e:  # its message names the option
        raise ConfigError(f"objective.{e} (objective {name!r})") from None
    return Objective(name, options)


def objective_from_config(cfg: ObjectiveConfig) -> Objective:
    """:func:`bind_objective` for a run's ``objective`` section, with its
    ``objective.correction`` bound (:func:`gspo.objectives.corrections.bind_correction`)."""
    objective = bind_objective(cfg.name, dataclasses.asdict(cfg),
                               dataclasses.asdict(ObjectiveConfig()))
    if cfg.advantage not in ADVANTAGES:
        raise ConfigError(f"objective.advantage: unknown estimator {cfg.advantage!r} (choose "
                          f"{', '.join(ADVANTAGES.names())})")
    correction = _bind_correction(dataclasses.asdict(cfg.correction),
                                  dataclasses.asdict(CorrectionConfig()), objective=cfg.name,
                                  objective_options=objective.options,
                                  old_logprobs=cfg.old_logprobs)
    if correction is None:
        return objective
    return dataclasses.replace(objective, correction=correction)
