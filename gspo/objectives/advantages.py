"""Group-relative advantage estimators (registered in ``ADVANTAGES``) and reward stats.

Call contract (see :class:`gspo.objectives.registry.AdvantageFn`)::

    fn(rewards [N], group_size, *, scale=..., eps=1e-6) -> advantages [N]

with N = num_groups x group_size and the ``group_size`` responses to one prompt stored
in contiguous rows. Conventions shared by every estimator:

* Rewards are treated as constants (detached); the result is float32 (float64 stays
  float64).
* NaN reward = unscorable response: its advantage is 0 and it is excluded from every
  mean/std (of its group and of the batch).
* A group with < 2 scorable rows, or whose scorable rewards are all equal (no signal),
  gets all-zero advantages (exactly 0).
* All standard deviations are POPULATION std (divide by n, ``unbiased=False``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gspo.objectives.registry import ADVANTAGES

__all__ = [
    "SCALES",
    "compute_advantages",
    "group_stats",
    "grpo_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
]

SCALES = ("group", "batch", "none")


def compute_advantages(name: str, rewards: Tensor, group_size: int, *,
                       scale: str = "auto") -> Tensor:
    """``ADVANTAGES[name](rewards, group_size, scale=scale)``; ``scale="auto"`` (the config's
    default) leaves the estimator its own scale (its signature's default: ``group`` for
    ``grpo``, ``none`` for ``rloo``, ``batch`` for ``reinforce_pp_baseline``), so naming an
    estimator gives its paper's advantages rather than ``grpo``'s division by the group std."""
    fn = ADVANTAGES[name]
    return fn(rewards, group_size) if scale == "auto" else fn(rewards, group_size, scale=scale)


def _grouped(rewards: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Validate and reshape rewards [N] -> (r [G, K] with NaN->0, scorable mask [G, K])."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"number of rewards N={rewards.shape[0]} is not divisible by group_size={group_size}"
        )
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    r = rewards.detach().to(dtype).reshape(-1, group_size)
    scorable = ~torch.isnan(r)
    return torch.where(scorable, r, 0.0), scorable


def _group_moments(r: Tensor, scorable: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per group: (n [G], mean [G], centred r − mean [G, K] (0 if unscorable), std [G])."""
    n = scorable.sum(-1)
    mean = r.sum(-1) / n.clamp(min=1)
    centred = torch.where(scorable, r - mean[:, None], 0.0)
    std = ((centred**2).sum(-1) / n.clamp(min=1)).sqrt()  # population std
    return n, mean, centred, std


def _has_signal(r: Tensor, scorable: Tensor, n: Tensor) -> Tensor:
    """[G] bool: ≥ 2 scorable rows and not all scorable rewards equal."""
    hi = torch.where(scorable, r, -torch.inf).amax(-1)
    lo = torch.where(scorable, r, torch.inf).amin(-1)
    return (n >= 2) & (hi > lo)


def _batch_std(r: Tensor, scorable: Tensor) -> Tensor:
    """Population std of all scorable rewards of the batch (around the batch mean)."""
    n = scorable.sum().clamp(min=1)
    mean = r.sum() / n
    return (torch.where(scorable, r - mean, 0.0) ** 2).sum().div(n).sqrt()


def _scaled(
    centred: Tensor, r: Tensor, scorable: Tensor, std: Tensor, scale: str, eps: float
) -> Tensor:
    """Divide by group std, batch std or nothing, according to ``scale``."""
    if scale == "group":
        return centred / (std[:, None] + eps)
    if scale == "batch":
        return centred / (_batch_std(r, scorable) + eps)
    if scale == "none":
        return centred
    raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")


@ADVANTAGES.register("grpo")
def grpo_advantages(
    rewards: Tensor, group_size: int, *, scale: str = "group", eps: float = 1e-6
) -> Tensor:
    """Group-normalised advantages, arXiv:2507.18071 v2, Eq. (6).

    Â_i = (r_i − mean_group(r)) / (std_group(r) + eps) for ``scale="group"``;
    ``scale="batch"`` divides by the std of all scorable rewards of the batch instead;
    ``scale="none"`` does not divide (Dr. GRPO, arXiv:2503.20783). Population std.

    Args:
        rewards: [N] rewards (NaN = unscorable).
        group_size: K responses per prompt; N must be a multiple of K.
    Returns:
        [N] advantages, constant (no grad).
    """
    r, scorable = _grouped(rewards, group_size)
    n, _, centred, std = _group_moments(r, scorable)
    adv = _scaled(centred, r, scorable, std, scale, eps)
    keep = scorable & _has_signal(r, scorable, n)[:, None]
    return torch.where(keep, adv, 0.0).reshape(-1)


@ADVANTAGES.register("rloo")
def rloo_advantages(
    rewards: Tensor, group_size: int, *, scale: str = "none", eps: float = 1e-6
) -> Tensor:
    """REINFORCE leave-one-out advantages (Ahmadian et al., arXiv:2402.14740).

    Â_i = r_i − (1/(n−1)) Σ_{j≠i} r_j over the n scorable rows of the group
    (= n/(n−1) · (r_i − mean_group r)). By default (``scale="none"``) nothing is divided;
    ``"group"``/``"batch"`` additionally divide by the group/batch population std + eps.

    Args:
        rewards: [N] rewards (NaN = unscorable).
        group_size: K responses per prompt; N must be a multiple of K.
    Returns:
        [N] advantages, constant (no grad).
    """
    r, scorable = _grouped(rewards, group_size)
    n, _, centred, std = _group_moments(r, scorable)
    loo = centred * (n / (n - 1).clamp(min=1))[:, None]
    adv = _scaled(loo, r, scorable, std, scale, eps)
    keep = scorable & _has_signal(r, scorable, n)[:, None]
    return torch.where(keep, adv, 0.0).reshape(-1)


@ADVANTAGES.register("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(
    rewards: Tensor, group_size: int, *, scale: str = "batch", eps: float = 1e-6
) -> Tensor:
    """REINFORCE++ with the group-mean baseline ("REINFORCE++-baseline"), arXiv:2501.03262,
    the baseline variant: subtract the group mean, then normalise over the global batch.

    A_i = r_i − mean_group(r); with ``scale="batch"`` (the paper's) the advantages are
    whitened over the batch, Â_i = (A_i − mean_batch A) / (std_batch A + eps), with mean and
    population std over every scorable row of the batch (rows of groups without signal
    included, their A_i being 0). This differs from ``grpo`` with ``scale="batch"``, which
    divides by the std of the raw rewards. ``"group"`` divides by the group std instead
    (then equal to ``grpo``), ``"none"`` returns A_i. The paper's implementation whitens
    over tokens (each row weighted by its length); this call contract sees rewards only, so
    the batch statistics here weight every response once. Groups without signal get 0.

    Args:
        rewards: [N] rewards (NaN = unscorable).
        group_size: K responses per prompt; N must be a multiple of K.
    Returns:
        [N] advantages, constant (no grad).
    """
    r, scorable = _grouped(rewards, group_size)
    n, _, centred, std = _group_moments(r, scorable)
    if scale == "batch":
        count = scorable.sum().clamp(min=1)
        mean = centred.sum() / count
        dev = torch.where(scorable, centred - mean, 0.0)
        adv = dev / ((dev**2).sum() / count).sqrt().add(eps)
    else:
        adv = _scaled(centred, r, scorable, std, scale, eps)
    keep = scorable & _has_signal(r, scorable, n)[:, None]
    return torch.where(keep, adv, 0.0).reshape(-1)


def group_stats(rewards: Tensor, group_size: int) -> dict[str, Tensor]:
    """Detached float32 reward diagnostics for a batch of groups.

    Keys:
        ``reward/mean``: mean of scorable rewards (0 if none).
        ``reward/std_within_group``: mean over groups with ≥ 2 scorable rows of the
            population std of the group's scorable rewards (0 if no such group).
        ``reward/frac_groups_zero_std``: fraction of groups without signal (all scorable
            rewards equal, or < 2 scorable rows): their advantages are all zero.
        ``reward/unscorable_frac``: fraction of NaN rewards.
    """
    r, scorable = _grouped(rewards, group_size)
    n, _, _, std = _group_moments(r, scorable)
    multi = n >= 2
    stats = {
        "reward/mean": r.sum() / scorable.sum().clamp(min=1),
        "reward/std_within_group": torch.where(multi, std, 0.0).sum() / multi.sum().clamp(min=1),
        "reward/frac_groups_zero_std": (~_has_signal(r, scorable, n)).sum() / max(r.shape[0], 1),
        "reward/unscorable_frac": (~scorable).sum() / max(scorable.numel(), 1),
    }
    return {k: v.detach().to(torch.float32) for k, v in stats.items()}
