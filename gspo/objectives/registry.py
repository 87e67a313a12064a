"""The two registries of :mod:`gspo.objectives` and their call contracts.

* ``OBJECTIVES``: policy losses with the signature of :class:`PolicyLossFn`
  (``gspo``, ``gspo_token``, ``grpo``, ... are registered by
  :mod:`gspo.objectives.policy_losses`).
* ``ADVANTAGES``: advantage estimators with the signature of :class:`AdvantageFn`
  (``grpo``, ``rloo`` are registered by :mod:`gspo.objectives.advantages`).

Both are :class:`gspo.registry.Registry` instances.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from gspo.registry import Registry, UnknownNameError

__all__ = [
    "ADVANTAGES",
    "OBJECTIVES",
    "AdvantageFn",
    "PolicyLossFn",
    "Registry",
    "UnknownNameError",
]


class PolicyLossFn(Protocol):
    """Call signature shared by every entry of ``OBJECTIVES``.

    ``logprobs``/``old_logprobs``/``mask``/``ref_logprobs`` are [B, T]; ``advantages`` is
    [B] (or [B, T] where the objective allows it). Returns ``(loss, stats)`` where
    ``loss`` is a 0-d tensor to minimise and ``stats`` maps ``"objective/..."`` keys to
    detached float32 0-d tensors.
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
        **options: Any,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


class AdvantageFn(Protocol):
    """Call signature shared by every entry of ``ADVANTAGES``: rewards [N] -> advantages [N]."""

    def __call__(
        self, rewards: Tensor, group_size: int, *, scale: str = ..., eps: float = 1e-6
    ) -> Tensor: ...


OBJECTIVES: Registry[PolicyLossFn] = Registry("objective")
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")
