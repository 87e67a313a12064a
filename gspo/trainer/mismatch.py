"""Train-inference mismatch and policy drift metrics of one step, over the global batch.

Two sources make GSPO's sequence ratio large, and they are logged apart (docs/corrections.md):

* engine mismatch ``mismatch/*``: δ_it = log π_old(y_it) − log π_rollout(y_it), the trainer's
  fp32 recompute against the engine's own log-probs at the *same* weights (nonzero for a bf16
  engine, ~1e-6 for the fp32 sampler). Per token and per sequence (the length-normalised mean
  (1/|y_i|) Σ_t δ_it, the log of GSPO's s_i normalisation, arXiv:2507.18071 v2, Eq. (7)):
  the signed mean, max |·| and the p50 / p99 of |·|; and ``mismatch/k3_kl``, the k3 estimate
  of KL(π_rollout ‖ π_old) from the engine's samples, mean_t (ρ − 1 − log ρ) with ρ = exp(δ)
  (Schulman, "Approximating KL divergence", 2020).
* policy drift ``drift/*`` (``logging.drift_every`` steps): the sequence log-ratio
  (1/|y_i|) Σ_t (log π_θ − log π_old) after the step's update, the same quantiles, and
  ``drift/engine_share`` = Σ_i |engine_i| / (Σ_i |engine_i| + Σ_i |drift_i|), the share of
  the sequences' total |log-ratio| that the engine contributes.

Each rank's values are gathered (the quantiles need them all), so these metrics are global
already and need no reduction kind. Logged on steps with a trainer π_old pass, over the
response tokens the loss sees (``rollout.mask_truncated`` leaves truncated responses out); NaN
(``null`` in metrics.jsonl, as ``train/entropy``) on a step where there are none.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gspo.objectives import LOG_RATIO_CLAMP


def _linear_quantiles(values: torch.Tensor, qs: list[float]) -> list[float]:
    """``torch.quantile(values, qs)`` (linear interpolation) of a non-empty 1-D tensor, by one
    sort: ``torch.quantile`` refuses inputs above 2**24 elements, which the token-level values
    of a large step's global batch reach (e.g. 1024 responses of 16k tokens)."""
    s = values.sort().values
    pos = torch.tensor(qs, dtype=torch.float64) * (s.numel() - 1)
    lo, hi = pos.floor().long(), pos.ceil().long()
    return torch.lerp(s[lo].double(), s[hi].double(), pos - lo).tolist()


def _quantiles(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """Signed mean, max |·|, p50 and p99 of |·| of a 1-D float64 tensor; NaN when it is empty
    (no response token the loss sees, e.g. ``rollout.mask_truncated`` with every response
    truncated: nothing was measured, which a 0 would report as no mismatch)."""
    if values.numel() == 0:
        values = torch.full((1,), math.nan, dtype=torch.float64)
    a = values.abs()
    q = _linear_quantiles(a, [0.5, 0.99])
    return {f"{prefix}_mean": float(values.mean()), f"{prefix}_abs_max": float(a.max()),
            f"{prefix}_abs_p50": q[0], f"{prefix}_abs_p99": q[1]}


def _per_seq(delta: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """(1/|y_i|) Σ_t delta_it of the rows with a response token [n_valid] float64."""
    valid = on.any(-1)
    return (torch.where(on, delta, 0.0).sum(-1) / on.sum(-1).clamp(min=1))[valid]


@torch.no_grad()  # metrics only: π_old's rows from a training forward still carry autograd
def mismatch_metrics(rollout: torch.Tensor, old: torch.Tensor | None,
                     after: torch.Tensor | None, mask: torch.Tensor, dist: Any, *,
                     before: torch.Tensor | None = None) -> dict[str, float]:
    """``mismatch/*`` from log π_rollout and the recomputed log π_old ([N, T], this rank's
    rows), and ``drift/*`` when ``after`` (log π_θ after the update) is given too; {} on a
    step without a π_old pass. ``dist``: the run's :class:`gspo.trainer.distributed.Dist`.
    ``before``: the weights the update started from, when they are not π_old's (async: π_old
    is the older behaviour policy, and the update's own drift is ``after − before``)."""
    if old is None:
        return {}
    on = mask > 0
    delta = (old.double() - rollout.double()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    tokens = dist.gather(delta[on].cpu())[0]
    engine = dist.gather(_per_seq(delta, on).cpu())[0]
    k3 = tokens.exp() - 1.0 - tokens
    out = {**_quantiles("mismatch/token_log_ratio", tokens),
           **_quantiles("mismatch/seq_log_ratio", engine),
           "mismatch/k3_kl": float(k3.mean()) if k3.numel() else math.nan}
    if after is None:
        return out
    start = old if before is None else before
    drift = dist.gather(_per_seq(after.double() - start.double(), on).cpu())[0]
    out.update(_quantiles("drift/seq_log_ratio", drift))
    e, d = float(engine.abs().sum()), float(drift.abs().sum())
    out["drift/engine_share"] = (math.nan if drift.numel() == 0 else
                                 e / (e + d) if e + d > 0 else 0.0)
    return out
