"""Building blocks shared by the policy losses of :mod:`gspo.objectives.policy_losses`.

Input sanitising (padding -> 0, compute dtype), the overflow-safe exp, per-row token means,
the weighted mean over rows, the clipped surrogate and the stats every loss returns. The
conventions they implement are listed in the docstring of ``policy_losses``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "AGGREGATIONS",
    "LOG_RATIO_CLAMP",
    "LossBatch",
    "aggregate",
    "check_aggregation",
    "clip_masks",
    "clipped_surrogate",
    "exp_clamped",
    "finish",
    "prepare",
    "reduce_tokens",
    "seq_advantages",
    "token_advantages",
    "token_mean",
    "token_share",
]

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exp (overflow only)."""


@dataclass(frozen=True)
class LossBatch:
    """Sanitised inputs shared by all losses (padding replaced by 0)."""

    logprobs: Tensor  # [B, T] log π_θ, compute dtype, grad flows on mask positions only
    log_ratio: Tensor  # [B, T] log π_θ − sg[log π_θold], 0 on padding (not clamped)
    ref_logprobs: Tensor | None  # [B, T] sg[log π_ref] or None
    mask: Tensor  # [B, T] bool
    lengths: Tensor  # [B] |y_i| in compute dtype
    valid: Tensor  # [B] bool, |y_i| ≥ 1


def prepare(
    logprobs: Tensor,
    old_logprobs: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    beta: float,
    ref_logprobs: Tensor | None,
) -> LossBatch:
    """Validate arguments, upcast to the compute dtype and zero out padding."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    others = {"old_logprobs": old_logprobs, "mask": mask, "ref_logprobs": ref_logprobs}
    for label, t in others.items():
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(
                f"{label} shape {tuple(t.shape)} != logprobs shape {tuple(logprobs.shape)}"
            )
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"eps_low/eps_high must be >= 0, got {eps_low}, {eps_high}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_logprobs is None:
        raise ValueError("beta > 0 requires ref_logprobs [B, T]")
    dtype = torch.promote_types(
        torch.promote_types(logprobs.dtype, old_logprobs.dtype), torch.float32
    )
    m = mask > 0
    logp = torch.where(m, logprobs.to(dtype), 0.0)
    old = torch.where(m, old_logprobs.detach().to(dtype), 0.0)
    ref = None if ref_logprobs is None else torch.where(m, ref_logprobs.detach().to(dtype), 0.0)
    lengths = m.sum(-1).to(dtype)
    return LossBatch(logp, logp - old, ref, m, lengths, lengths > 0)


def exp_clamped(log_x: Tensor) -> Tensor:
    """exp with the overflow-safety clamp to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]."""
    return torch.exp(log_x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def token_mean(x: Tensor, b: LossBatch) -> Tensor:
    """[B, T] -> [B]: (1/|y_i|) Σ_t x_it over mask tokens (0 for empty rows)."""
    return torch.where(b.mask, x, 0.0).sum(-1) / b.lengths.clamp(min=1)


AGGREGATIONS = ("sequence", "token", "constant")
"""How a token-level loss reduces its per-token terms x_it (see :func:`reduce_tokens`)."""


def check_aggregation(aggregation: str, norm_constant: float) -> None:
    """Raise ``ValueError`` for an unknown ``aggregation``, for ``"constant"`` without a
    ``norm_constant > 0``, or for a ``norm_constant`` that another aggregation would ignore."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if aggregation == "constant" and not 0 < norm_constant < float("inf"):
        raise ValueError("aggregation='constant' needs norm_constant > 0 (Dr. GRPO: the "
                         f"generation budget, rollout.max_new_tokens), got {norm_constant!r}")
    if aggregation != "constant" and norm_constant != 0:
        raise ValueError(f"norm_constant={norm_constant!r} is only used with "
                         f"aggregation='constant' (got aggregation={aggregation!r})")


def reduce_tokens(x: Tensor, b: LossBatch, aggregation: str,
                  norm_constant: float) -> tuple[Tensor, Tensor | None]:
    """Per-token terms x_it [B, T] -> (per-row term [B], row weights [B] or None = 1 per valid
    row) such that :func:`aggregate` gives the loss:

    * ``"sequence"``: (1/|valid|) Σ_i (1/|y_i|) Σ_t x_it (GRPO, arXiv:2402.03300; default);
    * ``"token"``: Σ_i Σ_t x_it / Σ_i |y_i| (DAPO, arXiv:2503.14476, §3.3);
    * ``"constant"``: (1/|valid|) Σ_i Σ_t x_it / C with C = ``norm_constant`` (Dr. GRPO,
      arXiv:2503.20783, §3.1: the 1/|o_i| of GRPO replaced by a constant, the generation
      budget). Dr. GRPO's mean runs over all rows; here, as everywhere, over valid rows.
    """
    check_aggregation(aggregation, norm_constant)
    if aggregation == "constant":
        return torch.where(b.mask, x, 0.0).sum(-1) / norm_constant, None
    return token_mean(x, b), (b.lengths if aggregation == "token" else None)


def token_share(flags: Tensor, b: LossBatch) -> Tensor:
    """Fraction (detached, float32) of response tokens where ``flags`` [B, T] holds."""
    on = flags.detach() & b.mask
    return (on.sum() / b.mask.sum().clamp(min=1)).to(torch.float32)


def aggregate(v: Tensor, weight: Tensor) -> Tensor:
    """[B] -> 0-d: Σ_i w_i v_i / Σ_i w_i (w = 1 on valid rows gives the mean over valid rows)."""
    return (torch.where(weight > 0, v, 0.0) * weight).sum() / weight.sum().clamp(min=1)


def seq_advantages(advantages: Tensor, b: LossBatch) -> Tensor:
    """Â_i [B] as stop-gradient, 0 on empty rows."""
    if advantages.shape != b.valid.shape:
        raise ValueError(
            f"advantages must be [B]={tuple(b.valid.shape)}, got {tuple(advantages.shape)}"
        )
    return torch.where(b.valid, advantages.detach().to(b.lengths.dtype), 0.0)


def token_advantages(advantages: Tensor, b: LossBatch) -> Tensor:
    """Â_{i,t} [B, T] as stop-gradient ([B] is broadcast over t), 0 on padding."""
    if advantages.shape == b.valid.shape:
        advantages = advantages[:, None].expand_as(b.mask)
    elif advantages.shape != b.mask.shape:
        raise ValueError(
            f"advantages must be [B] or [B, T]={tuple(b.mask.shape)}, got {tuple(advantages.shape)}"
        )
    return torch.where(b.mask, advantages.detach().to(b.lengths.dtype), 0.0)


def clipped_surrogate(r: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """−min(r Â, clip(r, 1 − eps_low, 1 + eps_high) Â) (PPO/GRPO/GSPO clipped term)."""
    return -torch.minimum(r * adv, r.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)


def clip_masks(x: Tensor, adv: Tensor, lo: float, hi: float) -> tuple[Tensor, Tensor]:
    """(high, low): positions whose gradient clipping zeroes (Â>0, x>hi) / (Â<0, x<lo)."""
    x = x.detach()
    return (adv > 0) & (x > hi), (adv < 0) & (x < lo)


def _masked_mean(x: Tensor, sel: Tensor) -> Tensor:
    return torch.where(sel, x, 0.0).sum() / sel.sum().clamp(min=1)


def _masked_std(x: Tensor, sel: Tensor) -> Tensor:
    """Population std (divide by n) over selected entries; 0 when none."""
    mu = _masked_mean(x, sel)
    return _masked_mean((x - mu) ** 2, sel).sqrt()


def _masked_extreme(x: Tensor, sel: Tensor, largest: bool) -> Tensor:
    """max (or min) over selected entries; 0 when none are selected."""
    fill = -torch.inf if largest else torch.inf
    flat = torch.cat([torch.where(sel, x, fill).flatten(), x.new_full((1,), fill)])
    value = flat.max() if largest else flat.min()
    return torch.where(sel.any(), value, 0.0)


def _ratio_stats(b: LossBatch) -> dict[str, Tensor]:
    """Ratio diagnostics shared by every objective (all detached)."""
    log_r = b.log_ratio.detach()
    s = exp_clamped(token_mean(log_r, b))  # s_i = exp(mean_t log w_it), Eq. (7)
    w = exp_clamped(log_r)  # w_it
    return {
        "objective/seq_ratio_mean": _masked_mean(s, b.valid),
        "objective/seq_ratio_min": _masked_extreme(s, b.valid, largest=False),
        "objective/seq_ratio_max": _masked_extreme(s, b.valid, largest=True),
        "objective/seq_ratio_std": _masked_std(s, b.valid),
        "objective/token_ratio_std": _masked_std(w, b.mask),
        "objective/token_log_ratio_abs_max": _masked_extreme(log_r.abs(), b.mask, largest=True),
        # k3 estimate of KL(π_old || π_θ): (w − 1) − log w
        "objective/approx_kl": _masked_mean(
            (w - 1) - log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), b.mask
        ),
    }


def _clip_stats(high: Tensor, low: Tensor, b: LossBatch, adv_row: Tensor) -> dict[str, Tensor]:
    """Fractions of valid tokens / valid sequences that are clipped (high, low, either), and
    the same two fractions over the rows with signal only (``*_signal``: Â_i ≠ 0). A row with
    Â_i = 0 is never clipped yet counts in the plain fractions' denominators, so those fall
    with the share of zero-advantage groups; the ``*_signal`` ones do not."""
    flags = torch.stack([high | low, low, high]) & b.mask  # [3, B, T]: either, low, high
    tokens = flags.sum((1, 2)) / b.mask.sum().clamp(min=1)
    seqs = flags.any(-1).sum(-1) / b.valid.sum().clamp(min=1)
    stats = {f"objective/clip_frac_{unit}{kind}": frac[i]
             for unit, frac in (("tokens", tokens), ("seqs", seqs))
             for i, kind in enumerate(("", "_low", "_high"))}
    signal = b.valid & (adv_row != 0)  # [B]
    on = b.mask & signal[:, None]
    stats["objective/clip_frac_tokens_signal"] = (flags[0] & on).sum() / on.sum().clamp(min=1)
    stats["objective/clip_frac_seqs_signal"] = ((flags[0].any(-1) & signal).sum()
                                                / signal.sum().clamp(min=1))
    return stats


def finish(
    term: Tensor,
    b: LossBatch,
    *,
    adv_row: Tensor,
    high: Tensor,
    low: Tensor,
    beta: float,
    weight: Tensor | None = None,
    norm_constant: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Aggregate the per-sequence policy term [B], add the KL penalty and build stats.

    ``weight`` [B] defaults to 1 per valid row (mean over valid rows). The KL term is
    reduced like the policy term: per row its token mean, or with ``norm_constant`` C > 0
    (``aggregation="constant"``, see :func:`reduce_tokens`) its token sum / C; then
    aggregated with ``weight``.
    """
    if weight is None:
        weight = b.valid.to(term.dtype)
    policy_loss = aggregate(term, weight)
    loss = policy_loss
    stats = {"objective/policy_loss": policy_loss}
    if b.ref_logprobs is not None:
        d = (b.ref_logprobs - b.logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k3 = torch.exp(d) - d - 1  # k3, KL(π_θ‖π_ref)
        kl_rows = (torch.where(b.mask, k3, 0.0).sum(-1) / norm_constant if norm_constant > 0
                   else token_mean(k3, b))
        kl_ref = aggregate(kl_rows, weight)
        if beta > 0:
            loss = loss + beta * kl_ref
        stats["objective/kl_ref"] = kl_ref
    stats["objective/loss"] = loss
    stats.update(_clip_stats(high, low, b, adv_row))
    stats.update(_ratio_stats(b))
    stats["objective/adv_mean"] = _masked_mean(adv_row, b.valid)
    return loss, {k: v.detach().to(torch.float32) for k, v in stats.items()}
