"""The policy's MoE side of a training step, as one object: :class:`MoEHooks` for a supported
Mixture-of-Experts policy, :data:`NO_MOE` (a :class:`PolicyHooks`, every method a no-op) for a
dense one, and for an MoE family that :mod:`gspo.models.moe` has no adapter for (its routers
cannot be hooked: it trains without routing metrics and replay).

What it covers, phase by phase:

* rollout: whether the engine must record the experts it routed to (routing replay R3);
* π_old pass: recording π_old's expert choices (what R2 replays and what the routing-change
  metric compares with), and for R3 merging the rollout's choices in
  (``moe/rollout_routing_mismatch``);
* update: per minibatch, replay of the recorded experts, capture of π_θ's own choices, the
  router load-balancing loss, and the ``moe/routing_change`` stats; per step,
  ``moe/routing_change_after_update``.

Recorded routing indexes the plain ``(B, T)`` layout of the batch, also when the log-prob pass
packs shared prompts (:func:`gspo.models.moe.packed_routing` translates). An MoE policy always
runs the π_old pass: only that pass records π_old's routing.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch

from gspo.config import ConfigError, MoEConfig
from gspo.models.moe import (
    SUPPORTED_MOE,
    capture_routing,
    expert_change,
    has_routers,
    is_moe,
    load_balancing_loss,
    merge_rollout_routing,
    moe_adapter,
    replay_routing,
    router_modules,
    routing_change,
    select_sequences,
    translated,
)
from gspo.rollout import EngineCapabilities

_CHANGE = "moe/routing_change"
_EXPERTS = "moe/expert_change"


class PolicyHooks:
    """The interface, and the hooks of a dense policy: nothing recorded, replayed or added."""

    active = False
    records_rollout_routing = False
    stat_kinds: Mapping[str, str] = MappingProxyType({})  # reduction of each stat it adds

    def param_groups(self, model: Any, lr: float) -> list[dict[str, Any]]:
        """The optimizer's parameter groups: the trainable parameters at ``lr``."""
        return [{"params": [p for p in model.parameters() if p.requires_grad], "lr": lr}]

    def capture_old(self, model: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext(None)

    def rollout_routing(self, roll: Any, recomputed: list[torch.Tensor] | None, dist: Any
                        ) -> tuple[list[torch.Tensor] | None, dict[str, float]]:
        return recomputed, {}

    def old_pass_replay(self, own: list[torch.Tensor] | None,
                        replayed: list[torch.Tensor] | None, dist: Any
                        ) -> list[torch.Tensor] | None:
        return None

    def update_forward(self, model: Any, routing: list[torch.Tensor] | None, rows: torch.Tensor,
                       seq_len: int, width: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext({})

    def extra_loss(self, model: Any, out: dict[str, Any], attention_mask: torch.Tensor
                   ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        return None, {}

    def step_stats(self, out: dict[str, Any], response_mask: torch.Tensor, *,
                   all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
                   ) -> dict[str, torch.Tensor]:
        """One minibatch step's stats. ``all_reduce`` (torchrun): sums a tensor over ranks, for
        stats that are not a mean over rows (every rank calls it, the same number of times)."""
        return {}

    def step_metrics(self, stats: list[dict[str, torch.Tensor]],
                     counts: list[dict[str, float]] | None = None) -> dict[str, float]:
        """Metrics over the step's minibatch ``stats`` (``counts``: each one's, as
        :func:`gspo.trainer.metrics.mean_stats` takes them)."""
        return {}


NO_MOE = PolicyHooks()


def _innermost(module: torch.nn.Module) -> torch.nn.Module:
    """The module a PEFT layer wraps (nested wrappers: the innermost), else ``module``."""
    while isinstance(getattr(module, "base_layer", None), torch.nn.Module):
        module = module.base_layer
    return module


class MoEHooks(PolicyHooks):
    """Routing replay (R2/R3), the routing-change metric and the load-balancing loss of a
    supported MoE policy, configured by ``moe.*``."""

    active = True

    def __init__(self, model: Any, cfg: MoEConfig) -> None:
        moe_adapter(model)  # raises for an MoE family without router hooks
        self.cfg = cfg
        self.records_rollout_routing = cfg.routing_replay == "r3"
        n_layers = len(router_modules(model))
        # Means over response tokens, except the loss, which is each rank's own (see metrics).
        # moe/load_imbalance is the same global value on every rank (loads summed over ranks):
        # a mean over minibatches like the others (as "max" it was the step's worst minibatch)
        self.stat_kinds = {_CHANGE: "tokens", "moe/load_balancing_loss": "rank",
                           _EXPERTS: "tokens", "moe/router_entropy": "tokens",
                           "moe/load_imbalance": "tokens",
                           **{f"{_CHANGE}_layer{i}": "tokens" for i in range(n_layers)},
                           **{f"{_EXPERTS}_layer{i}": "tokens" for i in range(n_layers)}}

    def param_groups(self, model: Any, lr: float) -> list[dict[str, Any]]:
        """One group at ``lr``, or with ``moe.router_lr_scale`` ≠ 1 two: the routers'
        trainable parameters at ``lr × router_lr_scale``, the rest at ``lr``. The scale moves
        routing per update (the paper's ~10% of experts replaced, Sec. 5.3, arises at a
        small lr on a large model) without moving the rest of the policy as fast."""
        scale = self.cfg.router_lr_scale
        if scale == 1:
            return super().param_groups(model, lr)
        found = {id(m) for m in router_modules(model)}
        routers = {id(p) for m in model.modules() if id(_innermost(m)) in found
                   for p in m.parameters()}  # a LoRA router: its wrapper's adapter too
        mine = [p for p in model.parameters() if p.requires_grad and id(p) in routers]
        if not mine:
            raise ConfigError("moe.router_lr_scale: the policy's routers have no trainable "
                              "parameters (a LoRA policy whose lora.target_modules leave "
                              "them out); leave it at 1")
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in routers]
        return [{"params": rest, "lr": lr}, {"params": mine, "lr": lr * scale}]

    def capture_old(self, model: Any) -> contextlib.AbstractContextManager:
        return capture_routing(model)

    def rollout_routing(self, roll: Any, recomputed: list[torch.Tensor] | None, dist: Any
                        ) -> tuple[list[torch.Tensor] | None, dict[str, float]]:
        """R3: the rollout's expert choices where it saw the token, π_old's recompute (R2)
        elsewhere, and ``moe/rollout_routing_mismatch`` over the global batch (see
        :func:`merge_rollout_routing`). Other modes: ``recomputed``."""
        if not self.records_rollout_routing or recomputed is None:
            return recomputed, {}
        merged, changed, seen = merge_rollout_routing(roll, recomputed)
        changed, seen = dist.all_reduce(torch.stack([changed, seen])).tolist()
        return merged, {"moe/rollout_routing_mismatch": changed / max(seen, 1.0)}

    def old_pass_replay(self, own: list[torch.Tensor] | None,
                        replayed: list[torch.Tensor] | None, dist: Any
                        ) -> list[torch.Tensor] | None:
        """R3: the experts to run the loss's π_old pass again with, so that π_old and π_θ route
        alike (the ratio is 1 at θ = θ_old): ``replayed`` (the rollout's experts merged with the
        pass's ``own``, what the update replays) when it differs from ``own`` on some rank (all
        ranks agree: the pass may gather weights), else None (the pass's own log-probs are
        already those: replaying its own experts is bit-identical). Other modes: None."""
        if not self.records_rollout_routing or own is None or replayed is None:
            return None
        differs = any(not torch.equal(a, b.to(a.device)) for a, b in zip(own, replayed))
        if float(dist.all_reduce(torch.tensor([float(differs)]))[0]) == 0:
            return None
        return replayed

    @contextlib.contextmanager
    def update_forward(self, model: Any, routing: list[torch.Tensor] | None, rows: torch.Tensor,
                       seq_len: int, width: int) -> Iterator[dict[str, Any]]:
        """A training forward over ``rows`` (cut to ``width``) with replay of their recorded
        experts (``moe.routing_replay`` on); yields a dict filled on exit: ``"routing"`` (the
        rows' recorded experts), ``"natural"`` (per layer [N, k], the experts the current
        router would pick: the top-k of its logits, also under replay) and ``"live_logits"``
        (router logits with gradient, for the load-balancing loss)."""
        mine = None
        if routing is not None:
            mine = [r.view(len(rows), seq_len, -1)[:, :width].reshape(-1, r.shape[-1])
                    for r in select_sequences(routing, seq_len, rows)]
        replay = mine if self.cfg.routing_replay != "off" else None
        want_logits = mine is not None and self.cfg.log_routing_change
        with moe_forward(model, replay, want_logits, self.cfg.aux_loss_coef > 0) as out:
            out["routing"] = mine
            yield out

    def extra_loss(self, model: Any, out: dict[str, Any], attention_mask: torch.Tensor
                   ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """``moe.aux_loss_coef`` × the router load-balancing loss of this forward."""
        if not out.get("live_logits"):
            return None, {}
        lb = aux_loss(model, out["live_logits"], attention_mask)
        return self.cfg.aux_loss_coef * lb, {"moe/load_balancing_loss": lb.detach()}

    def step_stats(self, out: dict[str, Any], response_mask: torch.Tensor, *,
                   all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
                   ) -> dict[str, torch.Tensor]:
        if out.get("natural") is None:
            return {}
        stats = routing_change_stats(out["routing"], out["natural"], response_mask)
        rec = out.get("recorder")
        if rec is not None and rec.logits:
            stats.update(router_state_stats(rec.logits, out["natural"], response_mask,
                                            all_reduce=all_reduce))
        return stats

    def step_metrics(self, stats: list[dict[str, torch.Tensor]],
                     counts: list[dict[str, float]] | None = None) -> dict[str, float]:
        """``moe/routing_change_after_update``: the routing change over the minibatches that run
        after at least one optimizer step on their rollout batch (the first one always
        measures 0). Given ``counts``, a minibatch without a valid row adds nothing (its stats
        are placeholders), as in :func:`gspo.trainer.metrics.mean_stats`."""
        if len(stats) < 2 or _CHANGE not in stats[0]:
            return {}
        keys = [k for k in stats[0] if k.startswith((_CHANGE, _EXPERTS))]
        after = [s for i, s in enumerate(stats[1:], 1)
                 if counts is None or counts[i]["rows"] > 0]
        if not after:
            return {f"{k}_after_update": 0.0 for k in keys}
        return {f"{k}_after_update": float(torch.stack(
            [s[k].detach().float() for s in after]).mean()) for k in keys}


def policy_hooks(model: Any, cfg: MoEConfig, caps: EngineCapabilities, *,
                 engine: str = "", name: str = "the policy") -> PolicyHooks:
    """The hooks for ``model``: :class:`MoEHooks` for a supported MoE policy, :data:`NO_MOE`
    for a dense one and for an MoE family without an adapter in :mod:`gspo.models.moe` (it
    trains like a dense policy: no routing metrics, no replay); MoE options on a dense model,
    options that hook the routers (replay, aux loss, router lr, routing-change logging) on an
    MoE family without an adapter, or R3 with an engine that cannot record routing, are a
    :class:`ConfigError` (``engine``, ``name``: the engine's and the model's names, for the
    message)."""
    if not is_moe(model):
        if (cfg.routing_replay != "off" or cfg.aux_loss_coef > 0 or cfg.router_lr_scale != 1
                or not cfg.log_routing_change):
            raise ConfigError("moe.routing_replay / moe.aux_loss_coef / moe.router_lr_scale / "
                              f"moe.log_routing_change need a Mixture-of-Experts model; {name} "
                              "is dense")
        return NO_MOE
    if not has_routers(model):
        asked = [opt for opt, on in (
            (f"moe.routing_replay={cfg.routing_replay}", cfg.routing_replay != "off"),
            (f"moe.aux_loss_coef={cfg.aux_loss_coef:g}", cfg.aux_loss_coef > 0),
            (f"moe.router_lr_scale={cfg.router_lr_scale:g}", cfg.router_lr_scale != 1),
            ("moe.log_routing_change=false", not cfg.log_routing_change)) if on]
        if asked:
            family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
            raise ConfigError(f"{', '.join(asked)}: {name} is a Mixture-of-Experts model of "
                              f"family '{family}', whose routers gspo cannot hook (supported: "
                              f"{', '.join(sorted(SUPPORTED_MOE))})")
        return NO_MOE
    if cfg.routing_replay == "r3" and caps.routing_unsupported:
        raise ConfigError("moe.routing_replay=r3 needs rollout-recorded routing, which "
                          f"rollout.engine={engine} cannot return here: "
                          f"{caps.routing_unsupported}; use r2 or rollout.engine=hf")
    return MoEHooks(model, cfg)


@contextlib.contextmanager
def moe_forward(model: Any, replay: list[torch.Tensor] | None, want_logits: bool,
                aux: bool) -> Iterator[dict[str, Any]]:
    """Run a training forward with optional replay; collect π_θ's own expert choices
    (``"natural"``) and, with ``aux``, the router logits with gradient (``"live_logits"``)."""
    out: dict[str, Any] = {"live_logits": []}
    hooks = []
    if aux:
        routers = router_modules(model)
        record = translated(lambda _layer, logits: out["live_logits"].append(logits),
                            len(routers))

        def keep(layer: int) -> Any:
            return lambda module, _i, output: record(layer, module, output[0])
        hooks = [r.register_forward_hook(keep(i)) for i, r in enumerate(routers)]
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
    """Over the response tokens, overall and per layer: ``moe/routing_change`` (share of
    (token, layer) whose expert set changed) and ``moe/expert_change`` (share of π_old's k
    experts replaced, the paper's "experts that differ", arXiv:2507.18071 v2, Sec. 5.3)."""
    res = routing_change(old, new, token_mask.reshape(-1))
    stats = {_CHANGE: res["overall"].detach()}
    for i, v in enumerate(res["per_layer"]):
        stats[f"{_CHANGE}_layer{i}"] = v.detach()
    experts = expert_change([o.cpu() for o in old], [n.cpu() for n in new],
                            token_mask.reshape(-1).cpu())
    stats[_EXPERTS] = experts.mean()
    for i, v in enumerate(experts):
        stats[f"{_EXPERTS}_layer{i}"] = v
    return stats


def router_state_stats(logits: list[torch.Tensor], chosen: list[torch.Tensor],
                       token_mask: torch.Tensor, *,
                       all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
                       ) -> dict[str, torch.Tensor]:
    """The router's state over the response tokens, averaged over MoE layers:
    ``moe/router_entropy``, the entropy of softmax(router logits) divided by log E (1: uniform,
    0: one expert), and ``moe/load_imbalance``, max_e load_e / mean_e load_e over the routed
    (token, slot) pairs of the experts the router picks (``chosen``) (1: balanced, E/k: every
    token on the same k experts). ``all_reduce`` (torchrun): the loads are summed over ranks
    first, so the imbalance is the global batch's (each rank's own is larger: fewer tokens)."""
    w = token_mask.reshape(-1).detach().to("cpu", torch.float)
    total = w.sum().clamp(min=1.0)
    ent, loads = [], []
    for z, idx in zip(logits, chosen, strict=True):
        z = z.detach().to("cpu", torch.float)
        logp = torch.log_softmax(z, dim=-1)
        h = -(logp.exp() * logp).sum(-1) / max(math.log(z.shape[-1]), 1e-12)
        ent.append((h * w).sum() / total)
        loads.append(torch.zeros(z.shape[-1]).index_add_(
            0, idx.cpu().reshape(-1), w.repeat_interleave(idx.shape[-1])))
    if all_reduce is not None:
        loads = list(all_reduce(torch.cat(loads)).split([len(x) for x in loads]))
    imb = [load.max() / load.mean().clamp(min=1e-12) for load in loads]
    return {"moe/router_entropy": torch.stack(ent).mean(),
            "moe/load_imbalance": torch.stack(imb).mean()}


def aux_loss(model: Any, live_logits: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    adapter = moe_adapter(model)
    cfg = model.config
    top_k = getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "top_k", 2)
    n_experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    return load_balancing_loss(live_logits, top_k, n_experts, mask, family=adapter.model_type)
