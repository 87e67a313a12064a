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
