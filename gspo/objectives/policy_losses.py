"""Policy-gradient surrogate losses: GSPO, GSPO-token, GRPO and two extra baselines.

Paper: Zheng et al., "Group Sequence Policy Optimization", arXiv:2507.18071 v2.

Every loss has the signature of :class:`gspo.objectives.registry.PolicyLossFn`::

    fn(logprobs, old_logprobs, advantages, mask, *, eps_low, eps_high,
       beta=0.0, ref_logprobs=None, **options) -> (loss, stats)

Shapes and conventions shared by all losses:

* ``logprobs`` [B, T]: log π_θ(y_{i,t} | x, y_{i,<t}) of the sampled tokens (requires grad).
* ``old_logprobs`` [B, T]: the same under π_θold; always treated as stop-gradient.
* ``advantages`` [B] (Â_i) or, where allowed, [B, T] (Â_{i,t}); always stop-gradient.
* ``mask`` [B, T]: response-token mask; a position counts when ``mask > 0`` (binary).
  Padding positions may hold arbitrary values (even inf/NaN): they are replaced by 0
  before any arithmetic, so they change neither the loss nor any gradient.
* |y_i| = number of mask tokens of row i. Rows with |y_i| = 0 contribute nothing and are
  not counted in the mean over rows ("valid rows"). With no valid row the loss is a
  graph-connected 0 and all stats are 0.
* Ratios are computed in float32 (bf16/fp16 inputs are upcast), float64 stays float64.
  Log-ratios are clamped to [-20, 20] right before ``exp`` purely for overflow safety
  (a ratio beyond e^20 ~ 4.9e8 is already meaningless); the clamp has zero gradient
  outside that range.
* ``beta > 0`` adds beta x k3 estimate of KL(π_θ || π_ref) per token,
  exp(ref - logp) - (ref - logp) - 1, aggregated like the policy term (requires
  ``ref_logprobs`` [B, T]).
* Unknown ``**options`` raise ``TypeError``.

``stats`` holds detached float32 0-d tensors (see :data:`STAT_KEYS`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gspo.objectives.registry import OBJECTIVES

__all__ = [
    "LOG_RATIO_CLAMP",
    "STAT_KEYS",
    "cispo_loss",
    "gmpo_loss",
    "grpo_loss",
    "gspo_loss",
    "gspo_token_loss",
]

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exp (overflow only)."""

STAT_KEYS: tuple[str, ...] = (
    "objective/loss",
    "objective/policy_loss",
    "objective/clip_frac_tokens",
    "objective/clip_frac_tokens_low",
    "objective/clip_frac_tokens_high",
    "objective/clip_frac_seqs",
    "objective/clip_frac_seqs_low",
    "objective/clip_frac_seqs_high",
    "objective/seq_ratio_mean",
    "objective/seq_ratio_min",
    "objective/seq_ratio_max",
    "objective/seq_ratio_std",
    "objective/token_ratio_std",
    "objective/token_log_ratio_abs_max",
    "objective/approx_kl",
    "objective/adv_mean",
)
"""Keys always present in ``stats``; ``objective/kl_ref`` is added when ref_logprobs is given."""

_GSPO_AGGREGATIONS = ("sequence", "token")


# --------------------------------------------------------------------------- helpers


@dataclass(frozen=True)
class _Batch:
    """Sanitised inputs shared by all losses (padding replaced by 0)."""

    logprobs: Tensor  # [B, T] log π_θ, compute dtype, grad flows on mask positions only
    log_ratio: Tensor  # [B, T] log π_θ − sg[log π_θold], 0 on padding (not clamped)
    ref_logprobs: Tensor | None  # [B, T] sg[log π_ref] or None
    mask: Tensor  # [B, T] bool
    lengths: Tensor  # [B] |y_i| in compute dtype
    valid: Tensor  # [B] bool, |y_i| ≥ 1


def _reject_options(name: str, options: dict[str, Any]) -> None:
    if options:
        bad = ", ".join(repr(k) for k in sorted(options))
        raise TypeError(f"{name}() got unexpected option(s): {bad}")


def _prepare(
    logprobs: Tensor,
    old_logprobs: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    beta: float,
    ref_logprobs: Tensor | None,
) -> _Batch:
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
    return _Batch(logp, logp - old, ref, m, lengths, lengths > 0)


def _exp(log_x: Tensor) -> Tensor:
    """exp with the overflow-safety clamp to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]."""
    return torch.exp(log_x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _token_mean(x: Tensor, b: _Batch) -> Tensor:
    """[B, T] -> [B]: (1/|y_i|) Σ_t x_it over mask tokens (0 for empty rows)."""
    return torch.where(b.mask, x, 0.0).sum(-1) / b.lengths.clamp(min=1)


def _aggregate(v: Tensor, weight: Tensor) -> Tensor:
    """[B] -> 0-d: Σ_i w_i v_i / Σ_i w_i (w = 1 on valid rows gives the mean over valid rows)."""
    return (torch.where(weight > 0, v, 0.0) * weight).sum() / weight.sum().clamp(min=1)


def _seq_advantages(advantages: Tensor, b: _Batch) -> Tensor:
    """Â_i [B] as stop-gradient, 0 on empty rows."""
    if advantages.shape != b.valid.shape:
        raise ValueError(
            f"advantages must be [B]={tuple(b.valid.shape)}, got {tuple(advantages.shape)}"
        )
    return torch.where(b.valid, advantages.detach().to(b.lengths.dtype), 0.0)


def _token_advantages(advantages: Tensor, b: _Batch) -> Tensor:
    """Â_{i,t} [B, T] as stop-gradient ([B] is broadcast over t), 0 on padding."""
    if advantages.shape == b.valid.shape:
        advantages = advantages[:, None].expand_as(b.mask)
    elif advantages.shape != b.mask.shape:
        raise ValueError(
            f"advantages must be [B] or [B, T]={tuple(b.mask.shape)}, got {tuple(advantages.shape)}"
        )
    return torch.where(b.mask, advantages.detach().to(b.lengths.dtype), 0.0)


def _clipped_surrogate(r: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """−min(r Â, clip(r, 1 − eps_low, 1 + eps_high) Â) (PPO/GRPO/GSPO clipped term)."""
    return -torch.minimum(r * adv, r.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)


def _clip_masks(x: Tensor, adv: Tensor, lo: float, hi: float) -> tuple[Tensor, Tensor]:
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


def _ratio_stats(b: _Batch) -> dict[str, Tensor]:
    """Ratio diagnostics shared by every objective (all detached)."""
    log_r = b.log_ratio.detach()
    s = _exp(_token_mean(log_r, b))  # s_i = exp(mean_t log w_it), Eq. (7)
    w = _exp(log_r)  # w_it
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


def _clip_stats(high: Tensor, low: Tensor, b: _Batch) -> dict[str, Tensor]:
    """Fractions of valid tokens / valid sequences that are clipped (high, low, either)."""
    flags = torch.stack([high | low, low, high]) & b.mask  # [3, B, T]: either, low, high
    tokens = flags.sum((1, 2)) / b.mask.sum().clamp(min=1)
    seqs = flags.any(-1).sum(-1) / b.valid.sum().clamp(min=1)
    return {f"objective/clip_frac_{unit}{kind}": frac[i]
            for unit, frac in (("tokens", tokens), ("seqs", seqs))
            for i, kind in enumerate(("", "_low", "_high"))}


def _finish(
    term: Tensor,
    b: _Batch,
    *,
    adv_row: Tensor,
    high: Tensor,
    low: Tensor,
    beta: float,
    weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Aggregate the per-sequence policy term [B], add the KL penalty and build stats.

    ``weight`` [B] defaults to 1 per valid row (mean over valid rows).
    """
    if weight is None:
        weight = b.valid.to(term.dtype)
    policy_loss = _aggregate(term, weight)
    loss = policy_loss
    stats = {"objective/policy_loss": policy_loss}
    if b.ref_logprobs is not None:
        d = (b.ref_logprobs - b.logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl_ref = _aggregate(_token_mean(torch.exp(d) - d - 1, b), weight)  # k3, KL(π_θ‖π_ref)
        if beta > 0:
            loss = loss + beta * kl_ref
        stats["objective/kl_ref"] = kl_ref
    stats["objective/loss"] = loss
    stats.update(_clip_stats(high, low, b))
    stats.update(_ratio_stats(b))
    stats["objective/adv_mean"] = _masked_mean(adv_row, b.valid)
    return loss, {k: v.detach().to(torch.float32) for k, v in stats.items()}


# --------------------------------------------------------------------------- losses


@OBJECTIVES.register("gspo")
def gspo_loss(
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
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO loss, arXiv:2507.18071 v2, Eq. (5)-(7).

    s_i = (π_θ(y_i|x) / π_θold(y_i|x))^(1/|y_i|) = exp((1/|y_i|) Σ_t (logp_it − sg[old_it]))
    (Eq. (7); the sequence log-ratio is clamped to [-20, 20] before exp, overflow only);
    loss = mean over valid rows of −min(s_i Â_i, clip(s_i, 1 − eps_low, 1 + eps_high) Â_i)
    (negated Eq. (5)). Shapes: logprobs/old_logprobs/mask [B, T], advantages [B].
    Stop-gradient: old_logprobs, advantages (and ref_logprobs).

    Options:
        aggregation: ``"sequence"`` (default, the paper's 1/G Σ_i of Eq. (5)) or
            ``"token"``: Σ_i |y_i| term_i / Σ_i |y_i|, a length-weighted variant that is
            NOT Eq. (5) (it is what several library implementations compute); it emits a
            ``UserWarning``.

    A clipped sequence counts all of its tokens as clipped in the token clip stats.
    """
    aggregation = options.pop("aggregation", "sequence")
    _reject_options("gspo", options)
    if aggregation not in _GSPO_AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {_GSPO_AGGREGATIONS}, got {aggregation!r}")
    if aggregation == "token":
        warnings.warn(
            "gspo aggregation='token' is length-weighted (sum_i |y_i| term_i / sum_i |y_i|) "
            "and is not the paper's sequence mean of arXiv:2507.18071 v2, Eq. (5)",
            stacklevel=2,
        )
    b = _prepare(logprobs, old_logprobs, mask, eps_low, eps_high, beta, ref_logprobs)
    adv = _seq_advantages(advantages, b)  # Â_i [B]
    s = _exp(_token_mean(b.log_ratio, b))  # s_i [B], Eq. (7)
    term = _clipped_surrogate(s, adv, eps_low, eps_high)  # [B]
    high, low = _clip_masks(s[:, None], adv[:, None], 1.0 - eps_low, 1.0 + eps_high)  # [B, T]
    weight = b.lengths if aggregation == "token" else None
    return _finish(term, b, adv_row=adv, high=high, low=low, beta=beta, weight=weight)


@OBJECTIVES.register("gspo_token")
def gspo_token_loss(
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
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token loss, arXiv:2507.18071 v2, Eq. (13)-(14).

    s_it = sg[s_i] · π_θ(y_it) / sg[π_θ(y_it)] = exp(sg[log s_i] + logp_it − sg[logp_it])
    (Eq. (14)); per token −min(s_it Â_it, clip(s_it, 1 − eps_low, 1 + eps_high) Â_it),
    token mean per sequence (1/|y_i|), then mean over valid rows (negated Eq. (13)).
    Shapes: logprobs/old_logprobs/mask [B, T], advantages [B] (broadcast) or [B, T].
    Stop-gradient: s_i, the detached logp in the denominator, old_logprobs, advantages.
    With Â_it = Â_i its value and gradient equal :func:`gspo_loss`.
    """
    _reject_options("gspo_token", options)
    b = _prepare(logprobs, old_logprobs, mask, eps_low, eps_high, beta, ref_logprobs)
    adv = _token_advantages(advantages, b)  # Â_it [B, T]
    log_s = _token_mean(b.log_ratio, b).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).detach()
    s_it = torch.exp(log_s[:, None] + b.logprobs - b.logprobs.detach())  # Eq. (14)
    term = _token_mean(_clipped_surrogate(s_it, adv, eps_low, eps_high), b)
    high, low = _clip_masks(s_it, adv, 1.0 - eps_low, 1.0 + eps_high)
    return _finish(term, b, adv_row=_token_mean(adv, b), high=high, low=low, beta=beta)


@OBJECTIVES.register("grpo")
def grpo_loss(
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
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO loss as written in arXiv:2507.18071 v2, Eq. (2)-(3).

    w_it = π_θ(y_it) / π_θold(y_it) = exp(logp_it − sg[old_it]) (token ratio, clamped in
    log space to [-20, 20], overflow only); per token
    −min(w_it Â_it, clip(w_it, 1 − eps_low, 1 + eps_high) Â_it), token mean per sequence
    (1/|y_i|), then mean over valid rows. Shapes: logprobs/old_logprobs/mask [B, T],
    advantages [B] (Â_it = Â_i, broadcast) or [B, T]. Stop-gradient: old_logprobs,
    advantages. A sequence counts as clipped-low/high if any of its tokens is.
    """
    _reject_options("grpo", options)
    b = _prepare(logprobs, old_logprobs, mask, eps_low, eps_high, beta, ref_logprobs)
    adv = _token_advantages(advantages, b)  # Â_it [B, T]
    w = _exp(b.log_ratio)  # w_it [B, T]
    term = _token_mean(_clipped_surrogate(w, adv, eps_low, eps_high), b)
    high, low = _clip_masks(w, adv, 1.0 - eps_low, 1.0 + eps_high)
    return _finish(term, b, adv_row=_token_mean(adv, b), high=high, low=low, beta=beta)


@OBJECTIVES.register("cispo")
def cispo_loss(
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
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO loss (MiniMax-M1, arXiv:2506.13585), baseline; not part of arXiv:2507.18071.

    Per token −sg[clip(w_it, 1 − eps_low, 1 + eps_high)] · Â_it · logp_it, token mean per
    sequence, then mean over valid rows (MiniMax-M1 normalises by the total token count
    instead; here the aggregation matches :func:`grpo_loss`). Shapes as in
    :func:`grpo_loss`. Stop-gradient: the clipped IS weight, old_logprobs, advantages.
    The loss *value* is not an objective estimate (it contains logp itself); only its
    gradient −sg[ŵ] Â ∇logp is meaningful. Clipping never zeroes a gradient here, so the
    clip stats count tokens whose weight was truncated: w > 1 + eps_high ("high") or
    w < 1 − eps_low ("low"), whatever the sign of Â.
    """
    _reject_options("cispo", options)
    b = _prepare(logprobs, old_logprobs, mask, eps_low, eps_high, beta, ref_logprobs)
    adv = _token_advantages(advantages, b)
    w = _exp(b.log_ratio).detach()
    w_hat = w.clamp(1.0 - eps_low, 1.0 + eps_high)
    term = _token_mean(-(w_hat * adv * b.logprobs), b)
    high, low = w > 1.0 + eps_high, w < 1.0 - eps_low
    return _finish(term, b, adv_row=_token_mean(adv, b), high=high, low=low, beta=beta)


@OBJECTIVES.register("gmpo")
def gmpo_loss(
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
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO loss (Geometric-Mean Policy Optimization, arXiv:2507.20673), baseline.

    Token-level clipping in log space: with ρ_it = logp_it − sg[old_it] and σ = sign(Â_i),
    ρ̃_it = σ · min(σ ρ_it, σ clip(ρ_it, −eps_low, eps_high)); the sequence ratio is the
    geometric mean exp((1/|y_i|) Σ_t ρ̃_it) and the loss is the mean over valid rows of
    −Â_i · exp((1/|y_i|) Σ_t ρ̃_it). NOTE: eps_low/eps_high are LOG-space bounds here
    (the paper's default 0.4 means ratios in (e^-0.4, e^0.4)). Shapes: logprobs/
    old_logprobs/mask [B, T], advantages [B]. Stop-gradient: old_logprobs, advantages.
    """
    _reject_options("gmpo", options)
    b = _prepare(logprobs, old_logprobs, mask, eps_low, eps_high, beta, ref_logprobs)
    adv = _seq_advantages(advantages, b)  # Â_i [B]
    sign = torch.sign(adv)[:, None]
    rho = b.log_ratio
    rho_tilde = sign * torch.minimum(sign * rho, sign * rho.clamp(-eps_low, eps_high))
    term = -adv * _exp(_token_mean(rho_tilde, b))
    high, low = _clip_masks(rho, adv[:, None], -eps_low, eps_high)
    return _finish(term, b, adv_row=adv, high=high, low=low, beta=beta)
