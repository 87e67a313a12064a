"""One policy update over a rollout batch: minibatches × epochs of AdamW steps.

The update is planned before it runs (:func:`plan_update`): the trainer draws the minibatches
first, so that the π_old pass knows which rows the first minibatch's own forward will supply
(see :class:`UpdatePlan`). :func:`policy_update` then runs the plan and returns what it
computed, π_old of those rows included, without writing into its input.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from gspo.models.logprobs import token_logprobs
from gspo.models.train_noise import train_noise
from gspo.objectives import Objective
from gspo.trainer.diagnostics import StepDiagnostics
from gspo.trainer.distributed import Dist
from gspo.trainer.metrics import reduce_stats
from gspo.trainer.moe_hooks import NO_MOE, PolicyHooks

# Reductions of the stats the update adds beside the objective's (see gspo.trainer.metrics).
UPDATE_STAT_KINDS = {"train/grad_norm": "rank", "train/loss": "weight"}


def stat_kinds(objective: Objective, hooks: PolicyHooks) -> dict[str, str]:
    """The declared reduction of every stat one update step returns."""
    return {**objective.stat_kinds, **UPDATE_STAT_KINDS, **hooks.stat_kinds}


@dataclass
class UpdateBatch:
    """Padded tensors for N rollouts (see :func:`gspo.rollout.pad_batch`) plus their targets."""

    input_ids: torch.Tensor  # [N, T]
    attention_mask: torch.Tensor  # [N, T]
    response_mask: torch.Tensor  # [N, T] float, 1 on response tokens
    old_logprobs: torch.Tensor  # [N, T] fp32, log π_old
    advantages: torch.Tensor  # [N]
    ref_logprobs: torch.Tensor | None = None  # [N, T] when beta > 0
    routing: list[torch.Tensor] | None = None  # MoE: π_old's experts per layer [N*T, k]
    rollout_logprobs: torch.Tensor | None = None  # [N, T] log π_rollout, for a correction

    def rows(self, idx: torch.Tensor) -> UpdateBatch:
        """Rows ``idx``, cut to their longest sequence (no compute spent on shared padding);
        ``routing`` is left to the policy hooks, which know its layout."""
        width = int(self.attention_mask[idx].sum(-1).max())
        cut = lambda t: None if t is None else t[idx, :width]  # noqa: E731
        return UpdateBatch(cut(self.input_ids), cut(self.attention_mask),
                           cut(self.response_mask), cut(self.old_logprobs),
                           self.advantages[idx], cut(self.ref_logprobs),
                           rollout_logprobs=cut(self.rollout_logprobs))


@dataclass(frozen=True)
class UpdatePlan:
    """The minibatches of each epoch (sorted row indices into the global batch).

    ``old_from_first``: the first minibatch's forward runs at this step's weights θ, so its
    detached log-probs are the trainer's pass on θ for its rows; the pass then skips those rows
    (:meth:`old_pass_rows`) and :func:`policy_update` supplies them. ``first_is_old``: that
    pass is π_old (θ = θ_old: ratio 1 exactly), so they fill the loss's π_old; else (π_old is
    an older behaviour policy, the pass only measures against it) they are returned apart, in
    ``UpdateResult.first_logprobs``.
    """

    minibatches: list[list[torch.Tensor]]
    old_from_first: bool = False
    first_is_old: bool = True

    def old_pass_rows(self, n: int) -> torch.Tensor | None:
        """The rows the π_old pass computes: all (None), or those outside the first minibatch."""
        if not self.old_from_first:
            return None
        rest = torch.ones(n, dtype=torch.bool)
        rest[self.minibatches[0][0]] = False
        return rest.nonzero().squeeze(-1)


def plan_update(n: int, *, num_minibatches: int, epochs: int, generator: torch.Generator,
                old_from_first: bool = False, first_is_old: bool = True) -> UpdatePlan:
    """A fresh permutation of the ``n`` rows of the global batch each epoch, split into
    ``num_minibatches`` parts (each sorted)."""
    return UpdatePlan([[mb.sort().values for mb in
                        torch.randperm(n, generator=generator).tensor_split(num_minibatches)]
                       for _ in range(epochs)], old_from_first, first_is_old)


def can_reuse_first_forward(model: Any, dist: Dist, hooks: PolicyHooks) -> bool:
    """Whether π_old of the first minibatch can come from its own forward: one process, no
    dropout (that forward must run at θ = θ_old exactly) and no routing to capture in the
    π_old pass. The caller also needs π_old recomputed rather than taken from the rollout."""
    return not dist.enabled and not hooks.active and not has_dropout(model)


def has_dropout(model: Any) -> bool:
    """Noise in training mode: dropout or MoE router jitter (see :mod:`gspo.models.train_noise`;
    ``disable_dropout=true``, the default, removes it when the policy is built)."""
    return bool(train_noise(model))


@dataclass
class UpdateResult:
    """What :func:`policy_update` returns.

    ``stats``: one dict per minibatch step taken (global values under ``dist``);
    ``skipped``: updates skipped for a non-finite loss, log-prob or gradient norm;
    ``empty``: updates skipped because no row of the minibatch counts in the loss (every
    response masked, e.g. all truncated under ``rollout.mask_truncated``; not a fault);
    ``old_logprobs``: the batch's π_old with the first minibatch's rows filled in (plans with
    ``old_from_first`` and ``first_is_old``; else the input's); ``first_entropy``: those rows'
    policy entropy ``[n_first, width]`` (None without ``old_from_first``), ``first_rows``
    their indices, ``first_logprobs`` their log-probs at this step's weights where they are not
    π_old (``first_is_old=False``); ``lrs``: the learning rate (the first parameter group's)
    each minibatch step of the plan ran at, or would have run at where it was skipped (a
    skipped update, of either kind, does not advance the lr schedule).
    """

    stats: list[dict[str, torch.Tensor]]
    skipped: int
    old_logprobs: torch.Tensor
    first_rows: torch.Tensor | None = None
    first_entropy: torch.Tensor | None = None
    first_logprobs: torch.Tensor | None = None
    diagnostics: dict[str, float] = field(default_factory=dict)  # whole-step diag/* metrics
    # per step in ``stats``: the (global) rows, tokens, signal rows/tokens and weight it averages
    counts: list[dict[str, float]] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    empty: int = 0


def policy_update(model: Any, optimizer: torch.optim.Optimizer, scheduler: Any,
                  batch: UpdateBatch, plan: UpdatePlan, *, objective: Objective,
                  temperature: float, chunk: int, grad_clip: float,
                  hooks: PolicyHooks = NO_MOE, dist: Dist | None = None,
                  logprob_fn: Callable[..., Any] = token_logprobs,
                  diagnostics: StepDiagnostics | None = None) -> UpdateResult:
    """Run ``plan``: one AdamW step per minibatch.

    ``hooks``: the policy's MoE hooks (routing replay, routing-change metric, load-balancing
    loss), or the do-nothing :data:`NO_MOE` for a dense model.
    ``dist`` (several processes): ``batch`` holds this rank's rows of the global rollout batch
    (rank order); every rank runs the same plan over the global batch, computes its rows of
    each minibatch, and the stats come back as global values (see :func:`_local_rows`).
    ``logprob_fn``: :func:`token_logprobs` or a drop-in with its signature and outputs (e.g.
    :func:`gspo.models.packing.shared_prefix_logprobs`).
    ``diagnostics``: collects the whole step's ``diag/*`` metrics into ``result.diagnostics``.

    A minibatch none of whose rows has loss weight (every response masked) has a zero policy
    gradient: AdamW would still move the weights by its momentum and weight decay, so its
    optimizer step is skipped (on every rank: each sees the global row weights) and counted in
    ``result.empty``; like a non-finite skip it neither adds stats nor advances the lr schedule.
    """
    d = dist if dist is not None else Dist()
    if plan.old_from_first and d.enabled:
        raise ValueError("a plan with old_from_first needs one process")
    n_local = batch.input_ids.shape[0]
    w_global, offset = d.gather(objective.row_weights(batch.response_mask))
    # where each rank's rows end in the global batch: which ranks hold rows of a minibatch
    # (for the hooks' extra loss; every rank has the same hooks)
    ends = d.gather(torch.tensor([n_local]))[0].cumsum(0) if d.enabled and hooks.active else None
    old = (batch.old_logprobs.clone() if plan.old_from_first and plan.first_is_old
           else batch.old_logprobs)
    batch = replace(batch, old_logprobs=old)
    result = UpdateResult([], 0, old)
    counts: list[dict[str, float]] = []
    model.train()
    for epoch, minibatches in enumerate(plan.minibatches):
        for k, mb_idx in enumerate(minibatches):
            local, share, empty = _local_rows(mb_idx, offset, n_local, w_global, d)
            extra_share = 0.0 if empty else _extra_share(mb_idx, ends, d)
            first = plan.old_from_first and epoch == 0 and k == 0
            void = not float(w_global[mb_idx].sum()) > 0  # the same on every rank
            result.lrs.append(float(optimizer.param_groups[0]["lr"]))
            out = _step(model, optimizer, scheduler, batch, local, share, extra_share,
                        empty, first, plan.first_is_old, result, objective=objective,
                        temperature=temperature, chunk=chunk, grad_clip=grad_clip,
                        hooks=hooks, d=d, logprob_fn=logprob_fn, diagnostics=diagnostics,
                        apply=not void)
            if out is None:
                result.skipped += 1
                continue
            if void:
                result.empty += 1
                continue
            stats, seen = out
            result.stats.append(stats)
            weight = 0.0 if empty else float(w_global[local + offset].sum())
            counts.append(_counts(batch.response_mask[local], seen, weight))
    optimizer.zero_grad(set_to_none=True)
    result.counts = counts
    if d.enabled:
        result.stats = reduce_stats(result.stats, counts, d.all_reduce,
                                    stat_kinds(objective, hooks))
        result.counts = _global_counts(counts, d)
    if diagnostics is not None:
        result.diagnostics = diagnostics.metrics(d)
    return result


def _step(model: Any, optimizer: Any, scheduler: Any, batch: UpdateBatch, local: torch.Tensor,
          share: float, extra_share: float, empty: bool, first: bool, first_is_old: bool,
          result: UpdateResult, *,
          objective: Objective, temperature: float, chunk: int, grad_clip: float,
          hooks: PolicyHooks, d: Dist, logprob_fn: Callable[..., Any],
          diagnostics: StepDiagnostics | None = None,
          apply: bool = True) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
    """One minibatch: forward, loss, backward, AdamW step; its stats and the advantages its
    loss saw (:meth:`gspo.objectives.Objective.seen_advantages`: a behaviour correction's
    weights applied), or None if skipped.
    ``first``: this forward also gives the trainer's pass for these rows: their π_old
    (``first_is_old``), else returned apart (see :class:`UpdatePlan`). ``share`` /
    ``extra_share``: the multipliers of the objective's loss and of the hooks' extra loss
    (:func:`_local_rows`, :func:`_extra_share`). ``apply=False``: no
    optimizer or scheduler step (a minibatch without a valid row); its stats are returned."""
    mb = batch.rows(local)
    width = mb.input_ids.shape[1]
    with hooks.update_forward(model, batch.routing, local, batch.input_ids.shape[1],
                              width) as moe_out:
        logprobs, entropy = d.forward(model, logprob_fn, mb.input_ids, mb.attention_mask,
                                      mb.response_mask, temperature=temperature, chunk=chunk,
                                      with_entropy=first)
        if first:
            result.first_rows, result.first_entropy = local, entropy
            if first_is_old:  # θ = θ_old here: this forward is π_old for these rows
                mb.old_logprobs = logprobs.detach()
                batch.old_logprobs[local, :width] = mb.old_logprobs
                batch.old_logprobs[local, width:] = 0.0
            else:  # this step's θ, not π_old: for the metrics of the trainer's pass
                result.first_logprobs = logprobs.detach()
        loss, stats = objective.loss(logprobs, mb.old_logprobs, mb.advantages, mb.response_mask,
                                     ref_logprobs=mb.ref_logprobs,
                                     rollout_logprobs=mb.rollout_logprobs)
        grad_loss = loss * share if d.enabled else loss
        extra, extra_stats = hooks.extra_loss(model, moe_out, mb.attention_mask)
        if extra is not None:  # e.g. the router load-balancing loss, each rank's own
            loss, grad_loss = loss + extra, grad_loss + extra_share * extra
            stats = {**stats, **extra_stats}
        optimizer.zero_grad(set_to_none=True)
        if not _everywhere(_all_finite(loss, logprobs, mb.old_logprobs, mb.response_mask), d):
            return None
        if diagnostics is not None and not empty:
            diagnostics.observe(logprobs, mb.old_logprobs, mb.advantages, mb.response_mask,
                                mb.ref_logprobs, mb.rollout_logprobs)
        grad_loss.backward()  # inside the hooks' block: checkpointing recomputes replay too
    gnorm = _grad_norm(model, grad_clip)
    if not torch.isfinite(gnorm):
        optimizer.zero_grad(set_to_none=True)
        return None
    if apply:
        optimizer.step()
        scheduler.step()
    # a stand-in row (this rank holds none of the minibatch) adds nothing to global stats
    own = torch.zeros_like(mb.response_mask) if empty else mb.response_mask
    seen = (mb.advantages if objective.correction is None else objective.seen_advantages(
        logprobs, mb.old_logprobs, mb.advantages, mb.response_mask,
        rollout_logprobs=mb.rollout_logprobs))
    return {**stats, **hooks.step_stats(moe_out, own,
                                        all_reduce=d.all_reduce if d.enabled else None),
            "train/grad_norm": gnorm.detach(), "train/loss": loss.detach()}, seen


def _counts(response_mask: torch.Tensor, advantages: torch.Tensor, weight: float
            ) -> dict[str, float]:
    """What this rank's stats of a minibatch average over (zeros for a stand-in row).
    ``advantages``: those the loss saw ([B], or [B, T] under token weights); a signal row is
    one whose token mean of them is not 0, as in the loss's ``*_signal`` stats."""
    on = response_mask > 0
    if weight <= 0:
        return {"rows": 0.0, "tokens": 0.0, "signal_rows": 0.0, "signal_tokens": 0.0,
                "weight": weight}
    row = (advantages != 0 if advantages.dim() == 1
           else torch.where(on, advantages, 0.0).sum(-1) != 0)
    signal = on & row[:, None]
    return {"rows": float(on.any(-1).sum()), "tokens": float(on.sum()),
            "signal_rows": float(signal.any(-1).sum()), "signal_tokens": float(signal.sum()),
            "weight": weight}


def _global_counts(counts: list[dict[str, float]], d: Dist) -> list[dict[str, float]]:
    """Every rank's counts of each minibatch summed over ranks (one all-reduce)."""
    if not counts:
        return counts
    keys = sorted(counts[0])
    flat = torch.tensor([c[k] for c in counts for k in keys], dtype=torch.float64)
    total = d.all_reduce(flat, "sum").view(len(counts), len(keys)).tolist()
    return [dict(zip(keys, row)) for row in total]


def _all_finite(loss: torch.Tensor, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                mask: torch.Tensor) -> bool:
    """Loss, log π_θ and log π_old all finite on response tokens (one host sync). A clipped
    objective can turn an infinite ratio into a finite loss, so the loss alone is not enough."""
    on = mask > 0
    ok = (torch.isfinite(loss) & torch.isfinite(logprobs[on]).all()
          & torch.isfinite(old_logprobs[on]).all())
    return bool(ok)


def _local_rows(mb_idx: torch.Tensor, offset: int, n_local: int, w_global: torch.Tensor,
                d: Dist) -> tuple[torch.Tensor, float, bool]:
    """This rank's rows of a global minibatch, its loss multiplier and whether it has none.

    The loss of the local rows is Σ_local w_i term_i / Σ_local w_i; times
    W · Σ_local w / Σ_global w it becomes W · Σ_local w_i term_i / Σ_global w, and the
    gradient average over the W ranks (DDP, FSDP2) then yields exactly the gradient of the
    mean over the global minibatch. A rank with no row there still runs a forward and a
    backward (the collectives must match) on one of its rows, with multiplier 0.
    """
    mine = mb_idx[(mb_idx >= offset) & (mb_idx < offset + n_local)] - offset
    if not d.enabled:
        return mine, 1.0, False
    if mine.numel() == 0:
        return torch.zeros(1, dtype=torch.long), 0.0, True
    local_w = float(w_global[mine + offset].sum())
    return mine, d.world_size * local_w / max(float(w_global[mb_idx].sum()), 1.0), False


def _extra_share(mb_idx: torch.Tensor, ends: torch.Tensor | None, d: Dist) -> float:
    """The multiplier of the hooks' extra loss (the MoE load-balancing loss, each rank's own
    over its rows) on a rank that holds rows of the minibatch: W / (ranks holding rows), so
    that the gradient average over the W ranks is its mean over those ranks (a rank without
    rows adds 0); 1 in one process and when every rank holds rows. ``ends``: where each
    rank's rows end in the global batch."""
    if not d.enabled or ends is None:
        return 1.0
    holders = torch.bucketize(mb_idx, ends, right=True).unique().numel()
    return d.world_size / holders


def _grad_norm(model: Any, grad_clip: float) -> torch.Tensor:
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                           grad_clip if grad_clip > 0 else math.inf)
    return gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm  # FSDP2: a DTensor


def _everywhere(ok: bool, d: Dist) -> bool:
    """True when ``ok`` holds on every rank: a skip must happen on all ranks or on none."""
    if not d.enabled:
        return ok
    return bool(d.all_reduce(torch.tensor([float(ok)]), "min")[0] > 0)
