"""MoE pieces of a policy update: routing replay, routing-change metric, load-balancing loss.

Only used when the policy is a Mixture-of-Experts model (see :mod:`gspo.models.moe`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from gspo.models.moe import (
    capture_routing,
    expert_set_changed,
    load_balancing_loss,
    moe_adapter,
    replay_routing,
    router_modules,
    routing_change,
)


@contextlib.contextmanager
def moe_forward(model: Any, replay: list[torch.Tensor] | None, want_logits: bool,
                aux: bool) -> Iterator[dict[str, Any]]:
    """Run a training forward with optional replay; collect π_θ's own expert choices.

    Yields a dict filled on exit of the forward: ``"natural"`` (per layer [N, k] indices that
    the current router would pick: the top-k of its logits, also under replay) and
    ``"live_logits"`` (router logits with gradient, for the load-balancing loss).
    """
    out: dict[str, Any] = {"live_logits": []}
    hooks = []
    if aux:
        def keep(_m: Any, _i: Any, output: Any) -> None:
            out["live_logits"].append(output[0])
        hooks = [r.register_forward_hook(keep) for r in router_modules(model)]
    replay_ctx = replay_routing(model, replay) if replay is not None else contextlib.nullcontext()
    capture_ctx = (capture_routing(model, record_logits=True) if want_logits
                   else contextlib.nullcontext())
    try:
        with replay_ctx, capture_ctx as rec:
            out["recorder"] = rec
            yield out
    finally:
        for h in hooks:
            h.remove()
    if want_logits and rec is not None and rec.logits:
        k = rec.indices[0].shape[-1]
        out["natural"] = [lg.topk(k, dim=-1).indices for lg in rec.logits]


def routing_change_stats(old: list[torch.Tensor], new: list[torch.Tensor],
                         token_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``moe/routing_change`` overall and per layer, over the response tokens."""
    res = routing_change(old, new, token_mask.reshape(-1))
    stats = {"moe/routing_change": res["overall"].detach()}
    for i, v in enumerate(res["per_layer"]):
        stats[f"moe/routing_change_layer{i}"] = v.detach()
    return stats


def aux_loss(model: Any, live_logits: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    adapter = moe_adapter(model)
    cfg = model.config
    top_k = getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "top_k", 2)
    n_experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    return load_balancing_loss(live_logits, top_k, n_experts, mask, family=adapter.model_type)


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


def routing_change_after_update(stats: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """``moe/routing_change_after_update``: the routing change over the minibatches that run
    after at least one optimizer step on their rollout batch (the first one always measures 0)."""
    from gspo.trainer.metrics import mean_stats

    key = "moe/routing_change"
    if len(stats) < 2 or key not in stats[0]:
        return {}
    return {f"{key}_after_update": mean_stats(stats[1:])[key]}
