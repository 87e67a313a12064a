"""One policy update over a rollout batch: minibatches × epochs of AdamW steps."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gspo.models.logprobs import token_logprobs
from gspo.objectives import OBJECTIVES
from gspo.trainer.distributed import Dist
from gspo.trainer.metrics import reduce_stats


@dataclass
class UpdateBatch:
    """Padded tensors for N rollouts (see :func:`gspo.rollout.pad_batch`) plus their targets."""

    input_ids: torch.Tensor  # [N, T]
    attention_mask: torch.Tensor  # [N, T]
    response_mask: torch.Tensor  # [N, T] float, 1 on response tokens
    old_logprobs: torch.Tensor  # [N, T] fp32, log π_old
    advantages: torch.Tensor  # [N]
    ref_logprobs: torch.Tensor | None = None  # [N, T] when beta > 0
    routing: list[torch.Tensor] | None = None  # π_old expert choices per MoE layer [N*T, k]
    replay: bool = False  # replay ``routing`` in the update (Routing Replay) or only compare
    # π_old of the first minibatch's rows from that minibatch's own forward (see policy_update);
    # ``entropy`` [N, T] then receives their policy entropy.
    old_from_first_minibatch: bool = False
    entropy: torch.Tensor | None = None

    def rows(self, idx: torch.Tensor) -> UpdateBatch:
        """Rows ``idx``, cut to their longest sequence (no compute spent on shared padding)."""
        width = int(self.attention_mask[idx].sum(-1).max())
        cut = lambda t: None if t is None else t[idx, :width]  # noqa: E731
        routing = None
        if self.routing is not None:
            from gspo.models.moe import select_sequences

            seq_len = self.input_ids.shape[1]
            routing = [r.view(len(idx), seq_len, -1)[:, :width].reshape(-1, r.shape[-1])
                       for r in select_sequences(self.routing, seq_len, idx)]
        return UpdateBatch(cut(self.input_ids), cut(self.attention_mask),
                           cut(self.response_mask), cut(self.old_logprobs),
                           self.advantages[idx], cut(self.ref_logprobs), routing, self.replay)


def _forward_ctx(model: Any, mb: UpdateBatch, moe: Any) -> contextlib.AbstractContextManager:
    if moe is None:
        return contextlib.nullcontext({})
    from gspo.trainer.moe_hooks import moe_forward

    return moe_forward(model, mb.routing if mb.replay else None,
                       want_logits=mb.routing is not None and moe.log_routing_change,
                       aux=moe.aux_loss_coef > 0)


def _all_finite(loss: torch.Tensor, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                mask: torch.Tensor) -> bool:
    """Loss, log π_θ and log π_old all finite on response tokens (one host sync). A clipped
    objective can turn an infinite ratio into a finite loss, so the loss alone is not enough."""
    on = mask > 0
    ok = (torch.isfinite(loss) & torch.isfinite(logprobs[on]).all()
          & torch.isfinite(old_logprobs[on]).all())
    return bool(ok)


def row_weights(mask: torch.Tensor, objective: Any) -> torch.Tensor:
    """w_i [N]: the weights of the objective's mean over rows, Σ_i w_i term_i / Σ_i w_i, as
    the losses compute it: |y_i| for GSPO's ``token`` aggregation, else 1 for every row with
    at least one response token."""
    lengths = (mask > 0).sum(-1).float()
    if objective.name == "gspo" and objective.aggregation == "token":
        return lengths
    return (lengths > 0).float()


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


def _grad_norm(model: Any, grad_clip: float) -> torch.Tensor:
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                           grad_clip if grad_clip > 0 else math.inf)
    return gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm  # FSDP2: a DTensor


def _token_ratio_mean(logprobs: torch.Tensor, old: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """Mean token ratio w_it over response tokens (detached); with ``token_ratio_std`` it lets
    the std be pooled exactly across ranks."""
    on = mask > 0
    log_w = torch.where(on, logprobs.detach() - old, 0.0).clamp(-20.0, 20.0)
    return torch.where(on, log_w.exp(), 0.0).sum() / on.sum().clamp(min=1)


def minibatch_plan(n: int, objective: Any, generator: torch.Generator
                   ) -> list[list[torch.Tensor]]:
    """Rows of each minibatch (sorted), per epoch: a fresh permutation of the ``n`` rows of the
    global batch each epoch, split into ``objective.num_minibatches`` parts."""
    return [[mb.sort().values for mb in
             torch.randperm(n, generator=generator).tensor_split(objective.num_minibatches)]
            for _ in range(objective.epochs)]


def outside_first_minibatch(plan: list[list[torch.Tensor]], n: int) -> torch.Tensor:
    """Indices of the ``n`` rows that the plan's first minibatch does not hold (the rows the
    π_old pass still computes when that minibatch's forward supplies its own π_old)."""
    rest = torch.ones(n, dtype=torch.bool)
    rest[plan[0][0]] = False
    return rest.nonzero().squeeze(-1)


def reuse_first_forward(model: Any, objective: Any, dist: Dist, moe: bool) -> bool:
    """Whether π_old of the first minibatch can come from its own forward (one process, a dense
    policy, π_old recomputed, no dropout: then that forward runs at θ = θ_old and gives π_old
    exactly, so the separate π_old pass can skip those rows)."""
    return (objective.old_logprobs == "recompute" and not moe and not dist.enabled
            and not has_dropout(model))


def has_dropout(model: Any) -> bool:
    """Dropout active in training mode: a ``Dropout`` module with p > 0 or a ``*dropout`` config
    value > 0 (attention dropout is applied inside the attention function)."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0
           for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    values = config.to_dict() if hasattr(config, "to_dict") else {}
    return any("dropout" in k and isinstance(v, (int, float)) and not isinstance(v, bool)
               and v > 0 for k, v in values.items())


def policy_update(model: Any, optimizer: torch.optim.Optimizer, scheduler: Any,
                  batch: UpdateBatch, *, objective: Any, temperature: float, chunk: int,
                  grad_clip: float, generator: torch.Generator, moe: Any = None,
                  dist: Dist | None = None, logprob_fn: Callable[..., Any] = token_logprobs,
                  plan: list[list[torch.Tensor]] | None = None
                  ) -> tuple[list[dict[str, torch.Tensor]], int]:
    """Run ``objective.epochs`` passes of ``objective.num_minibatches`` AdamW steps.

    ``moe`` (a :class:`gspo.config.MoEConfig`, only for MoE policies) switches on routing
    replay, the routing-change metric and the load-balancing loss.
    ``dist`` (several processes): ``batch`` holds this rank's rows of the global rollout batch
    (rank order); every rank draws the same permutation of the global batch, computes its rows
    of each minibatch, and the stats come back as global values (see :func:`_local_rows`).
    The MoE load-balancing loss is each rank's own, averaged over ranks.
    ``logprob_fn``: :func:`token_logprobs` or a drop-in with its signature and outputs (e.g.
    :func:`gspo.models.packing.shared_prefix_logprobs`).
    ``plan``: the minibatches, as :func:`minibatch_plan` draws them from ``generator`` (the
    default). With ``batch.old_from_first_minibatch`` (one process only), the first
    minibatch's rows of ``batch.old_logprobs`` are not read but written: the first forward runs
    at θ = θ_old, so its detached log-probs are π_old (ratio exactly 1), and its entropy goes to
    ``batch.entropy``.
    Returns the per-minibatch stats and the number of updates skipped for a non-finite loss,
    log-prob (π_θ or π_old, on response tokens) or gradient norm (decided jointly by all ranks).
    """
    d = dist if dist is not None else Dist()
    loss_fn = OBJECTIVES[objective.name]
    options = {"aggregation": objective.aggregation} if objective.name == "gspo" else {}
    n_local = batch.input_ids.shape[0]
    w_global, offset = d.gather(row_weights(batch.response_mask, objective))
    all_stats: list[dict[str, torch.Tensor]] = []
    counts: list[dict[str, float]] = []
    skipped = 0
    if plan is None:
        plan = minibatch_plan(w_global.shape[0], objective, generator)
    if batch.old_from_first_minibatch and (d.enabled or batch.entropy is None):
        raise ValueError("old_from_first_minibatch needs one process and batch.entropy")
    model.train()
    for epoch, minibatches in enumerate(plan):
        for k, mb_idx in enumerate(minibatches):
            local, share, empty = _local_rows(mb_idx, offset, n_local, w_global, d)
            mb = batch.rows(local)
            fill_old = batch.old_from_first_minibatch and epoch == 0 and k == 0
            with _forward_ctx(model, mb, moe) as moe_out:
                logprobs, entropy = d.forward(model, logprob_fn, mb.input_ids, mb.attention_mask,
                                              mb.response_mask, temperature=temperature,
                                              chunk=chunk, with_entropy=fill_old)
                if fill_old:  # θ = θ_old here: this forward is π_old for these rows
                    width = mb.input_ids.shape[1]
                    mb.old_logprobs = logprobs.detach()
                    batch.old_logprobs[local, :width] = mb.old_logprobs
                    batch.old_logprobs[local, width:] = 0.0
                    batch.entropy[local] = 0.0
                    batch.entropy[local, :width] = entropy
                loss, stats = loss_fn(logprobs, mb.old_logprobs, mb.advantages, mb.response_mask,
                                      eps_low=objective.eps_low, eps_high=objective.eps_high,
                                      beta=objective.beta, ref_logprobs=mb.ref_logprobs,
                                      **options)
                stats = {**stats, "objective/token_ratio_mean": _token_ratio_mean(
                    logprobs, mb.old_logprobs, mb.response_mask)}
                grad_loss = loss * share if d.enabled else loss
                if moe_out.get("live_logits"):
                    loss, grad_loss, stats = _add_aux_loss(model, moe_out, mb, moe, loss,
                                                           grad_loss, stats, 0.0 if empty else 1.0)
                optimizer.zero_grad(set_to_none=True)
                finite = _all_finite(loss, logprobs, mb.old_logprobs, mb.response_mask)
                if not _everywhere(finite, d):
                    skipped += 1
                    continue
                grad_loss.backward()  # inside the replay block: checkpoint recomputes replay too
            gnorm = _grad_norm(model, grad_clip)
            if not torch.isfinite(gnorm):
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            optimizer.step()
            scheduler.step()
            stats = dict(stats)
            if moe_out.get("natural") is not None:
                from gspo.trainer.moe_hooks import routing_change_stats

                stats.update(routing_change_stats(mb.routing, moe_out["natural"],
                                                  mb.response_mask))
            stats["train/grad_norm"] = gnorm.detach()
            stats["train/loss"] = loss.detach()
            all_stats.append(stats)
            counts.append(_counts(mb, 0.0 if empty else float(w_global[local + offset].sum())))
    optimizer.zero_grad(set_to_none=True)
    if d.enabled:
        all_stats = reduce_stats(all_stats, counts, d.all_reduce)
    return all_stats, skipped


def _add_aux_loss(model: Any, moe_out: dict[str, Any], mb: UpdateBatch, moe: Any,
                  loss: torch.Tensor, grad_loss: torch.Tensor, stats: dict[str, torch.Tensor],
                  keep: float) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Add the router load-balancing loss (``keep`` = 0 on a rank's stand-in row)."""
    from gspo.trainer.moe_hooks import aux_loss

    lb = aux_loss(model, moe_out["live_logits"], mb.attention_mask)
    stats = {**stats, "moe/load_balancing_loss": lb.detach()}
    return (loss + moe.aux_loss_coef * lb, grad_loss + keep * moe.aux_loss_coef * lb, stats)


def _counts(mb: UpdateBatch, weight: float) -> dict[str, float]:
    """What this rank's stats of a minibatch average over (zeros for a stand-in row)."""
    on = mb.response_mask > 0
    real = weight > 0
    return {"rows": float(on.any(-1).sum()) if real else 0.0,
            "tokens": float(on.sum()) if real else 0.0, "weight": weight}


def _everywhere(ok: bool, d: Dist) -> bool:
    """True when ``ok`` holds on every rank: a skip must happen on all ranks or on none."""
    if not d.enabled:
        return ok
    return bool(d.all_reduce(torch.tensor([float(ok)]), "min")[0] > 0)
