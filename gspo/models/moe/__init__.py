"""Mixture-of-Experts support: routing capture, routing replay, routing drift and aux loss.

GSPO (arXiv:2507.18071) notes that with MoE models the experts activated for a token can change
between the policy that generated a rollout (``pi_old``) and the policy being optimised
(``pi_theta``), which makes token-level importance ratios noisy.  "Routing replay" fixes the
experts of ``pi_theta`` to the ones ``pi_old`` chose: the old routing is *recorded* once and
*replayed* in every later forward of the same batch, while the gate weights of the replayed
experts are recomputed from the *current* router logits so the router still learns.

Submodules, each importing only the ones before it:

* :mod:`~gspo.models.moe.adapters`: per-family adapters (router class, gate weights) and
  detection (:func:`is_moe`, :func:`moe_adapter`, :func:`router_modules`).
* :mod:`~gspo.models.moe.routing`: :func:`capture_routing`, :func:`replay_routing`,
  :func:`select_sequences`, the ``[B*T, k]`` layout contract and :func:`packed_routing`
  (forwards that run the batch in several router calls, as shared-prompt packing does).
* :mod:`~gspo.models.moe.metrics`: the expert-set comparison (:func:`kept_experts`),
  :func:`routing_change`, :func:`expert_change`, :func:`load_balancing_loss` and R3's
  :func:`merge_rollout_routing` (the rollout's experts merged with a recompute's).

Tiny MoE configs for tests live in :func:`gspo.models.tiny.tiny_moe_config`.
"""

from gspo.models.moe.adapters import (
    SUPPORTED_MOE,
    GateFn,
    MoEAdapter,
    has_routers,
    is_moe,
    moe_adapter,
    router_modules,
)
from gspo.models.moe.metrics import (
    expert_change,
    expert_set_changed,
    kept_experts,
    load_balancing_loss,
    merge_rollout_routing,
    routing_change,
)
from gspo.models.moe.routing import (
    PackedRouting,
    RoutingRecorder,
    RoutingReplayer,
    capture_routing,
    packed_routing,
    replay_routing,
    select_sequences,
    translated,
    unpack_router_output,
)

__all__ = [
    "SUPPORTED_MOE",
    "GateFn",
    "MoEAdapter",
    "PackedRouting",
    "RoutingRecorder",
    "RoutingReplayer",
    "capture_routing",
    "expert_change",
    "expert_set_changed",
    "has_routers",
    "is_moe",
    "kept_experts",
    "load_balancing_loss",
    "merge_rollout_routing",
    "moe_adapter",
    "packed_routing",
    "replay_routing",
    "router_modules",
    "routing_change",
    "select_sequences",
    "translated",
    "unpack_router_output",
]
