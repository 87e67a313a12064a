"""Behaviour corrections for a rollout engine whose π_rollout differs from the trainer's π_old.

The engine samples y ~ π_rollout (bf16 weights, another kernel library, ...) while the loss
is written for samples of π_old. A correction turns the two policies' log-probs into a
detached, non-negative weight per token ``[B, T]`` or per sequence ``[B]``; the objective
multiplies its advantages by it (:meth:`gspo.objectives.spec.Objective.loss`). Every clipped
surrogate is positively homogeneous in Â (−min(r·wÂ, clip(r)·wÂ) = w·(−min(rÂ, clip(r)Â)) for
w ≥ 0), so this is the weighted loss term itself, with the KL term left unweighted. Two
exceptions: ``kl_cov``'s |log w| penalty is not weighted either (a zero-weight token may still
get it), and ``clip_cov`` / ``kl_cov`` select their tokens by a covariance of the weighted Â.
A weight of 0 removes the term but keeps its row in the loss's mean (the mean's
denominator is unchanged; see docs/corrections.md).

With δ_it = log π_old(y_it) − log π_rollout(y_it) (0 on padding):

* token level: ρ_it = exp(δ_it);
* sequence level: ρ_i = exp((1/|y_i|) Σ_t δ_it), the length-normalised geometric-mean
  ratio, the normalisation of GSPO's s_i (arXiv:2507.18071 v2, Eq. (7)); no further length
  normalisation is applied.

Registered (``objective.correction.name``):

* ``tis``: truncated IS, w = min(ρ, C) (Yao et al., "Your efficient RL framework secretly
  brings you off-policy RL training", 2025; verl ``rollout_is``).
* ``mis``: masked IS, w = ρ · 1[ρ ≤ C] (TRL's masked importance sampling; verl's rejection
  modes; TRL's sequence variant uses the product ratio, here the geometric mean).
* ``icepop``: two-sided mask, w = ρ · 1[α ≤ ρ ≤ β] (Ling Team, arXiv:2510.18855, IcePop,
  α = 0.5, β = 5).
* ``offpolicy_mask``: DeepSeek-V3.2's off-policy sequence masking (arXiv:2512.02556 v1,
  Sec. 3.1): w_i = 0 if Â_i < 0 and (1/|y_i|) Σ_t (log π_rollout − log π_θ) > δ, else 1.
  It compares the sampling policy with the *current* π_θ (engine mismatch and policy drift
  together), so it also works with ``objective.old_logprobs=rollout``.

Each entry is a pure function ``fn(old_logprobs, rollout_logprobs, logprobs, advantages,
mask, *, level, <options>) -> (weights, stats)`` (all inputs detached inside; stats are
detached float32 0-d tensors with the kinds of :data:`CORRECTION_STAT_KINDS`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gspo.config import ConfigError
from gspo.objectives.loss_terms import LOG_RATIO_CLAMP
from gspo.registry import Registry

__all__ = [
    "CORRECTIONS",
    "CORRECTION_STAT_KINDS",
    "LOSS_LEVELS",
    "TOKEN_FORMS",
    "BoundCorrection",
    "Correction",
    "apply_weights",
    "bind_correction",
    "icepop",
    "mis",
    "offpolicy_mask",
    "tis",
]

LOSS_LEVELS: dict[str, str] = {"gspo": "sequence", "gmpo": "sequence", "luspo": "sequence",
                               "grpo": "token", "gspo_token": "token", "cispo": "token",
                               "sapo": "token", "dppo_tv": "token", "dppo_kl": "token",
                               "clip_cov": "token", "kl_cov": "token", "gpg": "token"}
"""The level at which each objective's loss term lives: ``sequence`` losses take Â_i [B]
only, ``token`` losses Â_it [B, T]. A new objective must be listed here to take a
correction."""

TOKEN_FORMS: dict[str, str] = {"gspo": "gspo_token"}
"""A sequence-level loss's token form with equal value and gradient at Â_it = Â_i
(arXiv:2507.18071 v2, Eq. (13)-(14)): what a token-level correction of that loss runs."""

CORRECTION_STAT_KINDS: dict[str, str] = {
    "correction/token_weight_mean": "tokens",
    "correction/seq_weight_mean": "rows",
    "correction/weight_max": "max",
    "correction/beyond_frac_tokens": "tokens",
    "correction/beyond_frac_seqs": "rows",
}
"""Reduction kind (see :data:`gspo.objectives.STAT_KIND_NAMES`) of every correction stat.
``beyond``: tokens / sequences past the correction's threshold(s) (truncated or masked)."""

LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class Correction:
    """A registered correction: the function, the levels it works at and whether it compares
    π_old with π_rollout (then ``old_logprobs=rollout``, where they are equal, is an error)."""

    fn: Callable[..., tuple[Tensor, dict[str, Tensor]]]
    levels: tuple[str, ...]
    options: tuple[str, ...]
    compares_old: bool = True

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Tensor, dict[str, Tensor]]:
        return self.fn(*args, **kwargs)


CORRECTIONS: Registry[Correction] = Registry("correction")


def _register(name: str, levels: tuple[str, ...], options: tuple[str, ...],
              compares_old: bool = True) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        CORRECTIONS.register(name)(Correction(fn, levels, options, compares_old))
        return fn
    return deco


# --------------------------------------------------------------------------- building blocks
def _log_rho(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, level: str
             ) -> tuple[Tensor, Tensor, Tensor]:
    """(log ρ at ``level`` — [B, T] or [B] —, the bool mask [B, T], valid rows [B])."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if old_logprobs.shape != mask.shape or rollout_logprobs.shape != mask.shape:
        raise ValueError(f"old/rollout log-probs {tuple(old_logprobs.shape)}, "
                         f"{tuple(rollout_logprobs.shape)} must match mask {tuple(mask.shape)}")
    m = mask > 0
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    delta = torch.where(m, old_logprobs.detach().to(dtype) - rollout_logprobs.detach().to(dtype),
                        0.0)
    valid = m.any(-1)
    if level == "token":
        return delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), m, valid
    seq = delta.sum(-1) / m.sum(-1).clamp(min=1)
    return seq.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), m, valid


def _stats(w: Tensor, beyond: Tensor, m: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """The stats of :data:`CORRECTION_STAT_KINDS` for weights / beyond flags at either level."""
    tok_w = w if w.dim() == 2 else w[:, None].expand_as(m)
    tok_b = beyond if beyond.dim() == 2 else beyond[:, None].expand_as(m)
    n_tok, n_row = m.sum().clamp(min=1), valid.sum().clamp(min=1)
    row_w = torch.where(m, tok_w, 0.0).sum(-1) / m.sum(-1).clamp(min=1)
    flat = torch.where(m, tok_w, 0.0)
    out = {
        "correction/token_weight_mean": torch.where(m, tok_w, 0.0).sum() / n_tok,
        "correction/seq_weight_mean": torch.where(valid, row_w, 0.0).sum() / n_row,
        "correction/weight_max": flat.max() if flat.numel() else flat.new_zeros(()),
        "correction/beyond_frac_tokens": (tok_b & m).sum() / n_tok,
        "correction/beyond_frac_seqs": ((tok_b & m).any(-1) & valid).sum() / n_row,
    }
    return {k: v.detach().to(torch.float32) for k, v in out.items()}


def _finish(w: Tensor, beyond: Tensor, m: Tensor, valid: Tensor
            ) -> tuple[Tensor, dict[str, Tensor]]:
    """Zero the weight on padding / empty rows; the stats."""
    w = torch.where(m, w, 0.0) if w.dim() == 2 else torch.where(valid, w, 0.0)
    return w.detach(), _stats(w, beyond, m, valid)


# --------------------------------------------------------------------------- corrections
@_register("tis", LEVELS, ("cap",))
def tis(old_logprobs: Tensor, rollout_logprobs: Tensor, logprobs: Tensor, advantages: Tensor,
        mask: Tensor, *, level: str, cap: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated IS: w = min(ρ, C), ρ = π_old / π_rollout per token or the geometric mean per
    sequence (module docstring). Shapes: log-probs/mask [B, T], advantages [B]; returns
    weights [B, T] (token) or [B] (sequence), detached. ``logprobs``/``advantages`` unused."""
    log_rho, m, valid = _log_rho(old_logprobs, rollout_logprobs, mask, level)
    rho = log_rho.exp()
    return _finish(rho.clamp(max=cap), rho > cap, m, valid)


@_register("mis", LEVELS, ("cap",))
def mis(old_logprobs: Tensor, rollout_logprobs: Tensor, logprobs: Tensor, advantages: Tensor,
        mask: Tensor, *, level: str, cap: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked IS: w = ρ · 1[ρ ≤ C]: a token / sequence whose ratio exceeds C is dropped
    rather than truncated. Shapes and outputs as :func:`tis`."""
    log_rho, m, valid = _log_rho(old_logprobs, rollout_logprobs, mask, level)
    rho = log_rho.exp()
    beyond = rho > cap
    return _finish(torch.where(beyond, 0.0, rho), beyond, m, valid)


@_register("icepop", LEVELS, ("low", "high"))
def icepop(old_logprobs: Tensor, rollout_logprobs: Tensor, logprobs: Tensor,
           advantages: Tensor, mask: Tensor, *, level: str, low: float, high: float
           ) -> tuple[Tensor, dict[str, Tensor]]:
    """IcePop (arXiv:2510.18855): w = ρ · 1[α ≤ ρ ≤ β], α = ``low``, β = ``high``; the
    sequence level applies the band to the geometric-mean ratio. Shapes as :func:`tis`."""
    log_rho, m, valid = _log_rho(old_logprobs, rollout_logprobs, mask, level)
    rho = log_rho.exp()
    beyond = (rho < low) | (rho > high)
    return _finish(torch.where(beyond, 0.0, rho), beyond, m, valid)


@_register("offpolicy_mask", ("sequence",), ("delta",), compares_old=False)
def offpolicy_mask(old_logprobs: Tensor, rollout_logprobs: Tensor, logprobs: Tensor,
                   advantages: Tensor, mask: Tensor, *, level: str, delta: float
                   ) -> tuple[Tensor, dict[str, Tensor]]:
    """DeepSeek-V3.2 off-policy sequence masking (arXiv:2512.02556 v1, Sec. 3.1):
    w_i = 0 if Â_i < 0 and (1/|y_i|) Σ_t (log π_rollout(y_it) − sg[log π_θ(y_it)]) > δ, else 1.
    Shapes: log-probs/mask [B, T], advantages [B]; returns [B]. ``old_logprobs`` unused."""
    if level != "sequence":
        raise ValueError("offpolicy_mask works at sequence level only")
    log_r, m, valid = _log_rho(rollout_logprobs, logprobs, mask, "sequence")  # the KL estimate
    adv = advantages.detach()
    if adv.dim() == 2:
        adv = torch.where(m, adv, 0.0).sum(-1) / m.sum(-1).clamp(min=1)
    beyond = (adv < 0) & (log_r > delta)
    return _finish((~beyond).to(log_r.dtype), beyond, m, valid)


# --------------------------------------------------------------------------- binding
@dataclass(frozen=True)
class BoundCorrection:
    """A registered correction with its level resolved and its options bound.

    ``via``: the objective whose function the corrected loss runs (its own, or the token form
    of a sequence-level loss, :data:`TOKEN_FORMS`, for a token-level correction of it).
    """

    name: str
    level: str
    via: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def compares_old(self) -> bool:
        return CORRECTIONS[self.name].compares_old

    def weights(self, old_logprobs: Tensor, rollout_logprobs: Tensor, logprobs: Tensor,
                advantages: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The registered function's detached weights and stats."""
        return CORRECTIONS[self.name](old_logprobs, rollout_logprobs, logprobs.detach(),
                                      advantages, mask, level=self.level, **self.options)


def apply_weights(advantages: Tensor, weights: Tensor) -> Tensor:
    """Â · w: [B]·[B] -> [B]; [B]·[B, T] or [B, T]·[B, T] -> [B, T]; [B, T]·[B] -> [B, T]."""
    if weights.dim() == 1:
        return advantages * (weights if advantages.dim() == 1 else weights[:, None])
    return (advantages[:, None] if advantages.dim() == 1 else advantages) * weights


def _check_values(name: str, options: Mapping[str, Any]) -> None:
    if "cap" in options and not options["cap"] >= 1.0:
        raise ConfigError(f"objective.correction.cap must be >= 1 (got {options['cap']}): "
                          "a cap below 1 would down-weight tokens without any mismatch")
    if "low" in options and not 0.0 <= options["low"] <= 1.0 <= options["high"]:
        raise ConfigError("objective.correction.low/high must satisfy 0 <= low <= 1 <= high "
                          f"(got {options['low']}, {options['high']})")
    if "delta" in options and not options["delta"] >= 0.0:
        raise ConfigError(f"objective.correction.delta must be >= 0 (got {options['delta']})")


def bind_correction(values: Mapping[str, Any], defaults: Mapping[str, Any], *,
                    objective: str, objective_options: Mapping[str, Any],
                    old_logprobs: str) -> BoundCorrection | None:
    """The ``objective.correction`` section bound for ``objective``; None for ``name=none``.

    ``values`` / ``defaults``: the section's fields (``dataclasses.asdict``) and those of a
    default section. An option the chosen correction does not use, set away from its default,
    a correction without π_rollout to compare (``old_logprobs=recompute``), a comparison of
    π_old with itself (``old_logprobs=rollout``), ``decoupled`` without a correction, or a
    level the correction / loss cannot take is a one-line :class:`ConfigError`.
    """
    name = values["name"]
    changed = sorted(k for k in values if k != "name" and values[k] != defaults[k])
    if name == "none":
        if changed:
            raise ConfigError(f"objective.correction.{changed[0]} is set but "
                              "objective.correction.name=none")
        if old_logprobs == "decoupled":
            raise ConfigError("objective.old_logprobs=decoupled uses π_rollout only in a "
                              "behaviour correction: set objective.correction.name")
        return None
    entry = CORRECTIONS[name]  # an unknown name lists the valid ones
    unused = [k for k in changed if k != "level" and k not in entry.options]
    if unused:
        raise ConfigError(f"objective.correction.{unused[0]}={values[unused[0]]!r}: correction "
                          f"{name!r} does not take this option (its options: "
                          f"{', '.join(('level', *entry.options))})")
    if old_logprobs == "recompute":
        raise ConfigError(f"objective.correction.name={name} needs π_rollout in the loss: set "
                          "objective.old_logprobs=decoupled (π_old recomputed for the clip "
                          "ratio, π_rollout in the correction)")
    if old_logprobs == "rollout" and entry.compares_old:
        raise ConfigError(f"objective.correction.name={name} compares π_old with π_rollout, "
                          "which objective.old_logprobs=rollout makes equal (every weight 1); "
                          "use objective.old_logprobs=decoupled")
    if objective not in LOSS_LEVELS:
        raise ConfigError(f"objective {objective!r} declares no level for corrections "
                          "(gspo.objectives.corrections.LOSS_LEVELS)")
    loss_level = LOSS_LEVELS[objective]
    level = values["level"]
    if level == "auto":
        level = loss_level if loss_level in entry.levels else entry.levels[0]
    if level not in entry.levels:
        raise ConfigError(f"objective.correction.level={level}: correction {name!r} works at "
                          f"{' or '.join(entry.levels)} level")
    via = objective
    if level == "token" and loss_level == "sequence":
        if values["level"] != "token":  # reached only by an explicit ask
            raise ConfigError(f"correction {name!r} is token-level and objective {objective!r} "
                              "sequence-level: set objective.correction.level=token explicitly")
        if objective not in TOKEN_FORMS:
            raise ConfigError(f"objective {objective!r} has no token form for a token-level "
                              "correction; use objective.correction.level=sequence")
        if objective_options.get("aggregation", "sequence") != "sequence":
            raise ConfigError("objective.correction.level=token on gspo needs "
                              "objective.aggregation=sequence")
        via = TOKEN_FORMS[objective]
        warnings.warn(f"token-level correction {name!r} on the sequence-level loss "
                      f"{objective!r}: each token's gradient gets its own weight (run through "
                      f"{via}'s per-token form); the sequence ratio is no longer reweighted as "
                      "a whole", stacklevel=2)
    options = {k: values[k] for k in entry.options}
    _check_values(name, options)
    return BoundCorrection(name, level, via, options)
