"""The rest of the policy-optimisation family: SAPO, LUSPO, DPPO, Clip-/KL-Cov and GPG.

Every loss has the signature and the conventions of :mod:`gspo.objectives.policy_losses`
(shapes, padding, float32 compute, the [-20, 20] overflow clamp of log-ratios, the k3
``beta`` penalty, valid rows); each takes only the options it uses, so a config field for
another loss is a :class:`gspo.config.ConfigError` at bind time. Notation: w_it =
π_θ(y_it)/π_θold(y_it) = exp(logp_it − sg[old_it]) the token ratio [B, T], s_i the GSPO
sequence ratio [B], Â_it the advantage ([B] broadcast over t, or [B, T]), |y_i| the length.
Stop-gradient everywhere: old_logprobs, advantages, ref_logprobs, and what each docstring
marks sg[.].

Token-level losses that take ``aggregation`` / ``norm_constant`` reduce their per-token
terms with :func:`gspo.objectives.loss_terms.reduce_tokens` ("sequence" default, "token",
"constant" = Dr. GRPO). Stats beyond :data:`gspo.objectives.policy_losses.STAT_KINDS` are
declared in :data:`gspo.objectives.registry.EXTRA_STAT_KINDS`.

Equation numbers: where the stored excerpts of a paper did not show its numbering, the
docstring names the section or the objective instead of guessing a number.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from gspo.objectives.loss_terms import (
    LossBatch,
    clip_masks,
    clipped_surrogate,
    exp_clamped,
    finish,
    prepare,
    reduce_tokens,
    seq_advantages,
    token_advantages,
    token_mean,
    token_share,
)
from gspo.objectives.policy_losses import aggregation_row_weights, response_lengths
from gspo.objectives.registry import EXTRA_STAT_KINDS, OBJECTIVES, OPTION_CHECKS, ROW_WEIGHTS

__all__ = [
    "binary_kl",
    "clip_cov_loss",
    "dppo_kl_loss",
    "dppo_tv_loss",
    "gpg_loss",
    "kl_cov_loss",
    "luspo_loss",
    "sapo_loss",
    "token_covariance",
]

_Out = tuple[Tensor, dict[str, Tensor]]


def _no_clip(b: LossBatch) -> Tensor:
    return torch.zeros_like(b.mask)


def _old_logprobs(b: LossBatch) -> Tensor:
    """sg[log π_θold] [B, T] (0 on padding), recovered from the sanitised batch."""
    return (b.logprobs - b.log_ratio).detach()


def _positive(name: str, value: float) -> None:
    if not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _share(name: str, value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"{name} must be a share of the response tokens in (0, 1], "
                         f"got {value!r}")


# --------------------------------------------------------------------------- SAPO


@OBJECTIVES.register("sapo")
def sapo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
              tau_pos: float = 1.0, tau_neg: float = 1.05, beta: float = 0.0,
              ref_logprobs: Tensor | None = None, aggregation: str = "sequence",
              norm_constant: float = 0.0) -> _Out:
    """SAPO loss (Soft Adaptive Policy Optimization), arXiv:2511.20347 v1, §3 (the SAPO
    objective and its gate).

    Per token the hard clip is replaced by the soft gate
    f_it = (4/τ_it) · σ(τ_it (w_it − 1)), τ_it = τ_pos if Â_it > 0 else τ_neg,
    and the loss is −f_it · Â_it, reduced by ``aggregation`` (the paper's is "sequence",
    1/G Σ_i 1/|y_i| Σ_t). Its gradient is −Â_it · g_it · w_it ∇logp_it with the gate weight
    g_it = 4 σ(1 − σ) ∈ (0, 1], which is 1 on-policy (w = 1: plain policy gradient) and decays
    smoothly as w leaves 1, faster for larger τ (τ_neg > τ_pos damps negative updates more).
    Limits: τ → 0 gives g → 1, the unclipped token-IS gradient; τ → ∞ gives g → 0 off-policy.
    Shapes: logprobs/old_logprobs/mask [B, T], advantages [B] or [B, T]. Stop-gradient:
    old_logprobs, advantages, τ. No hard clip: the clip stats are 0; ``objective/gate_weight_
    mean``/``_min`` report g over response tokens.
    """
    _check_sapo(tau_pos=tau_pos, tau_neg=tau_neg)
    b = prepare(logprobs, old_logprobs, mask, 0.0, 0.0, beta, ref_logprobs)
    adv = token_advantages(advantages, b)  # Â_it [B, T]
    w = exp_clamped(b.log_ratio)  # w_it [B, T]
    tau = torch.where(adv > 0, adv.new_tensor(tau_pos), adv.new_tensor(tau_neg))
    gate = torch.sigmoid(tau * (w - 1.0))  # σ(τ (w − 1))
    term, weight = reduce_tokens(-(4.0 / tau) * gate * adv, b, aggregation, norm_constant)
    loss, stats = finish(term, b, adv_row=token_mean(adv, b), high=_no_clip(b),
                         low=_no_clip(b), beta=beta, weight=weight,
                         norm_constant=norm_constant)
    g = (4.0 * gate * (1.0 - gate)).detach()
    on = b.mask.sum() > 0
    stats["objective/gate_weight_mean"] = (torch.where(b.mask, g, 0.0).sum()
                                           / b.mask.sum().clamp(min=1)).float()
    stats["objective/gate_weight_min"] = torch.where(
        on, torch.where(b.mask, g, torch.inf).min(), 0.0).float()
    return loss, stats


@OPTION_CHECKS.register("sapo")
def _check_sapo(*, tau_pos: float, tau_neg: float, **_: Any) -> None:
    _positive("tau_pos", tau_pos)
    _positive("tau_neg", tau_neg)


ROW_WEIGHTS.register("sapo")(aggregation_row_weights)
EXTRA_STAT_KINDS.register("sapo")(
    lambda: {"objective/gate_weight_mean": "tokens", "objective/gate_weight_min": "min"})


# --------------------------------------------------------------------------- LUSPO


@OBJECTIVES.register("luspo")
def luspo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
               eps_low: float, eps_high: float, beta: float = 0.0,
               ref_logprobs: Tensor | None = None) -> _Out:
    """LUSPO loss (Length-Unbiased Sequence Policy Optimization), arXiv:2602.05261 v1, §4
    (the LUSPO objective): GSPO's sequence term scaled by the response's own length.

    loss = (1/|valid|) Σ_i |y_i| · −min(s_i Â_i, clip(s_i, 1 − eps_low, 1 + eps_high) Â_i),
    s_i = exp((1/|y_i|) Σ_t (logp_it − sg[old_it])) as in GSPO (arXiv:2507.18071 v2, Eq. (7)).
    Each row is weighted by |y_i| exactly once: a per-token copy of the sequence term summed
    over t and then multiplied by |y_i| again would weight rows by |y_i|² (the quadratic
    length bias fixed in TRL PR #6654). At equal lengths L it is L × GSPO (value and
    gradient); in general it is mean_i |y_i| × GSPO with ``aggregation="token"``.
    Shapes: logprobs/old_logprobs/mask [B, T], advantages [B]. Stop-gradient: old_logprobs,
    advantages, |y_i|.
    """
    b = prepare(logprobs, old_logprobs, mask, eps_low, eps_high, beta, ref_logprobs)
    adv = seq_advantages(advantages, b)  # Â_i [B]
    s = exp_clamped(token_mean(b.log_ratio, b))  # s_i [B]
    term = b.lengths * clipped_surrogate(s, adv, eps_low, eps_high)
    high, low = clip_masks(s[:, None], adv[:, None], 1.0 - eps_low, 1.0 + eps_high)
    return finish(term, b, adv_row=adv, high=high, low=low, beta=beta)


# --------------------------------------------------------------------------- DPPO


def _dppo(b: LossBatch, adv: Tensor, keep: Tensor, ratio_cap: float, beta: float,
          aggregation: str, norm_constant: float) -> _Out:
    """Shared DPPO surrogate: per token −sg[keep] · Â · w · sg[min(w, cap) / w]
    (value min(w, cap) Â, gradient min(w, cap) Â ∇logp), reduced by ``aggregation``."""
    w = exp_clamped(b.log_ratio)
    w_sg = w.detach()
    truncated = w * (w_sg.clamp(max=ratio_cap) / w_sg)  # truncated IS, arXiv:2602.04879 §5.4
    keep = keep.detach()
    per_token = torch.where(keep, -(truncated * adv), 0.0)
    term, weight = reduce_tokens(per_token, b, aggregation, norm_constant)
    high, low = (adv > 0) & ~keep, (adv < 0) & ~keep  # masked out, by side
    loss, stats = finish(term, b, adv_row=token_mean(adv, b), high=high, low=low, beta=beta,
                         weight=weight, norm_constant=norm_constant)
    stats["objective/ratio_capped_frac_tokens"] = token_share(w_sg > ratio_cap, b)
    return loss, stats


@OBJECTIVES.register("dppo_tv")
def dppo_tv_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                 tv_delta_low: float = 0.15, tv_delta_high: float = 0.15,
                 ratio_cap: float = 20.0, beta: float = 0.0,
                 ref_logprobs: Tensor | None = None, aggregation: str = "sequence",
                 norm_constant: float = 0.0) -> _Out:
    """DPPO-Binary-TV loss (Divergence PPO), arXiv:2602.04879 v1, §4 (binary TV trust region).

    The ratio clip is replaced by a mask on the sampled token's probability change
    Δ_it = π_θ(y_it) − π_θold(y_it) (detached): a token keeps its gradient unless it has
    already moved too far in the direction its advantage pushes, i.e.
    keep = (Δ ≤ δ_high) for Â > 0 and keep = (Δ ≥ −δ_low) for Â ≤ 0.
    Per token −keep · min(w_it, cap) · Â_it with gradient min(w, cap) Â ∇logp (the truncated
    importance weight of §5.4; cap = ``ratio_cap``), reduced by ``aggregation``.
    Shapes: logprobs/old_logprobs/mask [B, T], advantages [B] or [B, T]. Stop-gradient: the
    mask, the truncation factor, old_logprobs, advantages. Clip stats count masked tokens
    (high: Â > 0, low: Â < 0). Defaults δ = 0.15 (the paper's verl recipe).
    """
    _check_dppo_tv(tv_delta_low=tv_delta_low, tv_delta_high=tv_delta_high, ratio_cap=ratio_cap)
    b = prepare(logprobs, old_logprobs, mask, 0.0, 0.0, beta, ref_logprobs)
    adv = token_advantages(advantages, b)
    delta = b.logprobs.detach().exp() - _old_logprobs(b).exp()  # Δ_it [B, T]
    keep = torch.where(adv > 0, delta <= tv_delta_high, delta >= -tv_delta_low)
    return _dppo(b, adv, keep, ratio_cap, beta, aggregation, norm_constant)


def binary_kl(old_logprobs: Tensor, logprobs: Tensor) -> Tensor:
    """KL(Bern(p_old) ‖ Bern(p)) elementwise from log-probabilities (detached, ≥ 0; +inf where
    p hits 0 or 1 but p_old does not): p_old log(p_old/p) + (1−p_old) log((1−p_old)/(1−p))."""
    p_old, p = old_logprobs.detach().exp(), logprobs.detach().exp()
    q_old, q = 1.0 - p_old, 1.0 - p
    return (torch.xlogy(p_old, p_old) - torch.xlogy(p_old, p)
            + torch.xlogy(q_old, q_old) - torch.xlogy(q_old, q))


@OBJECTIVES.register("dppo_kl")
def dppo_kl_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                 kl_delta_low: float = 0.05, kl_delta_high: float = 0.05,
                 ratio_cap: float = 20.0, beta: float = 0.0,
                 ref_logprobs: Tensor | None = None, aggregation: str = "sequence",
                 norm_constant: float = 0.0) -> _Out:
    """DPPO-Binary-KL loss (Divergence PPO), arXiv:2602.04879 v1, §4 (binary KL trust region).

    As :func:`dppo_tv_loss` with the divergence D_it = KL(Bern(π_θold(y_it)) ‖
    Bern(π_θ(y_it))) (:func:`binary_kl`, detached) and a mask that only binds in the
    advantage's direction: keep = (D ≤ δ_high) or (π ≤ π_old) for Â > 0, keep = (D ≤ δ_low)
    or (π ≥ π_old) for Â ≤ 0. Defaults δ = 0.05 (the paper's verl recipe).
    """
    _check_dppo_kl(kl_delta_low=kl_delta_low, kl_delta_high=kl_delta_high, ratio_cap=ratio_cap)
    b = prepare(logprobs, old_logprobs, mask, 0.0, 0.0, beta, ref_logprobs)
    adv = token_advantages(advantages, b)
    old = _old_logprobs(b)
    div = binary_kl(old, b.logprobs)
    rose = b.log_ratio.detach() >= 0
    fell = b.log_ratio.detach() <= 0
    keep = torch.where(adv > 0, (div <= kl_delta_high) | fell, (div <= kl_delta_low) | rose)
    return _dppo(b, adv, keep, ratio_cap, beta, aggregation, norm_constant)


@OPTION_CHECKS.register("dppo_tv")
def _check_dppo_tv(*, tv_delta_low: float, tv_delta_high: float, ratio_cap: float,
                   **_: Any) -> None:
    for name, v in (("tv_delta_low", tv_delta_low), ("tv_delta_high", tv_delta_high),
                    ("ratio_cap", ratio_cap)):
        _positive(name, v)


@OPTION_CHECKS.register("dppo_kl")
def _check_dppo_kl(*, kl_delta_low: float, kl_delta_high: float, ratio_cap: float,
                   **_: Any) -> None:
    for name, v in (("kl_delta_low", kl_delta_low), ("kl_delta_high", kl_delta_high),
                    ("ratio_cap", ratio_cap)):
        _positive(name, v)


for _name in ("dppo_tv", "dppo_kl"):
    ROW_WEIGHTS.register(_name)(aggregation_row_weights)
    EXTRA_STAT_KINDS.register(_name)(lambda: {"objective/ratio_capped_frac_tokens": "tokens"})


# --------------------------------------------------------------------------- Clip-Cov, KL-Cov


def token_covariance(adv: Tensor, b: LossBatch) -> Tensor:
    """Cov_it = (Â_it − mean Â) · (logp_it − mean logp) [B, T] (detached), the centred
    product whose batch mean is the covariance of arXiv:2505.22617 v1, §4 (means over the
    response tokens of the minibatch); 0 on padding."""
    n = b.mask.sum().clamp(min=1)
    logp = b.logprobs.detach()
    a_c = adv - torch.where(b.mask, adv, 0.0).sum() / n
    l_c = logp - torch.where(b.mask, logp, 0.0).sum() / n
    return torch.where(b.mask, a_c * l_c, 0.0)


def _count(ratio: float, b: LossBatch) -> int:
    """max(⌊ratio · N⌋, 1) tokens of the N response tokens (0 when N = 0)."""
    n = int(b.mask.sum())
    return 0 if n == 0 else max(int(ratio * n), 1)


def _flat_select(b: LossBatch, index: Tensor) -> Tensor:
    sel = torch.zeros(b.mask.numel(), dtype=torch.bool, device=b.mask.device)
    sel[index] = True
    return sel.view_as(b.mask)


@OBJECTIVES.register("clip_cov")
def clip_cov_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                  eps_low: float, eps_high: float, clip_cov_ratio: float = 2e-4,
                  clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0, beta: float = 0.0,
                  ref_logprobs: Tensor | None = None, aggregation: str = "sequence",
                  norm_constant: float = 0.0) -> _Out:
    """Clip-Cov loss, arXiv:2505.22617 v1, §4 (Clip-Cov).

    The PPO/GRPO clipped token term −min(w Â, clip(w, 1 − eps_low, 1 + eps_high) Â), where,
    among the tokens that the ratio clip leaves active and whose covariance
    (:func:`token_covariance`) lies in (lb, ub), ⌊ratio · N⌋ (at least 1) chosen at random
    have their gradient detached (their value stays). The choice uses a fixed-seed
    generator, so it is a function of the minibatch alone (reproducible, resume-exact).
    Reduced by ``aggregation``. Covariance means and the count run over the minibatch this
    call sees (under several processes: each rank's rows). Shapes as in GRPO.
    Stop-gradient: old_logprobs, advantages, the selected tokens' terms.
    ``objective/cov_detached_frac_tokens``: share of tokens detached.
    """
    _check_clip_cov(clip_cov_ratio=clip_cov_ratio, clip_cov_lb=clip_cov_lb,
                    clip_cov_ub=clip_cov_ub)
    b = prepare(logprobs, old_logprobs, mask, eps_low, eps_high, beta, ref_logprobs)
    adv = token_advantages(advantages, b)
    w = exp_clamped(b.log_ratio)
    per_token = clipped_surrogate(w, adv, eps_low, eps_high)
    high, low = clip_masks(w, adv, 1.0 - eps_low, 1.0 + eps_high)
    cov = token_covariance(adv, b)
    cand = b.mask & ~(high | low) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    index = cand.flatten().nonzero().squeeze(-1)
    pick = torch.randperm(index.numel(), generator=torch.Generator().manual_seed(0))
    chosen = _flat_select(b, index[pick[: _count(clip_cov_ratio, b)].to(index.device)])
    per_token = torch.where(chosen, per_token.detach(), per_token)
    term, weight = reduce_tokens(per_token, b, aggregation, norm_constant)
    loss, stats = finish(term, b, adv_row=token_mean(adv, b), high=high, low=low, beta=beta,
                         weight=weight, norm_constant=norm_constant)
    stats["objective/cov_detached_frac_tokens"] = token_share(chosen, b)
    return loss, stats


@OBJECTIVES.register("kl_cov")
def kl_cov_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                kl_cov_ratio: float = 2e-4, kl_cov_coef: float = 1.0, beta: float = 0.0,
                ref_logprobs: Tensor | None = None, aggregation: str = "sequence",
                norm_constant: float = 0.0) -> _Out:
    """KL-Cov loss, arXiv:2505.22617 v1, §4 (KL-Cov).

    The unclipped token term −w_it Â_it, plus kl_cov_coef · |log w_it| on the ⌊ratio · N⌋
    (at least 1) response tokens with the largest covariance (:func:`token_covariance`),
    reduced by ``aggregation``. Covariance and the count run over the minibatch this call
    sees. Shapes as in GRPO. Stop-gradient: old_logprobs, advantages, the selection.
    No ratio clip (clip stats 0); ``objective/kl_cov_frac_tokens``: share penalised.
    """
    _check_kl_cov(kl_cov_ratio=kl_cov_ratio, kl_cov_coef=kl_cov_coef)
    b = prepare(logprobs, old_logprobs, mask, 0.0, 0.0, beta, ref_logprobs)
    adv = token_advantages(advantages, b)
    w = exp_clamped(b.log_ratio)
    cov = torch.where(b.mask, token_covariance(adv, b), -torch.inf)
    k = _count(kl_cov_ratio, b)
    chosen = _flat_select(b, cov.flatten().topk(k).indices if k else cov.new_zeros(0).long())
    per_token = -(w * adv) + torch.where(chosen, kl_cov_coef * b.log_ratio.abs(), 0.0)
    term, weight = reduce_tokens(per_token, b, aggregation, norm_constant)
    loss, stats = finish(term, b, adv_row=token_mean(adv, b), high=_no_clip(b),
                         low=_no_clip(b), beta=beta, weight=weight,
                         norm_constant=norm_constant)
    stats["objective/kl_cov_frac_tokens"] = token_share(chosen, b)
    return loss, stats


@OPTION_CHECKS.register("clip_cov")
def _check_clip_cov(*, clip_cov_ratio: float, clip_cov_lb: float, clip_cov_ub: float,
                    **_: Any) -> None:
    _share("clip_cov_ratio", clip_cov_ratio)
    if not clip_cov_lb < clip_cov_ub:
        raise ValueError(f"clip_cov_lb must be < clip_cov_ub, got {clip_cov_lb}, {clip_cov_ub}")


@OPTION_CHECKS.register("kl_cov")
def _check_kl_cov(*, kl_cov_ratio: float, kl_cov_coef: float, **_: Any) -> None:
    _share("kl_cov_ratio", kl_cov_ratio)
    if not 0 <= kl_cov_coef < float("inf"):
        raise ValueError(f"kl_cov_coef must be a finite number >= 0, got {kl_cov_coef!r}")


for _name in ("clip_cov", "kl_cov"):
    ROW_WEIGHTS.register(_name)(aggregation_row_weights)
EXTRA_STAT_KINDS.register("clip_cov")(lambda: {"objective/cov_detached_frac_tokens": "tokens"})
EXTRA_STAT_KINDS.register("kl_cov")(lambda: {"objective/kl_cov_frac_tokens": "tokens"})


# --------------------------------------------------------------------------- GPG


@OBJECTIVES.register("gpg")
def gpg_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
             beta: float = 0.0, ref_logprobs: Tensor | None = None) -> _Out:
    """GPG loss (Group Policy Gradient), arXiv:2504.02546 v1, §3 (the GPG objective).

    Plain policy gradient with no ratio and no clip, averaged over all response tokens:
    loss = −Σ_i Σ_t Â_it logp_it / Σ_i |y_i| (the paper's token normaliser; not
    configurable). Only the gradient −Â ∇logp is meaningful; the value contains logp itself.
    old_logprobs only feed the ratio stats. GPG's batch-level advantage correction is an
    advantage estimator matter and not part of this loss. Shapes as in GRPO.
    Stop-gradient: advantages.
    """
    b = prepare(logprobs, old_logprobs, mask, 0.0, 0.0, beta, ref_logprobs)
    adv = token_advantages(advantages, b)
    term = token_mean(-(adv * b.logprobs), b)
    return finish(term, b, adv_row=token_mean(adv, b), high=_no_clip(b), low=_no_clip(b),
                  beta=beta, weight=b.lengths)


@ROW_WEIGHTS.register("gpg")
def gpg_row_weights(mask: Tensor, options: Mapping[str, Any]) -> Tensor:
    """w_i = |y_i| of :func:`gpg_loss`'s token mean."""
    return response_lengths(mask)
