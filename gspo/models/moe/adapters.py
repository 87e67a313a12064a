"""Per-family MoE adapters: how to find a family's routers and recompute its gate weights.

This package works with the transformers 5.x MoE implementations in which every MoE block owns
a router module (``<Family>TopKRouter``) returning ``(router_logits, router_scores,
router_indices)`` and the experts consume only ``router_scores`` and ``router_indices``.

Supported families (``SUPPORTED_MOE``) and how replay recomputes the gate weights at the
replayed indices ``idx`` from the current logits ``z`` (identical to each family's router):

* ``qwen3_moe`` / ``olmoe`` / ``qwen2_moe``: ``p = softmax(z, dtype=float32)``,
  ``w = p.gather(idx)``, ``w /= w.sum(-1)`` if the router's ``norm_topk_prob``, then ``w`` is cast
  back to ``z.dtype``.  (Qwen2-MoE's sigmoid shared-expert gate does not depend on routing and is
  left untouched.)
* ``mixtral``: ``p = softmax(z.float())``, ``w = p.gather(idx)``, ``w /= w.sum(-1)`` (always
  renormalised) and kept in float32, as Mixtral's router does.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["SUPPORTED_MOE", "GateFn", "MoEAdapter", "is_moe", "moe_adapter", "router_modules"]

GateFn = Callable[[nn.Module, Tensor, Tensor], Tensor]


# --------------------------------------------------------------------------------------------
# Per-family gate-weight recomputation
# --------------------------------------------------------------------------------------------


def _softmax_then_topk_gate(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """Gate weights of Qwen3-MoE / OLMoE / Qwen2-MoE routers at given expert ``indices``.

    Mirrors ``softmax(logits, dtype=float)`` -> take the top-k probabilities -> optionally
    renormalise them (``router.norm_topk_prob``) -> cast to ``logits.dtype``.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top = probs.gather(-1, indices)
    if getattr(router, "norm_topk_prob", False):
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype)


def _mixtral_gate(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """Gate weights of the Mixtral router at given expert ``indices``.

    Mirrors ``softmax(logits.float())`` -> top-k probabilities -> always renormalised; the result
    stays float32 (Mixtral does not cast back).
    """
    probs = torch.softmax(logits.float(), dim=-1)
    top = probs.gather(-1, indices)
    return top / top.sum(dim=-1, keepdim=True)


@dataclass(frozen=True)
class MoEAdapter:
    """How to find and replay the routers of one transformers MoE family.

    Attributes:
        model_type: ``config.model_type`` of the family.
        router_class_name: class name of the router module (hooked by capture/replay).
        modeling_module: transformers module defining the router class and the family's
            ``load_balancing_loss_func``.
        gate_weights: ``(router, current_logits [N, E], indices [N, k]) -> weights [N, k]``,
            the family's own gate-weight computation evaluated at the given indices.
        config_class_name: name of the family's config class in ``transformers``.
    """

    model_type: str
    router_class_name: str
    modeling_module: str
    gate_weights: GateFn
    config_class_name: str

    def router_class(self) -> type[nn.Module] | None:
        """The router class, or ``None`` if this transformers version does not have it."""
        try:
            module = importlib.import_module(self.modeling_module)
        except ImportError:
            return None
        return getattr(module, self.router_class_name, None)

    def is_router(self, module: nn.Module) -> bool:
        """Whether ``module`` is a router of this family (by class, or by class name)."""
        cls = self.router_class()
        if cls is not None and isinstance(module, cls):
            return True
        return type(module).__name__ == self.router_class_name


SUPPORTED_MOE: dict[str, MoEAdapter] = {
    "qwen3_moe": MoEAdapter(
        model_type="qwen3_moe",
        router_class_name="Qwen3MoeTopKRouter",
        modeling_module="transformers.models.qwen3_moe.modeling_qwen3_moe",
        gate_weights=_softmax_then_topk_gate,
        config_class_name="Qwen3MoeConfig",
    ),
    "mixtral": MoEAdapter(
        model_type="mixtral",
        router_class_name="MixtralTopKRouter",
        modeling_module="transformers.models.mixtral.modeling_mixtral",
        gate_weights=_mixtral_gate,
        config_class_name="MixtralConfig",
    ),
    "olmoe": MoEAdapter(
        model_type="olmoe",
        router_class_name="OlmoeTopKRouter",
        modeling_module="transformers.models.olmoe.modeling_olmoe",
        gate_weights=_softmax_then_topk_gate,
        config_class_name="OlmoeConfig",
    ),
    "qwen2_moe": MoEAdapter(
        model_type="qwen2_moe",
        router_class_name="Qwen2MoeTopKRouter",
        modeling_module="transformers.models.qwen2_moe.modeling_qwen2_moe",
        gate_weights=_softmax_then_topk_gate,
        config_class_name="Qwen2MoeConfig",
    ),
}

# Config attributes that signal a Mixture-of-Experts model in families we do not support.
_MOE_CONFIG_ATTRS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_MOE_CLASS_MARKERS = ("router", "sparsemoe", "moeblock", "moelayer", "topkgate")


# --------------------------------------------------------------------------------------------
# Detection
# --------------------------------------------------------------------------------------------


def _configs(model: nn.Module) -> list[Any]:
    """The model's config and, for composite models, its text config."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    out = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            text = get_text()
        except Exception:  # odd configs: fall back to the top-level one
            text = None
        if text is not None and text is not config:
            out.append(text)
    return out


def _model_types(model: nn.Module) -> list[str]:
    return [mt for c in _configs(model) if (mt := getattr(c, "model_type", None))]


def _supported_type(model: nn.Module) -> str | None:
    for mt in _model_types(model):
        if mt in SUPPORTED_MOE:
            return mt
    return None


def _looks_moe(model: nn.Module) -> bool:
    """Heuristic MoE detection for families without an adapter."""
    for config in _configs(model):
        for attr in _MOE_CONFIG_ATTRS:
            try:
                value = getattr(config, attr, None)
            except Exception:  # attribute_map indirections may raise
                value = None
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                return True
    for module in model.modules():
        name = type(module).__name__.lower()
        if any(marker in name for marker in _MOE_CLASS_MARKERS):
            return True
    return False


def is_moe(model: nn.Module) -> bool:
    """Whether ``model`` is a Mixture-of-Experts model (supported by this module or not).

    A supported family counts as MoE only if it actually contains router modules (e.g. a
    Qwen2-MoE config with ``num_experts=0`` builds a dense model).
    """
    model_type = _supported_type(model)
    if model_type is not None:
        adapter = SUPPORTED_MOE[model_type]
        return any(adapter.is_router(m) for m in model.modules())
    return _looks_moe(model)


def has_routers(model: nn.Module) -> bool:
    """Whether ``model`` is an MoE model whose routers capture and replay can hook."""
    return _supported_type(model) is not None and is_moe(model)


def moe_adapter(model: nn.Module) -> MoEAdapter:
    """The :class:`MoEAdapter` for ``model``.

    Raises:
        ValueError: if ``model`` is an MoE model of a family without routing-replay support, or
            is not an MoE model at all.
    """
    model_type = _supported_type(model)
    if model_type is not None:
        return SUPPORTED_MOE[model_type]
    types = _model_types(model)
    shown = types[0] if types else type(model).__name__
    supported = ", ".join(sorted(SUPPORTED_MOE))
    if _looks_moe(model):
        raise ValueError(
            f"routing replay does not support model_type '{shown}' (supported: {supported})"
        )
    raise ValueError(
        f"model_type '{shown}' is not a Mixture-of-Experts model; routing capture/replay only "
        f"applies to MoE models (supported: {supported})"
    )


def router_modules(model: nn.Module) -> list[nn.Module]:
    """The router modules of ``model`` in layer order (one per MoE layer).

    Dense layers of partially sparse models (``mlp_only_layers``, ``decoder_sparse_step``) have
    no router and are skipped, so index ``i`` of every routing list refers to the ``i``-th MoE
    layer, not the ``i``-th decoder layer.
    """
    adapter = moe_adapter(model)
    return [m for m in model.modules() if adapter.is_router(m)]
