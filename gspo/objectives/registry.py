"""The two registries of :mod:`gspo.objectives` and their call contracts.

* ``OBJECTIVES``: policy losses with the signature of :class:`PolicyLossFn`
  (``gspo``, ``gspo_token``, ``grpo``, ... are registered by
  :mod:`gspo.objectives.policy_losses`).
* ``ADVANTAGES``: advantage estimators with the signature of :class:`AdvantageFn`
  (``grpo``, ``rloo``, ``reinforce_pp_baseline`` are registered by
  :mod:`gspo.objectives.advantages`).
* ``ROW_WEIGHTS``: per objective name, the rule (a :class:`RowWeightFn`) for the weights w_i
  of that loss's mean over rows, registered beside the loss; an objective without one
  weights every valid row by 1 (:func:`gspo.objectives.policy_losses.valid_row_weights`).

* ``EXTRA_STAT_KINDS``: per objective name, a zero-argument callable returning the reduction
  kinds of the stats that loss returns beyond the shared
  :data:`gspo.objectives.policy_losses.STAT_KINDS` (e.g. SAPO's gate weight), registered beside
  the loss; :attr:`gspo.objectives.Objective.stat_kinds` merges them.
* ``OPTION_CHECKS``: per objective name, a callable taking the bound options as keywords and
  raising ``ValueError`` (its message starting with the option's name) for a value the loss
  cannot use; the loss runs the same check, and binding runs it first, so a bad value stops
  a run before it starts (:func:`gspo.objectives.bind_objective`).

All five are :class:`gspo.registry.Registry` instances.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from torch import Tensor

from gspo.registry import Registry, UnknownNameError

__all__ = [
    "ADVANTAGES",
    "EXTRA_STAT_KINDS",
    "OBJECTIVES",
    "OPTION_CHECKS",
    "ROW_WEIGHTS",
    "AdvantageFn",
    "PolicyLossFn",
    "Registry",
    "RowWeightFn",
    "UnknownNameError",
]


class PolicyLossFn(Protocol):
    """Call signature shared by every entry of ``OBJECTIVES``.

    ``logprobs``/``old_logprobs``/``mask``/``ref_logprobs`` are [B, T]; ``advantages`` is
    [B] (or [B, T] where the objective allows it). Returns ``(loss, stats)`` where
    ``loss`` is a 0-d tensor to minimise and ``stats`` maps ``"objective/..."`` keys to
    detached float32 0-d tensors. A loss may take further keyword-only options (GSPO's
    ``aggregation``); options are only ever keyword-only arguments, so an unknown one raises
    ``TypeError`` (no ``**options``).
    """

    def __call__(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        eps_low: float,
        eps_high: float,
        beta: float = 0.0,
        ref_logprobs: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


class AdvantageFn(Protocol):
    """Call signature shared by every entry of ``ADVANTAGES``: rewards [N] -> advantages [N]."""

    def __call__(
        self, rewards: Tensor, group_size: int, *, scale: str = ..., eps: float = 1e-6
    ) -> Tensor: ...


class RowWeightFn(Protocol):
    """w_i [N] float32 of an objective's mean over rows, Σ_i w_i term_i / Σ_i w_i, from the
    response mask [N, T] and the loss's options (every keyword-only option, bound)."""

    def __call__(self, mask: Tensor, options: Mapping[str, Any]) -> Tensor: ...


OBJECTIVES: Registry[PolicyLossFn] = Registry("objective")
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")
ROW_WEIGHTS: Registry[RowWeightFn] = Registry("row-weight rule")
EXTRA_STAT_KINDS: Registry[Callable[[], Mapping[str, str]]] = Registry("stat-kind table")
OPTION_CHECKS: Registry[Callable[..., None]] = Registry("option check")
