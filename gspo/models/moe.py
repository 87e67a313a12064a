"""Mixture-of-Experts support: routing capture, routing replay, routing drift and aux loss.

GSPO (arXiv:2507.18071) notes that with MoE models the experts activated for a token can change
between the policy that generated a rollout (``pi_old``) and the policy being optimised
(``pi_theta``), which makes token-level importance ratios noisy.  "Routing replay" fixes the
experts of ``pi_theta`` to the ones ``pi_old`` chose: the old routing is *recorded* once and
*replayed* in every later forward of the same batch, while the gate weights of the replayed
experts are recomputed from the *current* router logits so the router still learns.

This module works with the transformers 5.x MoE implementations in which every MoE block owns a
router module (``<Family>TopKRouter``) returning ``(router_logits, router_scores, router_indices)``
and the experts consume only ``router_scores`` and ``router_indices``.  A forward hook on the
router can therefore record the indices (:func:`capture_routing`) or replace indices and scores
(:func:`replay_routing`).

Layout contract: a router sees the flattened hidden states of the whole forward, so indices are
``[N, k]`` with ``N = B * T`` (padding positions included, row-major over ``(batch, time)``).
Record and replay must use the same ``(B, T)`` layout (same padding side, same sequence length,
same row order); :func:`select_sequences` slices a recorded batch into minibatches.

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
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "SUPPORTED_MOE",
    "MoEAdapter",
    "RoutingRecorder",
    "RoutingReplayer",
    "capture_routing",
    "is_moe",
    "load_balancing_loss",
    "moe_adapter",
    "replay_routing",
    "router_modules",
    "routing_change",
    "select_sequences",
    "tiny_moe_config",
]

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


def _in_backward() -> bool:
    """True while the autograd engine runs (e.g. an activation-checkpoint recompute)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    if task_id is None:  # pragma: no cover - very old torch
        return False
    return task_id() != -1


def _unpack_router_output(output: Any, layer: int) -> tuple[Tensor, Tensor, Tensor]:
    if not (isinstance(output, tuple) and len(output) == 3):
        raise RuntimeError(
            f"router of MoE layer {layer} returned {type(output).__name__}; expected "
            "(router_logits, router_scores, router_indices) as in transformers 5.x"
        )
    return output  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# Capture
# --------------------------------------------------------------------------------------------


class RoutingRecorder:
    """Collects the expert indices (and optionally router logits) chosen by every router.

    Each forward appends one ``[N, k]`` chunk per MoE layer (``N = B * T`` of that forward).
    Several forwards inside one :func:`capture_routing` block are concatenated along ``N`` in
    call order, so :attr:`indices` of a block that ran minibatches of the same sequence length
    ``T`` equals the indices of one forward over the concatenated batch.  Use :meth:`take` to get
    one forward's routing and reset the recorder.

    Router calls made while the autograd engine runs (activation-checkpoint recomputation) are
    not recorded, so training-mode forwards with checkpointing are counted once.  Do not capture
    inside ``generate``: incremental decoding produces one chunk per step, not a ``(B, T)``
    layout; capture with one teacher-forced forward over the full sequences instead.
    """

    def __init__(
        self, routers: Sequence[nn.Module], device: torch.device | str | None, record_logits: bool
    ) -> None:
        self._top_k = [int(getattr(r, "top_k", 0)) for r in routers]
        self._device = torch.device(device) if device is not None else None
        self._record_logits = record_logits
        self._idx: list[list[Tensor]] = [[] for _ in routers]
        self._logits: list[list[Tensor]] = [[] for _ in routers]
        self.calls = 0
        """Number of (non-recompute) router calls seen, over all layers."""

    def _store(self, x: Tensor) -> Tensor:
        x = x.detach()
        return x.to(self._device) if self._device is not None else x

    def _record(self, layer: int, logits: Tensor, indices: Tensor) -> None:
        self.calls += 1
        self._idx[layer].append(self._store(indices).long())
        if self._record_logits:
            self._logits[layer].append(self._store(logits))

    @staticmethod
    def _cat(chunks: list[Tensor], width: int, dtype: torch.dtype) -> Tensor:
        if not chunks:
            return torch.empty((0, width), dtype=dtype)
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=0)

    @property
    def num_layers(self) -> int:
        """Number of MoE layers (routers) being recorded."""
        return len(self._idx)

    @property
    def indices(self) -> list[Tensor]:
        """Per MoE layer, a LongTensor ``[N, k]`` of chosen experts (``N`` summed over calls)."""
        return [self._cat(c, k, torch.long) for c, k in zip(self._idx, self._top_k, strict=True)]

    @property
    def logits(self) -> list[Tensor] | None:
        """Per MoE layer, the detached router logits ``[N, n_experts]``, if recorded."""
        if not self._record_logits:
            return None
        return [self._cat(c, 0, torch.float) for c in self._logits]

    def clear(self) -> None:
        """Forget everything recorded so far."""
        for chunks in (*self._idx, *self._logits):
            chunks.clear()

    def take(self) -> list[Tensor]:
        """Return :attr:`indices` and clear the recorder (logits are cleared too)."""
        out = self.indices
        self.clear()
        return out


@contextmanager
def capture_routing(
    model: nn.Module,
    *,
    device: torch.device | str | None = "cpu",
    record_logits: bool = False,
) -> Iterator[RoutingRecorder]:
    """Record the experts chosen by every router of ``model`` during forwards in the block.

    Args:
        model: a supported transformers MoE model (see :data:`SUPPORTED_MOE`).
        device: where recorded tensors are stored (``None`` keeps them on the model's device).
        record_logits: also keep the (detached) router logits in :attr:`RoutingRecorder.logits`.

    Yields:
        A :class:`RoutingRecorder`. Inside an active :func:`replay_routing` block the recorder
        sees the replayed indices (the ones the experts actually used).

    Raises:
        ValueError: if the model is not a supported MoE model.
    """
    routers = router_modules(model)
    recorder = RoutingRecorder(routers, device, record_logits)
    handles = []

    def make_hook(layer: int) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if _in_backward():
                return
            logits, _, indices = _unpack_router_output(output, layer)
            recorder._record(layer, logits, indices)

        return hook

    try:
        for layer, router in enumerate(routers):
            handles.append(router.register_forward_hook(make_hook(layer)))
        yield recorder
    finally:
        for h in handles:
            h.remove()


# --------------------------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------------------------

_ACTIVE_REPLAY: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class RoutingReplayer:
    """Handle yielded by :func:`replay_routing`; holds the indices replayed per MoE layer."""

    def __init__(self, indices: list[Tensor]) -> None:
        self.indices = indices
        self.calls = 0
        """Router calls replayed so far, over all layers (recomputes included)."""
        self._on_device: dict[tuple[int, torch.device], Tensor] = {}

    def _get(self, layer: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        key = (layer, device)
        cached = self._on_device.get(key)
        if cached is None or cached.dtype != dtype:
            cached = self.indices[layer].to(device=device, dtype=dtype)
            self._on_device[key] = cached
        return cached


@contextmanager
def replay_routing(model: nn.Module, indices: Sequence[Tensor]) -> Iterator[RoutingReplayer]:
    """Force every router of ``model`` to use the given expert indices during the block.

    For MoE layer ``i`` each router call returns ``indices[i]`` (shape ``[N, k]`` with ``N = B*T``
    of the forward) together with gate weights recomputed from the *current* router logits at
    those indices, using the family's own softmax / renormalisation / dtype (see module doc), so
    the router weights still receive gradients.  With unchanged weights and the same inputs the
    model output is bit-identical to the forward that recorded the indices.

    Every router call of a layer gets the same indices (keyed by module, not by call count), so
    several forwards over the same batch, and activation-checkpoint recomputation, all replay
    consistently.  Run ``loss.backward()`` *inside* the block when gradient checkpointing is on:
    a recompute after the block exits would route afresh.  For minibatches open one block per
    minibatch with :func:`select_sequences`.

    Args:
        model: a supported transformers MoE model.
        indices: one ``[N, k]`` integer tensor per MoE layer, e.g. ``RoutingRecorder.take()``.

    Yields:
        A :class:`RoutingReplayer`.

    Raises:
        ValueError: wrong number of layers, non-2D/out-of-range indices, or (during a forward) a
            router whose token count or top-k differs from the given indices.
        RuntimeError: if a replay block is already active on ``model``.
    """
    adapter = moe_adapter(model)
    routers = [m for m in model.modules() if adapter.is_router(m)]
    indices = list(indices)
    if len(indices) != len(routers):
        raise ValueError(
            f"replay_routing: got indices for {len(indices)} MoE layers but the model has "
            f"{len(routers)} routers"
        )
    for layer, (idx, router) in enumerate(zip(indices, routers, strict=True)):
        if not isinstance(idx, Tensor) or idx.dim() != 2:
            shape = tuple(idx.shape) if isinstance(idx, Tensor) else type(idx).__name__
            raise ValueError(f"replay_routing: layer {layer} indices must be [N, k], got {shape}")
        if idx.dtype.is_floating_point or idx.dtype == torch.bool:
            raise ValueError(
                f"replay_routing: layer {layer} indices must be integer, got {idx.dtype}"
            )
        n_experts = getattr(router, "num_experts", None)
        if (
            idx.numel()
            and n_experts is not None
            and (int(idx.min()) < 0 or int(idx.max()) >= int(n_experts))
        ):
            raise ValueError(f"replay_routing: layer {layer} indices out of range [0, {n_experts})")
    if model in _ACTIVE_REPLAY:
        raise RuntimeError("replay_routing: a replay block is already active on this model")

    replayer = RoutingReplayer(indices)
    gate_fn = adapter.gate_weights
    handles = []

    def make_hook(layer: int) -> Callable[[nn.Module, Any, Any], tuple[Tensor, Tensor, Tensor]]:
        def hook(module: nn.Module, args: Any, output: Any) -> tuple[Tensor, Tensor, Tensor]:
            logits, _, routed = _unpack_router_output(output, layer)
            expected = tuple(routed.shape)
            given = tuple(replayer.indices[layer].shape)
            if given != expected:
                raise ValueError(
                    f"replay_routing: MoE layer {layer} routes {expected[0]} tokens with "
                    f"top_k={expected[1]} (indices {expected}) but the replayed indices have "
                    f"shape {given}; record and replay need the same (B, T) layout"
                )
            idx = replayer._get(layer, routed.device, routed.dtype)
            replayer.calls += 1
            return logits, gate_fn(module, logits, idx), idx

        return hook

    _ACTIVE_REPLAY.add(model)
    try:
        for layer, router in enumerate(routers):
            # prepend: run before any capture hook, so captures see the replayed routing
            handles.append(router.register_forward_hook(make_hook(layer), prepend=True))
        yield replayer
    finally:
        for h in handles:
            h.remove()
        _ACTIVE_REPLAY.discard(model)


def select_sequences(
    indices: Sequence[Tensor], seq_len: int, rows: slice | Tensor | Sequence[int]
) -> list[Tensor]:
    """Select sequences (batch rows) from per-layer routing recorded on a ``[B, seq_len]`` batch.

    Returns, per layer, ``indices.view(B, seq_len, k)[rows].reshape(-1, k)``: the routing of the
    minibatch ``input_ids[rows]`` (same padding and sequence length).
    """
    out = []
    for idx in indices:
        if idx.shape[0] % seq_len:
            raise ValueError(
                f"select_sequences: {idx.shape[0]} routed tokens is not a multiple of "
                f"seq_len={seq_len}"
            )
        k = idx.shape[-1]
        sel = idx.view(-1, seq_len, k)[rows]
        out.append(sel.reshape(-1, k))
    return out


# --------------------------------------------------------------------------------------------
# Routing drift
# --------------------------------------------------------------------------------------------


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
        a_sorted = a.detach().cpu().sort(dim=-1).values
        b_sorted = b.detach().cpu().sort(dim=-1).values
        changed = (a_sorted != b_sorted).any(dim=-1).float()
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


# --------------------------------------------------------------------------------------------
# Tiny configs
# --------------------------------------------------------------------------------------------


def tiny_moe_config(
    family: str = "qwen3_moe",
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_experts: int = 8,
    top_k: int = 2,
    moe_intermediate_size: int | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    norm_topk_prob: bool = True,
    max_position_embeddings: int = 512,
    **overrides: Any,
) -> Any:
    """A small ``PretrainedConfig`` of a supported MoE family (for tests and presets).

    Every layer is sparse (no ``mlp_only_layers``, ``decoder_sparse_step=1``), router jitter is
    off, and the auxiliary loss is off (``output_router_logits=False``,
    ``router_aux_loss_coef=0.0``).  ``norm_topk_prob`` is ignored by Mixtral (always
    renormalised).  Token ids default to ``pad=0, bos=1, eos=2``.  ``overrides`` are passed to
    the config constructor last.
    """
    family = family.replace("-", "_").lower()
    if family not in SUPPORTED_MOE:
        raise ValueError(
            f"tiny_moe_config: unknown family '{family}' (supported: "
            f"{', '.join(sorted(SUPPORTED_MOE))})"
        )
    import transformers

    inter = moe_intermediate_size if moe_intermediate_size is not None else hidden_size
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "num_experts_per_tok": top_k,
        "max_position_embeddings": max_position_embeddings,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.0,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if family == "qwen3_moe":
        kwargs = {
            **common,
            "head_dim": hidden_size // num_heads,
            "intermediate_size": 2 * inter,
            "moe_intermediate_size": inter,
            "num_experts": num_experts,
            "norm_topk_prob": norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    elif family == "mixtral":
        kwargs = {
            **common,
            "head_dim": hidden_size // num_heads,
            "intermediate_size": inter,
            "num_local_experts": num_experts,
            "router_jitter_noise": 0.0,
        }
    elif family == "olmoe":
        kwargs = {
            **common,
            "intermediate_size": inter,
            "num_experts": num_experts,
            "norm_topk_prob": norm_topk_prob,
        }
    else:  # qwen2_moe
        kwargs = {
            **common,
            "intermediate_size": 2 * inter,
            "moe_intermediate_size": inter,
            "shared_expert_intermediate_size": inter,
            "num_experts": num_experts,
            "norm_topk_prob": norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    kwargs.update(overrides)
    config_cls = getattr(transformers, SUPPORTED_MOE[family].config_class_name)
    return config_cls(**kwargs)
