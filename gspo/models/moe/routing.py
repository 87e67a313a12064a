"""Capture and replay of MoE routing through forward hooks on the routers.

A forward hook on a router can record the indices it chose (:func:`capture_routing`) or replace
indices and scores (:func:`replay_routing`); see :mod:`gspo.models.moe.adapters` for the
router contract and how each family's gate weights are recomputed.

Layout contract: a router sees the flattened hidden states of the whole forward, so indices are
``[N, k]`` with ``N = B * T`` (padding positions included, row-major over ``(batch, time)``).
Record and replay must use the same ``(B, T)`` layout (same padding side, same sequence length,
same row order); :func:`select_sequences` slices a recorded batch into minibatches.

A forward that does not run the ``(B, T)`` batch as one block (the shared-prompt pass of
:mod:`gspo.models.packing`: each distinct prompt once, then the responses on top) declares how
its router calls map onto that layout with :func:`packed_routing`; capture and replay then
translate, so what they record and replay stays ``[B * T, k]``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from gspo.models.moe.adapters import moe_adapter, router_modules

__all__ = [
    "PackedRouting",
    "RoutingRecorder",
    "RoutingReplayer",
    "capture_routing",
    "packed_routing",
    "replay_routing",
    "select_sequences",
    "translated",
    "unpack_router_output",
]


def _in_backward() -> bool:
    """True while the autograd engine runs (e.g. an activation-checkpoint recompute)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    if task_id is None:  # pragma: no cover - very old torch
        return False
    return task_id() != -1


def unpack_router_output(output: Any, layer: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(router_logits, router_scores, router_indices)`` of one router call of MoE ``layer``.

    Raises:
        RuntimeError: the router returned something else (a transformers version before 5.x).
    """
    if not (isinstance(output, tuple) and len(output) == 3):
        raise RuntimeError(
            f"router of MoE layer {layer} returned {type(output).__name__}; expected "
            "(router_logits, router_scores, router_indices) as in transformers 5.x"
        )
    return output  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# Packed forwards: several router calls per layer standing for one (B, T) layout
# --------------------------------------------------------------------------------------------


class PackedRouting:
    """How the router calls of each MoE layer in one packed forward map onto the ``(B, T)``
    layout that capture and replay use.

    Args:
        calls: per router call of a layer, in call order, the flat ``(B, T)`` position
            (``b * T + t``) each of the call's token rows stands for (rows that stand for no
            token, e.g. padding, name any position: replay gives them its experts).
        gather: ``[B * T]``, each flat position's row in the calls' rows concatenated.
    """

    def __init__(self, calls: Sequence[Tensor], gather: Tensor) -> None:
        self.calls = [c.long() for c in calls]
        self.gather = gather.long()
        self._call: dict[int, int] = {}  # id(router) -> index of the call in progress

    @property
    def tokens(self) -> int:
        """``B * T``: the rows of the layout's ``[B * T, k]`` tensors."""
        return int(self.gather.shape[0])

    def call(self, router: nn.Module) -> int:
        """Index (in :attr:`calls`) of ``router``'s call in progress."""
        return self._call[id(router)]

    def to_call(self, flat: Tensor, router: nn.Module) -> Tensor:
        """The rows of a ``[B * T, ...]`` tensor that ``router``'s call in progress routes."""
        return flat[self.calls[self.call(router)].to(flat.device)]

    def to_flat(self, pending: list[Tensor], value: Tensor, router: nn.Module) -> Tensor | None:
        """Collect one call's ``value`` in ``pending``; after the layer's last call, return the
        ``[B * T, ...]`` tensor they make (and empty ``pending``), else None."""
        pending.append(value)
        if self.call(router) < len(self.calls) - 1:
            return None
        whole = torch.cat(pending) if len(pending) > 1 else pending[0]
        pending.clear()
        return whole[self.gather.to(whole.device)]


_PACKED: dict[int, PackedRouting] = {}  # id(router) -> the packed forward it runs in


def packed_of(router: nn.Module) -> PackedRouting | None:
    """The :class:`PackedRouting` of the packed forward ``router`` runs in, if any."""
    return _PACKED.get(id(router))


@contextmanager
def packed_routing(model: nn.Module, layout: PackedRouting) -> Iterator[PackedRouting]:
    """Declare that the forwards in the block route through ``layout``'s calls (same number
    and order for every MoE layer); :func:`capture_routing`, :func:`replay_routing` and
    :func:`translated` hooks translate between them and the ``(B, T)`` layout."""
    routers = router_modules(model)
    counted: dict[int, int] = {}

    def count(module: nn.Module, args: Any) -> None:  # pre-hook: before every forward hook
        n = counted.get(id(module), 0)
        if n >= len(layout.calls):
            raise RuntimeError(f"packed routing: a router was called {n + 1} times; the "
                               f"layout has {len(layout.calls)} calls per layer")
        layout._call[id(module)] = n
        counted[id(module)] = n + 1

    if any(id(r) in _PACKED for r in routers):
        raise RuntimeError("packed routing: a packed forward is already running on this model")
    handles = [r.register_forward_pre_hook(count) for r in routers]
    for r in routers:
        _PACKED[id(r)] = layout
    try:
        yield layout
    finally:
        for h in handles:
            h.remove()
        for r in routers:
            _PACKED.pop(id(r), None)


def translated(store: Callable[[int, Tensor], None], n_layers: int
               ) -> Callable[[int, nn.Module, Tensor], None]:
    """``record(layer, router, value)`` for a hook that keeps ``[N, ...]`` router outputs:
    ``store(layer, value)`` directly in a plain forward, once per layer with the ``[B * T, ...]``
    tensor of the calls in a packed one."""
    pending: list[list[Tensor]] = [[] for _ in range(n_layers)]

    def record(layer: int, router: nn.Module, value: Tensor) -> None:
        layout = packed_of(router)
        if layout is None:
            store(layer, value)
        elif (whole := layout.to_flat(pending[layer], value, router)) is not None:
            store(layer, whole)

    return record


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
        n = len(self._idx)
        self._keep_idx = translated(lambda i, x: self._idx[i].append(x), n)
        self._keep_logits = translated(lambda i, x: self._logits[i].append(x), n)

    def _store(self, x: Tensor) -> Tensor:
        x = x.detach()
        return x.to(self._device) if self._device is not None else x

    def _record(self, layer: int, logits: Tensor, indices: Tensor,
                router: nn.Module | None = None) -> None:
        """One router call's output (``router``: the module, for a packed forward)."""
        self.calls += 1
        self._keep_idx(layer, router, self._store(indices).long())
        if self._record_logits:
            self._keep_logits(layer, router, self._store(logits))

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
            logits, _, indices = unpack_router_output(output, layer)
            recorder._record(layer, logits, indices, module)

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


def _check_replay_indices(indices: list[Tensor], routers: list[nn.Module]) -> None:
    """Reject indices that are not ``[N, k]`` integer tensors within each router's experts."""
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


@contextmanager
def replay_routing(model: nn.Module, indices: Sequence[Tensor]) -> Iterator[RoutingReplayer]:
    """Force every router of ``model`` to use the given expert indices during the block.

    For MoE layer ``i`` each router call returns ``indices[i]`` (shape ``[N, k]`` with ``N = B*T``
    of the forward) together with gate weights recomputed from the *current* router logits at
    those indices, using the family's own softmax / renormalisation / dtype (see
    :mod:`gspo.models.moe.adapters`), so the router weights still receive gradients.  With
    unchanged weights and the same inputs the model output is bit-identical to the forward that
    recorded the indices.

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
    _check_replay_indices(indices, routers)
    if model in _ACTIVE_REPLAY:
        raise RuntimeError("replay_routing: a replay block is already active on this model")

    replayer = RoutingReplayer(indices)
    gate_fn = adapter.gate_weights
    handles = []

    def make_hook(layer: int) -> Callable[[nn.Module, Any, Any], tuple[Tensor, Tensor, Tensor]]:
        def hook(module: nn.Module, args: Any, output: Any) -> tuple[Tensor, Tensor, Tensor]:
            logits, _, routed = unpack_router_output(output, layer)
            layout = packed_of(module)
            expected = (layout.tokens if layout else routed.shape[0], routed.shape[1])
            given = tuple(replayer.indices[layer].shape)
            if given != expected:
                raise ValueError(
                    f"replay_routing: MoE layer {layer} routes {expected[0]} tokens with "
                    f"top_k={expected[1]} (indices {expected}) but the replayed indices have "
                    f"shape {given}; record and replay need the same (B, T) layout"
                )
            idx = replayer._get(layer, routed.device, routed.dtype)
            if layout is not None:
                idx = layout.to_call(idx, module)
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
