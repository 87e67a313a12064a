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
                           self.advantages[idx], cut(self.ref_logprobs), routing)


def _replay(model: Any, routing: list[torch.Tensor] | None) -> contextlib.AbstractContextManager:
    if routing is None:
        return contextlib.nullcontext()
    from gspo.models.moe import replay_routing

    return replay_routing(model, routing)


def policy_update(model: Any, optimizer: torch.optim.Optimizer, scheduler: Any,
                  batch: UpdateBatch, *, objective: Any, temperature: float, chunk: int,
                  grad_clip: float, generator: torch.Generator,
                  aux_loss: Any = None) -> tuple[list[dict[str, torch.Tensor]], int]:
    """Run ``objective.epochs`` passes of ``objective.num_minibatches`` AdamW steps.

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
            with _replay(model, mb.routing):
                logprobs, _ = token_logprobs(model, mb.input_ids, mb.attention_mask,
                                             mb.response_mask, temperature=temperature,
                                             chunk=chunk)
                loss, stats = loss_fn(logprobs, mb.old_logprobs, mb.advantages, mb.response_mask,
                                      eps_low=objective.eps_low, eps_high=objective.eps_high,
                                      beta=objective.beta, ref_logprobs=mb.ref_logprobs,
                                      **options)
                if aux_loss is not None:
                    loss = loss + aux_loss(model, mb)
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
            stats["train/grad_norm"] = gnorm.detach()
            stats["train/loss"] = loss.detach()
            all_stats.append(stats)
    optimizer.zero_grad(set_to_none=True)
    return all_stats, skipped
