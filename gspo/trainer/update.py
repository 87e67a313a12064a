"""One policy update over a rollout batch: minibatches × epochs of AdamW steps."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from gspo.models.logprobs import token_logprobs
from gspo.objectives import OBJECTIVES


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


def policy_update(model: Any, optimizer: torch.optim.Optimizer, scheduler: Any,
                  batch: UpdateBatch, *, objective: Any, temperature: float, chunk: int,
                  grad_clip: float, generator: torch.Generator,
                  moe: Any = None) -> tuple[list[dict[str, torch.Tensor]], int]:
    """Run ``objective.epochs`` passes of ``objective.num_minibatches`` AdamW steps.

    ``moe`` (a :class:`gspo.config.MoEConfig`, only for MoE policies) switches on routing
    replay, the routing-change metric and the load-balancing loss.
    Returns the per-minibatch stats and the number of updates skipped for non-finite values.
    """
    loss_fn = OBJECTIVES[objective.name]
    options = {"aggregation": objective.aggregation} if objective.name == "gspo" else {}
    n = batch.input_ids.shape[0]
    all_stats: list[dict[str, torch.Tensor]] = []
    skipped = 0
    model.train()
    for _ in range(objective.epochs):
        order = torch.randperm(n, generator=generator)
        for mb_idx in order.tensor_split(objective.num_minibatches):
            mb = batch.rows(mb_idx.sort().values)
            with _forward_ctx(model, mb, moe) as moe_out:
                logprobs, _ = token_logprobs(model, mb.input_ids, mb.attention_mask,
                                             mb.response_mask, temperature=temperature,
                                             chunk=chunk)
                loss, stats = loss_fn(logprobs, mb.old_logprobs, mb.advantages, mb.response_mask,
                                      eps_low=objective.eps_low, eps_high=objective.eps_high,
                                      beta=objective.beta, ref_logprobs=mb.ref_logprobs,
                                      **options)
                if moe_out.get("live_logits"):
                    from gspo.trainer.moe_hooks import aux_loss

                    lb = aux_loss(model, moe_out["live_logits"], mb.attention_mask)
                    stats = {**stats, "moe/load_balancing_loss": lb.detach()}
                    loss = loss + moe.aux_loss_coef * lb
                optimizer.zero_grad(set_to_none=True)
                if not torch.isfinite(loss):
                    skipped += 1
                    continue
                loss.backward()  # inside the replay block: checkpoint recomputes replay too
            gnorm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), grad_clip if grad_clip > 0 else math.inf)
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
    optimizer.zero_grad(set_to_none=True)
    return all_stats, skipped
