"""Policy-gradient surrogate losses: GSPO, GSPO-token, GRPO and two extra baselines.

Paper: Zheng et al., "Group Sequence Policy Optimization", arXiv:2507.18071 v2.

Every loss has the signature of :class:`gspo.objectives.registry.PolicyLossFn`::

    fn(logprobs, old_logprobs, advantages, mask, *, eps_low, eps_high,
       beta=0.0, ref_logprobs=None, <its own options>) -> (loss, stats)

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
  exp(ref - logp) - (ref - logp) - 1, aggregated like the policy term (its token mean per
  row, or Σ_t / C with ``aggregation="constant"``, then the loss's row weights; requires
  ``ref_logprobs`` [B, T]). ``objective/kl_ref`` is that aggregate.
* Options (the keyword-only arguments other than ``ref_logprobs``) are named in each
  signature; an unknown one raises ``TypeError``.

``stats`` holds detached float32 0-d tensors (see :data:`STAT_KEYS`). Beside each loss, its
rule for the weights w_i of its mean over rows is registered in
:data:`gspo.objectives.registry.ROW_WEIGHTS` (see :func:`valid_row_weights`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from gspo.objectives.loss_terms import (
    LOG_RATIO_CLAMP,
    check_aggregation,
    clip_masks,
    clipped_surrogate,
    exp_clamped,
    finish,
    prepare,
    reduce_tokens,
    seq_advantages,
    token_advantages,
    token_mean,
)
from gspo.objectives.registry import OBJECTIVES, ROW_WEIGHTS

__all__ = [
    "LOG_RATIO_CLAMP",
    "STAT_KEYS",
    "STAT_KINDS",
    "STAT_KIND_NAMES",
    "aggregation_row_weights",
    "cispo_loss",
    "gmpo_loss",
    "grpo_loss",
    "gspo_loss",
    "gspo_row_weights",
    "gspo_token_loss",
    "response_lengths",
    "valid_row_weights",
]

STAT_KEYS: tuple[str, ...] = (
    "objective/loss",
    "objective/policy_loss",
    "objective/clip_frac_tokens",
    "objective/clip_frac_tokens_low",
    "objective/clip_frac_tokens_high",
    "objective/clip_frac_seqs",
    "objective/clip_frac_seqs_low",
    "objective/clip_frac_seqs_high",
    "objective/clip_frac_tokens_signal",
    "objective/clip_frac_seqs_signal",
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

STAT_KIND_NAMES: tuple[str, ...] = ("rows", "tokens", "signal_rows", "signal_tokens", "weight",
                                    "min", "max", "std")
"""How a stat of one minibatch is a mean, which decides how its values combine across ranks:
``rows`` a mean over valid rows, ``tokens`` a mean over response tokens, ``signal_rows`` /
``signal_tokens`` the same over the rows with a non-zero advantage only, ``weight``
Σ_i w_i x_i / Σ_i w_i with the objective's row weights w_i, ``min`` / ``max`` an extreme,
``std`` a std pooled with its ``*_mean`` (see :data:`STAT_KINDS`)."""

STAT_KINDS: dict[str, str] = {
    "objective/loss": "weight",
    "objective/policy_loss": "weight",
    "objective/kl_ref": "weight",
    "objective/clip_frac_tokens": "tokens",
    "objective/clip_frac_tokens_low": "tokens",
    "objective/clip_frac_tokens_high": "tokens",
    "objective/clip_frac_seqs": "rows",
    "objective/clip_frac_seqs_low": "rows",
    "objective/clip_frac_seqs_high": "rows",
    "objective/clip_frac_tokens_signal": "signal_tokens",
    "objective/clip_frac_seqs_signal": "signal_rows",
    "objective/seq_ratio_mean": "rows",
    "objective/seq_ratio_min": "min",
    "objective/seq_ratio_max": "max",
    "objective/seq_ratio_std": "std",
    "objective/token_ratio_mean": "tokens",
    "objective/token_ratio_std": "std",
    "objective/token_log_ratio_abs_max": "max",
    "objective/approx_kl": "tokens",
    "objective/adv_mean": "rows",
}
"""Kind (one of :data:`STAT_KIND_NAMES`) of every stat a loss returns, plus
``objective/token_ratio_mean``, which :meth:`gspo.objectives.spec.Objective.loss` adds.
A ``std`` stat ``x_std`` is a population std over the same rows / tokens as ``x_mean``, which
is always present: across ranks it is pooled exactly from E[x^2] = std^2 + mean^2 (weighted
like the mean) and the global mean, sqrt(E[x^2] - mean^2)."""

_GSPO_AGGREGATIONS = ("sequence", "token")


def response_lengths(mask: Tensor) -> Tensor:
    """|y_i| [N] float32: response tokens per row (``mask > 0``)."""
    return (mask > 0).sum(-1).float()


def valid_row_weights(mask: Tensor, options: Mapping[str, Any]) -> Tensor:
    """w_i = 1 for each row with a response token, else 0 [N] float32: the plain mean over
    valid rows, the rule of every loss that registers no other (``options`` are unused)."""
    return (response_lengths(mask) > 0).float()


def aggregation_row_weights(mask: Tensor, options: Mapping[str, Any]) -> Tensor:
    """w_i of a token-level loss reduced by :func:`gspo.objectives.loss_terms.reduce_tokens`:
    |y_i| with ``aggregation="token"``, else 1 per valid row (``"sequence"``, ``"constant"``)."""
    check_aggregation(options["aggregation"], options["norm_constant"])
    if options["aggregation"] == "token":
        return response_lengths(mask)
    return valid_row_weights(mask, options)


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
    aggregation: str = "sequence",
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
    if aggregation not in _GSPO_AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {_GSPO_AGGREGATIONS}, got {aggregation!r}")
    if aggregation == "token":
        warnings.warn(
            "gspo aggregation='token' is length-weighted (sum_i |y_i| term_i / sum_i |y_i|) "
            "and is not the paper's sequence mean of arXiv:2507.18071 v2, Eq. (5)",
            stacklevel=2,
        )
    b = prepare(logprobs, old_logprobs, mask, eps_low, eps_high, beta, ref_logprobs)
    adv = seq_advantages(advantages, b)  # Â_i [B]
    s = exp_clamped(token_mean(b.log_ratio, b))  # s_i [B], Eq. (7)
    term = clipped_surrogate(s, adv, eps_low, eps_high)  # [B]
    high, low = clip_masks(s[:, None], adv[:, None], 1.0 - eps_low, 1.0 + eps_high)  # [B, T]
    weight = b.lengths if aggregation == "token" else None
    return finish(term, b, adv_row=adv, high=high, low=low, beta=beta, weight=weight)


@ROW_WEIGHTS.register("gspo")
def gspo_row_weights(mask: Tensor, options: Mapping[str, Any]) -> Tensor:
    """w_i of :func:`gspo_loss`'s mean over rows: |y_i| with ``aggregation="token"``, else 1
    per valid row."""
    if options["aggregation"] == "token":
        return response_lengths(mask)
    return valid_row_weights(mask, options)


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
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token loss, arXiv:2507.18071 v2, Eq. (13)-(14).

    s_it = sg[s_i] · π_θ(y_it) / sg[π_θ(y_it)] = exp(sg[log s_i] + logp_it − sg[logp_it])
    (Eq. (14)); per token −min(s_it Â_it, clip(s_it, 1 − eps_low, 1 + eps_high) Â_it),
    token mean per sequence (1/|y_i|), then mean over valid rows (negated Eq. (13)).
    Shapes: logprobs/old_logprobs/mask [B, T], advantages [B] (broadcast) or [B, T].
    Stop-gradient: s_i, the detached logp in the denominator, old_logprobs, advantages.
    With Â_it = Â_i its value and gradient equal :func:`gspo_loss`.
    """
    b = prepare(logprobs, old_logprobs, mask, eps_low, eps_high, beta, ref_logprobs)
    adv = token_advantages(advantages, b)  # Â_it [B, T]
    log_s = token_mean(b.log_ratio, b).detach()
    # beyond the overflow clamp gspo's s_i has zero gradient: so has s_it (equal gradients)
    inside = (log_s.abs() <= LOG_RATIO_CLAMP)[:, None]
    grad_path = torch.where(inside, b.logprobs - b.logprobs.detach(), 0.0)
    s_it = torch.exp(log_s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)[:, None] + grad_path)  # (14)
    term = token_mean(clipped_surrogate(s_it, adv, eps_low, eps_high), b)
    high, low = clip_masks(s_it, adv, 1.0 - eps_low, 1.0 + eps_high)
    return finish(term, b, adv_row=token_mean(adv, b), high=high, low=low, beta=beta)


ROW_WEIGHTS.register("gspo_token")(valid_row_weights)


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
    aggregation: str = "sequence",
    norm_constant: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO loss as written in arXiv:2507.18071 v2, Eq. (2)-(3).

    w_it = π_θ(y_it) / π_θold(y_it) = exp(logp_it − sg[old_it]) (token ratio, clamped in
    log space to [-20, 20], overflow only); per token
    −min(w_it Â_it, clip(w_it, 1 − eps_low, 1 + eps_high) Â_it), token mean per sequence
    (1/|y_i|), then mean over valid rows. Shapes: logprobs/old_logprobs/mask [B, T],
    advantages [B] (Â_it = Â_i, broadcast) or [B, T]. Stop-gradient: old_logprobs,
    advantages. A sequence counts as clipped-low/high if any of its tokens is.

    Options:
        aggregation, norm_constant: how per-token terms are reduced (see
            :func:`gspo.objectives.loss_terms.reduce_tokens`): ``"sequence"`` (default, the
            Eq. (2) above), ``"token"`` (DAPO) or ``"constant"`` with ``norm_constant`` C
            (Dr. GRPO, arXiv:2503.20783, §3.1; use it with ``scale_rewards=none``).
    """
    b = prepare(logprobs, old_logprobs, mask, eps_low, eps_high, beta, ref_logprobs)
    adv = token_advantages(advantages, b)  # Â_it [B, T]
    w = exp_clamped(b.log_ratio)  # w_it [B, T]
    term, weight = reduce_tokens(clipped_surrogate(w, adv, eps_low, eps_high), b, aggregation,
                                 norm_constant)
    high, low = clip_masks(w, adv, 1.0 - eps_low, 1.0 + eps_high)
    return finish(term, b, adv_row=token_mean(adv, b), high=high, low=low, beta=beta,
                  weight=weight, norm_constant=norm_constant)


ROW_WEIGHTS.register("grpo")(aggregation_row_weights)


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
    b = prepare(logprobs, old_logprobs, mask, eps_low, eps_high, beta, ref_logprobs)
    adv = token_advantages(advantages, b)
    w = exp_clamped(b.log_ratio).detach()
    w_hat = w.clamp(1.0 - eps_low, 1.0 + eps_high)
    term = token_mean(-(w_hat * adv * b.logprobs), b)
    high, low = w > 1.0 + eps_high, w < 1.0 - eps_low
    return finish(term, b, adv_row=token_mean(adv, b), high=high, low=low, beta=beta)


ROW_WEIGHTS.register("cispo")(valid_row_weights)


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
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO loss (Geometric-Mean Policy Optimization, arXiv:2507.20673), baseline.

    Token-level clipping in log space: with ρ_it = logp_it − sg[old_it] and σ = sign(Â_i),
    ρ̃_it = σ · min(σ ρ_it, σ clip(ρ_it, −eps_low, eps_high)); the sequence ratio is the
    geometric mean exp((1/|y_i|) Σ_t ρ̃_it) and the loss is the mean over valid rows of
    −Â_i · exp((1/|y_i|) Σ_t ρ̃_it). NOTE: eps_low/eps_high are LOG-space bounds here
    (the paper's default 0.4 means ratios in (e^-0.4, e^0.4)). Shapes: logprobs/
    old_logprobs/mask [B, T], advantages [B]. Stop-gradient: old_logprobs, advantages.
    """
    b = prepare(logprobs, old_logprobs, mask, eps_low, eps_high, beta, ref_logprobs)
    adv = seq_advantages(advantages, b)  # Â_i [B]
    sign = torch.sign(adv)[:, None]
    rho = b.log_ratio
    rho_tilde = sign * torch.minimum(sign * rho, sign * rho.clamp(-eps_low, eps_high))
    term = -adv * exp_clamped(token_mean(rho_tilde, b))
    high, low = clip_masks(rho, adv[:, None], -eps_low, eps_high)
    return finish(term, b, adv_row=adv, high=high, low=low, beta=beta)


ROW_WEIGHTS.register("gmpo")(valid_row_weights)
