"""Routing drift between two routings, and the load-balancing auxiliary loss.

Every comparison of expert sets goes through :func:`kept_experts`: top-k indices within a row
are distinct, so a row's expert set is unchanged exactly when all of ``old``'s experts are
still in ``new``, and the share of ``old``'s experts that ``new`` replaced is the share not kept.

:func:`merge_rollout_routing` (routing replay R3) lives here, where both its users may import
it: the trainer's π_old pass and the async engine process's pass on the behaviour weights.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gspo.models.moe.adapters import SUPPORTED_MOE

__all__ = [
    "expert_change",
    "expert_set_changed",
    "kept_experts",
    "load_balancing_loss",
    "merge_rollout_routing",
    "routing_change",
]


def kept_experts(old: Tensor, new: Tensor) -> Tensor:
    """Which of the experts ``old`` chose are still chosen by ``new``.

    Args:
        old: ``[N, k]`` expert indices of one MoE layer (distinct within a row, as top-k gives).
        new: ``[N, k]`` expert indices of the same tokens, in any order within a row.

    Returns:
        Bool ``[N, k]``: entry ``(n, j)`` is whether ``old[n, j]`` appears in ``new[n]``.
    """
    return (old[:, :, None] == new[:, None, :]).any(-1)


def expert_set_changed(old: Tensor, new: Tensor) -> Tensor:
    """Bool ``[N]``: whether the top-k expert *set* of a token differs (order ignored).

    ``old`` and ``new`` are ``[N, k]`` with distinct indices within a row, so equal sets means
    every expert of ``old`` is kept.
    """
    return ~kept_experts(old, new).all(-1)


def expert_change(old: Sequence[Tensor], new: Sequence[Tensor], mask: Tensor) -> Tensor:
    """Per MoE layer ``[L]``: share of the k experts chosen under π_old that the new routing no
    longer chooses, averaged over masked tokens (the paper's "experts that differ").

    ``old`` / ``new``: per layer ``[N, k]`` indices; ``mask``: ``N`` elements (e.g. ``[B, T]``),
    float values act as weights; an empty mask gives zeros.
    """
    w = mask.detach().reshape(-1).to("cpu", torch.float)  # on the CPU, as routing_change
    total = w.sum()
    out = []
    for a, b in zip(old, new, strict=True):
        kept = kept_experts(a.detach().cpu(), b.detach().cpu()).float().mean(-1)  # [N]
        out.append(((1 - kept) * w).sum() / total if total > 0 else torch.zeros(()))
    return torch.stack(out)


def routing_change(
    old: Sequence[Tensor], new: Sequence[Tensor], token_mask: Tensor | None = None
) -> dict[str, Tensor]:
    """How often the top-k expert *set* of a token changed between two routings.

    Args:
        old: per MoE layer, ``[N, k]`` expert indices (e.g. recorded under ``pi_old``).
        new: same layout, e.g. recorded with the current weights without replay.
        token_mask: optional ``[N]`` (or any shape with ``N`` elements, e.g. ``[B, T]``) bool or
            float mask over the flattened positions; non-zero entries are counted, float values
            act as weights. ``None`` counts every position.

    Returns:
        ``per_layer``: float Tensor ``[L]``, (weighted) fraction of masked tokens whose expert set
        differs (order inside the top-k is ignored); ``overall``: 0-dim Tensor, mean over
        (token, layer) = mean of ``per_layer``; ``n_tokens``: 0-dim Tensor, masked token count
        (weight sum).  An empty mask gives zeros.
    """
    if len(old) != len(new):
        raise ValueError(f"routing_change: {len(old)} old layers vs {len(new)} new layers")
    if len(old) == 0:
        zero = torch.zeros(())
        return {"per_layer": torch.zeros(0), "overall": zero, "n_tokens": zero}
    n = old[0].shape[0]
    weights: Tensor | None = None
    if token_mask is not None:
        if token_mask.numel() != n:
            raise ValueError(
                f"routing_change: token_mask has {token_mask.numel()} elements, expected {n}"
            )
        weights = token_mask.detach().reshape(-1).to("cpu", torch.float)
    per_layer = []
    for layer, (a, b) in enumerate(zip(old, new, strict=True)):
        if a.shape != b.shape or a.shape[0] != n:
            raise ValueError(
                f"routing_change: layer {layer} shapes {tuple(a.shape)} vs {tuple(b.shape)} "
                f"(expected [{n}, k] for both)"
            )
        changed = expert_set_changed(a.detach().cpu(), b.detach().cpu()).float()
        if weights is None:
            total = float(n)
            frac = changed.sum() / total if n else torch.zeros(())
        else:
            total_t = weights.sum()
            frac = (changed * weights).sum() / total_t if total_t > 0 else torch.zeros(())
        per_layer.append(frac)
    per_layer_t = torch.stack(per_layer)
    n_tokens = torch.tensor(float(n)) if weights is None else weights.sum()
    return {"per_layer": per_layer_t, "overall": per_layer_t.mean(), "n_tokens": n_tokens}


# --------------------------------------------------------------------------------------------
# Load-balancing auxiliary loss
# --------------------------------------------------------------------------------------------


def load_balancing_loss(
    router_logits: Sequence[Tensor],
    top_k: int,
    n_experts: int,
    mask: Tensor | None = None,
    *,
    family: str = "qwen3_moe",
) -> Tensor:
    """Switch-Transformer load-balancing loss via transformers' ``load_balancing_loss_func``.

    A thin wrapper around the function shipped in the family's modeling module (it is not
    re-implemented here).  The caller multiplies it by its own coefficient (0 by default in
    gspo).  ``router_logits`` are the per-layer ``[B*T, n_experts]`` logits, e.g.
    ``model(..., output_router_logits=True).router_logits`` (these carry gradients).

    Args:
        router_logits: per MoE layer router logits ``[N, n_experts]``.
        top_k: experts per token.
        n_experts: number of routed experts.
        mask: optional ``[B, T]`` or ``[N]`` attention mask; padding rows are excluded.
        family: which supported family's implementation to use.

    Returns:
        0-dim Tensor (zero if ``router_logits`` is empty).

    Raises:
        ValueError: unknown family; ImportError: transformers lacks the function.
    """
    if family not in SUPPORTED_MOE:
        raise ValueError(
            f"load_balancing_loss: unknown family '{family}' (supported: "
            f"{', '.join(sorted(SUPPORTED_MOE))})"
        )
    module = importlib.import_module(SUPPORTED_MOE[family].modeling_module)
    fn = getattr(module, "load_balancing_loss_func", None)
    if fn is None:
        raise ImportError(f"{module.__name__} has no load_balancing_loss_func")
    logits = tuple(router_logits)
    if not logits:
        return torch.zeros(())
    if mask is not None and mask.dim() == 1:
        mask = mask.unsqueeze(0)  # [1, N]: works with flat and [B, T]-shaped implementations
    out = fn(logits, num_experts=n_experts, top_k=top_k, attention_mask=mask)
    if not isinstance(out, Tensor):
        out = torch.tensor(float(out), device=logits[0].device)
    return out


def merge_rollout_routing(roll: Any, recomputed: list[torch.Tensor]
                          ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """R3: per MoE layer, the rollout's expert choices where it saw the token, else π_old's
    recompute (positions it never fed: padding and each row's final token); and the counts for
    ``moe/rollout_routing_mismatch``: (response token, layer) pairs the rollout saw whose expert
    set differs from the recompute (the train/inference routing gap R3 removes), and how many
    it saw. ``roll.routing`` and ``recomputed`` share the padded [N*T, k] layout of
    :func:`gspo.rollout.pad_batch`, with -1 where the rollout saw nothing."""
    if roll.routing is None:
        raise RuntimeError("moe.routing_replay=r3: the rollout engine returned no routing")
    shapes = [tuple(r.shape) for r in roll.routing], [tuple(r.shape) for r in recomputed]
    if shapes[0] != shapes[1]:
        raise RuntimeError(f"moe.routing_replay=r3: rollout routing shapes {shapes[0]} do "
                           f"not match the trainer's padded batch {shapes[1]}")
    response = torch.zeros(recomputed[0].shape[0], dtype=torch.bool)
    t = recomputed[0].shape[0] // max(len(roll), 1)
    for i, (p, r) in enumerate(zip(roll.prompt_ids, roll.response_ids)):
        response[i * t + len(p): i * t + len(p) + len(r)] = True
    merged, changed, seen = [], torch.zeros((), dtype=torch.float64), 0
    for rolled, old in zip(roll.routing, recomputed):
        rolled = rolled.to(old.device)
        known = (rolled >= 0).all(-1)
        merged.append(torch.where(known[:, None], rolled, old))
        sel = known & response.to(old.device)
        changed += expert_set_changed(old[sel], rolled[sel]).sum().double().cpu()
        seen += int(sel.sum())
    return merged, changed, torch.tensor(float(seen), dtype=torch.float64)
