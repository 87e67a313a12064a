"""The rollout batch and how it becomes padded tensors for the trainer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

Row = TypeVar("Row")


@dataclass
class Rollout:
    """``N = B × G`` sampled responses, rows of a group contiguous.

    ``logprobs[i]`` holds log π_old(y_it | ·) of each response token as the sampler saw it (fp32,
    at the sampling temperature); the EOS token, when sampled, is part of the response.

    ``routing`` (routing replay R3, MoE policies, only when the engine was asked to record it):
    per MoE layer a LongTensor ``[N * T, k]`` of the experts chosen *during sampling*, in the
    layout of one forward over ``pad_batch(prompt_ids, response_ids, ...)`` (rows right-padded to
    ``T = max(len(prompt) + len(response))``, row-major over ``(row, position)``). ``-1`` marks
    positions whose routing the engine did not see: padding and the final sampled token of each
    row (never fed back to the model); the trainer fills them from its own π_old forward.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    logprobs: list[torch.Tensor]
    truncated: list[bool]
    group_size: int
    routing: list[torch.Tensor] | None = None  # per MoE layer [N * T, k], pad_batch layout (R3)
    extras: dict[str, float] = field(default_factory=dict)
    model_mask: list[list[bool]] | None = None  # multi-turn: True on sampled response tokens
    # rollout.async_steps > 0 (gspo.rollout.async_engine): per row, the policy version (number
    # of updates applied) that sampled it, and log π of that version by the trainer's own fp32
    # log-prob pass (on the steps it was asked for), to tell staleness from engine mismatch.
    versions: list[int] | None = None
    trainer_logprobs: list[torch.Tensor] | None = None
    # and (MoE policies) the experts that pass chose, in ``routing``'s layout: π_old's routing
    # when π_old is the behaviour policy (what R2 replays then)
    trainer_routing: list[torch.Tensor] | None = None
    # R3 with objective.old_logprobs=recompute: per row, log π of that version by the same pass
    # run again under the experts the update replays (``routing`` merged with
    # ``trainer_routing``), the loss's π_old; None where that routing is the pass's own
    # (``trainer_logprobs`` are then those log-probs). ``trainer_logprobs`` stay the pass on
    # its own routing, for the metrics.
    replayed_logprobs: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.response_ids)

    def _select_routing(self, routing: list[torch.Tensor] | None, idx: list[int]
                        ) -> list[torch.Tensor] | None:
        """The selected rows of a pad_batch-layout routing, re-cut to their own padded length."""
        if routing is None:
            return None
        width = routing[0].shape[0] // max(len(self), 1)
        t = max((len(self.prompt_ids[i]) + len(self.response_ids[i]) for i in idx), default=0)
        return [r.view(len(self), width, -1)[idx, :t].reshape(-1, r.shape[-1]) for r in routing]

    def select(self, idx: list[int]) -> Rollout:
        pick = lambda xs: None if xs is None else [xs[i] for i in idx]  # noqa: E731
        return Rollout([self.prompt_ids[i] for i in idx], [self.response_ids[i] for i in idx],
                       [self.logprobs[i] for i in idx], [self.truncated[i] for i in idx],
                       self.group_size, self._select_routing(self.routing, idx),
                       model_mask=pick(self.model_mask), versions=pick(self.versions),
                       trainer_logprobs=pick(self.trainer_logprobs),
                       trainer_routing=self._select_routing(self.trainer_routing, idx),
                       replayed_logprobs=pick(self.replayed_logprobs))



def join_replayed(replayed: Sequence[list[Row] | None], trainer: Sequence[list[Row] | None]
                  ) -> list[Row] | None:
    """R3's replayed log-probs (:attr:`Rollout.replayed_logprobs`) of consecutive batches
    joined, from each batch's replayed and trainer log-probs (rows of any type: tensors, or
    the lists of an encoded rollout): a batch without replayed ones contributes its trainer
    log-probs (equal there: the replayed routing was its pass's own); None when no batch has
    replayed ones.

    Raises:
        ValueError: a batch has neither, while another has replayed ones.
    """
    if all(r is None for r in replayed):
        return None
    per = [r if r is not None else t for r, t in zip(replayed, trainer, strict=True)]
    if any(x is None for x in per):
        raise ValueError("some batches have replayed_logprobs and some have no "
                         "trainer_logprobs")
    return [row for x in per if x is not None for row in x]


def join_routing(records: list[list[torch.Tensor]], rows: list[int], *,
                 complete: bool = False) -> list[torch.Tensor]:
    """One routing record (:attr:`Rollout.routing`'s layout) for consecutive blocks of rows,
    from each block's own: per MoE layer, block ``i``'s ``[rows[i] * T_i, k]`` (``T_i`` its
    longest row) re-padded to the longest block's width, the blocks one after the other.
    :meth:`Rollout.select` is the inverse. The new padding is ``-1`` (unknown, as the
    sampler's padding is; the trainer's pass fills it), or with ``complete`` (a trainer pass's
    record, which holds every position's experts, padding's too, and is replayed as it is)
    experts ``0 … k-1``: any valid choice, since a padding position's output reaches no real
    token (right padding, causal attention) and the load-balancing loss masks it."""
    widths = [r[0].shape[0] // n if n else 0 for r, n in zip(records, rows)]
    t = max(widths, default=0)
    joined = []
    for layer in range(len(records[0])):
        blocks = []
        for record, n, w in zip(records, rows, widths):
            if n == 0:
                continue
            x = record[layer].view(n, w, -1)
            if w < t:
                pad = (torch.arange(x.shape[-1]).expand(n, t - w, -1).to(x) if complete
                       else x.new_full((n, t - w, x.shape[-1]), -1))
                x = torch.cat([x, pad], dim=1)
            blocks.append(x)
        k = records[0][layer].shape[-1]
        joined.append(torch.cat(blocks).reshape(-1, k) if blocks
                      else records[0][layer].new_empty((0, k)))
    return joined


def policy_tokens(response_ids: list[list[int]],
                  model_mask: list[list[int]] | None = None) -> list[int]:
    """Each response's tokens the policy sampled, EOS included: all of them, or with a
    multi-turn observation mask the ones it marks as the policy's (what a reward function that
    names ``response_tokens`` gets, in training and in evaluation)."""
    if model_mask is None:
        return [len(r) for r in response_ids]
    return [sum(m) for m in model_mask]


def share(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[lo, hi)``: the ``index``-th of ``parts`` contiguous shares of ``n`` items, the first
    ``n % parts`` one larger (a torchrun rank's prompts; an engine's part of a request)."""
    base, extra = divmod(n, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (index < extra)


def pad_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int,
              logprobs: list[torch.Tensor] | None = None,
              model_mask: list[list[bool]] | None = None) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask``, ``response_mask`` (and ``old_logprobs``).

    ``model_mask`` (see :class:`Rollout`): ``response_mask`` is 1 only on the response tokens
    the policy sampled, so observation tokens are fed to the model but never scored.

    Right padding keeps every real token at the same position id as in an unpadded pass, which
    is what keeps trainer and sampler log-probs equal to fp32 rounding.
    """
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    n, t = len(lengths), max(lengths)
    input_ids = torch.full((n, t), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, t), dtype=torch.long)
    response_mask = torch.zeros((n, t), dtype=torch.float32)
    old = torch.zeros((n, t), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        attention_mask[i, : len(p) + len(r)] = 1
        response_mask[i, len(p): len(p) + len(r)] = (
            1.0 if model_mask is None else torch.tensor(model_mask[i], dtype=torch.float32))
        if logprobs is not None and len(r):
            old[i, len(p): len(p) + len(r)] = logprobs[i]
    out = {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask}
    if logprobs is not None:
        out["old_logprobs"] = old
    return out
