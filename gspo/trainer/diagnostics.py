"""GSPO diagnostics over a whole step: quantiles of the per-sequence ratio and the clip fraction
by response-length bucket (``diag/*`` in ``metrics.jsonl``).

Both are computed on the whole step's rows, not per minibatch: quantiles cannot be averaged
over minibatches or ranks, so :class:`StepDiagnostics` keeps every row's value and reduces once
(under ``torch.distributed`` by gathering the rows, and summing the bucket counts).

* ``diag/seq_ratio_p01`` … ``p99``: quantiles of s_i = exp((1/|y_i|) Σ_t log w_it)
  (arXiv:2507.18071 v2, Eq. (7)) over every (minibatch step, row) of the step, as each
  minibatch's loss saw it (before its own optimizer step; the first minibatch of the first
  epoch runs at θ = θ_old, so its rows sit at exactly 1).
* ``diag/clip_frac_len_q1`` … ``q4``: clipped-token fraction among responses whose length (the
  policy's tokens) is in the first … last quarter of the most the policy can sample,
  ``rollout.max_new_tokens`` × ``rollout.max_turns`` (single-turn: q4 holds the truncated
  ones). Each
  bucket's rows are passed through the objective itself, so "clipped" means what the
  objective's ``objective/clip_frac_tokens`` means (for objectives whose clipping depends on
  the whole batch, such as covariance-selected tokens, it is the bucket's own selection).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor

__all__ = ["BUCKETS", "QUANTILES", "StepDiagnostics"]

QUANTILES: tuple[tuple[str, float], ...] = (
    ("p01", 0.01), ("p10", 0.10), ("p50", 0.50), ("p90", 0.90), ("p99", 0.99))
BUCKETS = 4  # length quarters of the policy's token cap


class StepDiagnostics:
    """Collect rows over a step's minibatch steps (:meth:`observe`), reduce once
    (:meth:`metrics`). ``objective``: the step's :class:`gspo.objectives.Objective`;
    ``max_new_tokens``: the most tokens the policy samples in one response (its turns'
    caps summed in a multi-turn episode), the span the length buckets divide."""

    def __init__(self, objective: Any, max_new_tokens: int) -> None:
        self.objective, self.max_new_tokens = objective, max_new_tokens
        self.log_s: list[Tensor] = []
        self.clipped = torch.zeros(BUCKETS, dtype=torch.float64)
        self.tokens = torch.zeros(BUCKETS, dtype=torch.float64)

    @torch.no_grad()
    def observe(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                ref_logprobs: Tensor | None = None,
                rollout_logprobs: Tensor | None = None) -> None:
        """One minibatch step's rows: log π_θ, log π_old, Â, response mask (all [B, T] but Â),
        and where the objective has them log π_ref and the behaviour policy's log π_rollout."""
        on = mask > 0
        lengths = on.sum(-1)
        valid = lengths > 0
        log_w = torch.where(on, logprobs.detach().double() - old_logprobs.double(), 0.0)
        self.log_s.append((log_w.sum(-1) / lengths.clamp(min=1))[valid].cpu())
        bucket = ((lengths.double() * BUCKETS / self.max_new_tokens).ceil().long() - 1
                  ).clamp(0, BUCKETS - 1)
        for b in range(BUCKETS):
            rows = (valid & (bucket == b)).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            ref = None if ref_logprobs is None else ref_logprobs[rows]
            behaviour = None if rollout_logprobs is None else rollout_logprobs[rows]
            with warnings.catch_warnings():  # e.g. gspo aggregation=token warns on every call
                warnings.simplefilter("ignore")
                _, stats = self.objective.loss(logprobs.detach()[rows], old_logprobs[rows],
                                               advantages[rows], mask[rows], ref_logprobs=ref,
                                               rollout_logprobs=behaviour)
            n = float(on[rows].sum())
            self.clipped[b] += float(stats["objective/clip_frac_tokens"]) * n
            self.tokens[b] += n

    def metrics(self, dist: Any = None) -> dict[str, float]:
        """``diag/*`` of the whole step (``dist``: a :class:`gspo.trainer.distributed.Dist`)."""
        log_s = torch.cat(self.log_s) if self.log_s else torch.zeros(0, dtype=torch.float64)
        counts = torch.cat([self.clipped, self.tokens])
        if dist is not None and dist.enabled:
            log_s, _ = dist.gather(log_s)
            counts = dist.all_reduce(counts)
        out: dict[str, float] = {}
        if log_s.numel():
            s = log_s.clamp(-20.0, 20.0).exp()
            qs = torch.quantile(s, torch.tensor([q for _, q in QUANTILES], dtype=s.dtype))
            out.update({f"diag/seq_ratio_{name}": float(v) for (name, _), v in zip(QUANTILES, qs)})
        clipped, tokens = counts[:BUCKETS], counts[BUCKETS:]
        for b in range(BUCKETS):
            out[f"diag/clip_frac_len_q{b + 1}"] = (float(clipped[b] / tokens[b])
                                                   if tokens[b] > 0 else math.nan)
        return out
