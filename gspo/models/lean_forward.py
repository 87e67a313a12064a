"""Sequence passes of Llama-family dense backbones without the per-call machinery of ``forward``.

The trainer's log-prob passes (π_old, and the forward of every minibatch, under autograd) run
the backbone on whole sequences. Hugging Face's ``forward`` wraps that arithmetic in work that
is constant per call and per layer: output-capture decorators, the causal mask built from the
2D attention mask, the attention-function registry, cache dispatch. For a small model it is a
visible share of the step (the tiny Llama preset: ~0.7 ms of a 5 ms forward on 8 × 93 tokens,
~1.1 ms of 14 ms forward + backward, measured on the CI machine type).

:func:`lean_hidden` runs the same arithmetic directly on the backbone's own modules and
weights: embedding, the model's rotary module (cos/sin) applied as in
:func:`gspo.models.decode._rope` (bitwise Llama's), the norm modules, the projections as
``F.linear`` on their weights, ``F.scaled_dot_product_attention`` with an additive mask from
:func:`key_bias`, the MLP's own activation; a Mixture-of-Experts layer's block (router and
experts) runs as its own module. It can continue from the keys and values of an earlier pass;
:func:`lean_joint_hidden` instead runs the prompts and their continuations through each layer
together (the shared-prompt packing of :mod:`gspo.models.packing`). It covers what
:func:`gspo.models.decode.unsupported` allows, and :func:`lean_unsupported` adds what only
matters under training (gradient checkpointing, attention dropout); everything else keeps
``forward``. Log-probs and gradients equal ``forward``'s (tests/models/test_lean_forward.py).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from gspo.models.decode import _rope, _signed, rope_adapts, sparse_block, unsupported

# x, weight, bias -> x Wᵀ + b: F.linear, or gspo.models.onednn.linear
Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


# Callables that every lean pass calls between its layers, forward and backward (see
# :func:`at_layer_boundaries`).
_BOUNDARY: list[Callable[[], None]] = []


@contextlib.contextmanager
def at_layer_boundaries(fn: Callable[[], None]) -> Any:
    """Call ``fn()`` between the layers of every lean pass run in this block: before each layer
    of the forward and, under autograd, after each layer's backward (a hook on the layer's input,
    on the thread that runs the backward; a backward run after the block calls nothing); and
    before each decode step of :func:`gspo.rollout.sampler.generate`. The arithmetic is
    untouched. What calls it: thread lending (``rollout.async_lend_threads``), which changes
    the process's torch threads there."""
    _BOUNDARY.append(fn)
    try:
        yield
    finally:
        _BOUNDARY.remove(fn)


def at_boundary() -> None:
    """Call what :func:`at_layer_boundaries` registered (nothing outside its block): the
    lean passes between layers, the sampler before each decode step."""
    for fn in tuple(_BOUNDARY):
        fn()


def _boundary(x: torch.Tensor) -> torch.Tensor:
    """The point between two layers (:func:`at_layer_boundaries`); ``x``, the next layer's
    input, as it was."""
    if _BOUNDARY:
        at_boundary()
        if x.requires_grad:
            x.register_hook(_boundary_backward)
    return x


def _boundary_backward(grad: torch.Tensor) -> None:
    at_boundary()


def lean_unsupported(model: Any) -> str | None:
    """Why :func:`lean_hidden` cannot stand in for ``model``'s backbone (None when it can):
    :func:`gspo.models.decode.unsupported`, gradient checkpointing, attention dropout."""
    if getattr(getattr(model, "model", None), "gradient_checkpointing", False):
        return "gradient checkpointing (forward recomputes activations in backward)"
    if float(getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0) > 0:
        return "attention dropout"
    return unsupported(model)


def inference_safe(model: Any) -> bool:
    """Whether the lean passes of ``model`` (one they support) may run under
    ``torch.inference_mode``, which does less work per operation than ``no_grad``. Not when
    its rotary module adapts to the length seen: that would replace its ``inv_freq`` buffer
    by an inference tensor, which in-place writes outside inference mode (DDP's buffer
    broadcast) then refuse."""
    return not rope_adapts(model.model.rotary_emb)


def no_autograd(inference: bool) -> contextlib.AbstractContextManager:
    """``torch.inference_mode()`` when ``inference`` (see :func:`inference_safe`), else
    ``torch.no_grad()``. Not ``torch.inference_mode(inference)``: ``inference_mode(False)``
    turns gradient recording back *on*, even inside ``no_grad``, so every forward under it
    would build an autograd graph that nothing reads."""
    return torch.inference_mode() if inference else torch.no_grad()


def key_bias(key_mask: torch.Tensor, queries: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask [B, 1, S, K] for the last ``queries`` = S of K key columns.

    Query i sits at column K − S + i and sees key column j when j ≤ K − S + i and
    ``key_mask[b, j]`` is 1 (0 there, −inf elsewhere). A query that would see no key (left
    padding) sees every key instead: its output is never read, and this keeps it finite (an
    all −inf row would give NaN, and NaN times a zero gradient is still NaN in the weight
    gradients).
    """
    b, k = key_mask.shape
    cols = torch.arange(k, device=key_mask.device)
    causal = cols[None, :] <= cols[k - queries:, None]  # [S, K]
    allowed = causal[None] & key_mask.bool()[:, None, :]  # [B, S, K]
    allowed |= ~allowed.any(-1, keepdim=True)
    bias = torch.zeros((b, 1, queries, k), dtype=dtype, device=key_mask.device)
    return bias.masked_fill_(~allowed[:, None], float("-inf"))


def lean_hidden(backbone: Any, input_ids: torch.Tensor, position_ids: torch.Tensor,
                bias: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                keep_kv: bool = False, compiled: bool = False, linear: Linear = F.linear
                ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The backbone's last hidden states (after its final norm) for ``input_ids`` [B, S].

    Args:
        backbone: the decoder inside the causal LM (``model.model``), of a model that
            :func:`lean_unsupported` accepts.
        position_ids: [B, S] rotary positions.
        bias: [B, 1, S, P + S] additive mask (:func:`key_bias`) over the ``past`` keys (P
            columns, none without ``past``) followed by this pass's own.
        past: per layer (keys, values) [B, kv_heads, P, head_dim] to attend to before the
            pass's own tokens (rotated, as ``keep_kv`` returns them).
        keep_kv: also return each layer's (keys, values), past included.
        compiled: run each layer through :func:`compiled_layer` (the same arithmetic, fused by
            torch.compile; equal to fp32 rounding, not bit for bit).
        linear: the projections' product, ``F.linear`` or :func:`gspo.models.onednn.linear`
            (eager layers only).
    Returns:
        ``(hidden [B, S, hidden], kv)``; gradients flow through both, and into ``past``.
    """
    x = backbone.embed_tokens(input_ids)
    cos, sin = backbone.rotary_emb(x, position_ids)  # [B, S, head_dim]
    cos, sin = cos[:, None], _signed(sin)[:, None]  # broadcast over heads
    kept = []
    step = compiled_layer() if compiled else functools.partial(lean_layer, linear=linear)
    for i, layer in enumerate(backbone.layers):
        x, k, v = step(layer, _boundary(x), cos, sin, bias,
                       *(past[i] if past is not None else (None, None)))
        if keep_kv:
            kept.append((k, v))
    return backbone.norm(x), kept


def lean_layer(layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               bias: torch.Tensor, past_k: torch.Tensor | None, past_v: torch.Tensor | None,
               linear: Linear = F.linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer of :func:`lean_hidden`: ``(x after the layer, keys, values)``, the keys
    and values rotated and ``past_k``/``past_v`` (or None) prepended."""
    b, s = x.shape[:2]
    attn, mlp = layer.self_attn, layer.mlp
    d = attn.head_dim
    h = layer.input_layernorm(x)
    q, k, v = (linear(h, p.weight, p.bias).view(b, s, -1, d)
               for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    if hasattr(attn, "q_norm"):  # Qwen3: RMS norm per head before the rotation
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    if past_k is not None and past_v is not None:
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=attn.scaling,
                                       enable_gqa=k.shape[1] != q.shape[1])
    x = x + linear(o.transpose(1, 2).reshape(b, s, -1), attn.o_proj.weight, attn.o_proj.bias)
    h = layer.post_attention_layernorm(x)
    if sparse_block(mlp):  # Mixture-of-Experts: the model's own block (router hooks fire)
        return x + mlp(h), k, v
    return x + dense_mlp(mlp, h, linear), k, v


def dense_mlp(mlp: Any, h: torch.Tensor, linear: Linear = F.linear) -> torch.Tensor:
    """A gate/up/down MLP on ``h`` as products on its weights: down(act(gate(h)) · up(h))."""
    gate = linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)
    up = linear(h, mlp.up_proj.weight, mlp.up_proj.bias)
    return linear(mlp.act_fn(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)


def lean_joint_hidden(backbone: Any, prompt_ids: torch.Tensor, prompt_pos: torch.Tensor,
                      prompt_bias: torch.Tensor, input_ids: torch.Tensor,
                      position_ids: torch.Tensor, bias: torch.Tensor, owner: torch.Tensor,
                      compiled: bool = False, linear: Linear = F.linear
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts and the rows that continue them through the backbone together, layer by layer.

    The same result as :func:`lean_hidden` on the prompts (``keep_kv``) followed by
    :func:`lean_hidden` on the continuations over those keys and values (``past``), in one
    pass: every projection multiplies the prompts' and the continuations' token rows as one
    matrix product, and the embedding runs once. Each weight's gradient is then one product
    rather than two products and a sum of weight-sized tensors: the SmolLM2 step's update
    1.02x faster on 1 thread and 1.03x on 2 (``python -m benchmarks.bench_async --arms
    sync@1,sync@2,sync-twopass@1,sync-twopass@2``). Only attention runs apart: the prompts among
    themselves, each continuation over its prompt's keys (row i reads prompt ``owner[i]``)
    and its own. A Mixture-of-Experts block runs as its module on the prompts, then on the
    continuations, as in the two passes (its router calls keep their layout).

    Args:
        prompt_ids, prompt_pos: [P, W] prompts and their rotary positions.
        prompt_bias: [P, 1, W, W] additive mask (:func:`key_bias`) of the prompts.
        input_ids, position_ids: [B, S] continuations and their positions.
        bias: [B, 1, S, W + S] additive mask over the prompt's keys and the row's own.
        owner: [B] the prompt each row continues.
        compiled: run each layer through :func:`compiled_joint_layer` (equal to fp32
            rounding).
        linear: the projections' product (eager layers only), as in :func:`lean_hidden`.
    Returns:
        ``(prompt hidden [P, W, hidden], hidden [B, S, hidden])``, after the final norm.
    """
    (p, w), (b, s) = prompt_ids.shape, input_ids.shape
    x = backbone.embed_tokens(torch.cat([prompt_ids.reshape(-1), input_ids.reshape(-1)]))
    pos = torch.cat([prompt_pos.reshape(-1), position_ids.reshape(-1)])
    cos, sin = backbone.rotary_emb(x[None], pos[None])  # [1, N, head_dim]
    cos, sin = cos[0, :, None], _signed(sin)[0, :, None]  # [N, 1, head_dim]: over heads
    step = compiled_joint_layer() if compiled else functools.partial(joint_layer, linear=linear)
    for layer in backbone.layers:
        x = step(layer, _boundary(x), cos, sin, (p, w), prompt_bias, (b, s), bias, owner)
    x = backbone.norm(x)
    return x[:p * w].view(p, w, -1), x[p * w:].view(b, s, -1)


def joint_layer(layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                prompt_shape: tuple[int, int], prompt_bias: torch.Tensor,
                shape: tuple[int, int], bias: torch.Tensor, owner: torch.Tensor,
                linear: Linear = F.linear) -> torch.Tensor:
    """One decoder layer of :func:`lean_joint_hidden` on ``x`` [N, hidden]: its first P·W
    rows are the prompts (``prompt_shape`` P, W), the other B·S the continuations."""
    attn, mlp = layer.self_attn, layer.mlp
    d, split = attn.head_dim, prompt_shape[0] * prompt_shape[1]
    rest = len(x) - split
    h = layer.input_layernorm(x)
    q, k, v = (linear(h, w.weight, w.bias).view(len(h), -1, d)
               for w in (attn.q_proj, attn.k_proj, attn.v_proj))
    if hasattr(attn, "q_norm"):  # Qwen3: RMS norm per head before the rotation
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    # [rows, heads, d] -> [batch, heads, seq, d], the prompts' rows and the others' apart
    qp, kp, vp = (t[:split].view(*prompt_shape, -1, d).transpose(1, 2) for t in (q, k, v))
    q, k, v = (t[split:].view(*shape, -1, d).transpose(1, 2) for t in (q, k, v))
    gqa = kp.shape[1] != qp.shape[1]
    op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=prompt_bias, scale=attn.scaling,
                                        enable_gqa=gqa)
    # index_select, not kp[owner]: the same values, and its backward is an index_add, where
    # advanced indexing's is an accumulating index_put, which got slower with a second thread
    # (0.32x in benchmarks/results/thread_scaling_*_zen5_onednn_isolated.md)
    k = torch.cat([kp.index_select(0, owner), k], dim=2)
    v = torch.cat([vp.index_select(0, owner), v], dim=2)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=attn.scaling,
                                       enable_gqa=gqa)
    o = torch.cat([op.transpose(1, 2).reshape(split, -1), o.transpose(1, 2).reshape(rest, -1)])
    x = x + linear(o, attn.o_proj.weight, attn.o_proj.bias)
    h = layer.post_attention_layernorm(x)
    if sparse_block(mlp):  # the model's own block, on each part as the two passes call it
        return x + torch.cat([mlp(h[:split].view(*prompt_shape, -1)).reshape(split, -1),
                              mlp(h[split:].view(*shape, -1)).reshape(rest, -1)])
    return x + dense_mlp(mlp, h, linear)


def compile_unsupported(device: torch.device) -> str | None:
    """Why :func:`compiled_layer` cannot run on ``device`` (None when it can): inductor
    generates C++ on a CPU and Triton kernels on a GPU, and needs the tool for each."""
    if device.type == "cuda":
        return None if importlib.util.find_spec("triton") else "torch.compile on CUDA needs triton"
    compilers = [os.environ.get("CXX") or "", "g++", "c++", "clang++"]
    if device.type == "cpu" and not any(c and shutil.which(c) for c in compilers):
        return "torch.compile's inductor needs a C++ compiler on the CPU (g++ or clang++)"
    return None


_COMPILED: dict[str, Any] = {}


def compiled_layer() -> Any:
    """:func:`lean_layer` through ``torch.compile`` (inductor, dynamic shapes), built once per
    process and shared by every layer of every model: each layer's weights are inputs of the
    graph, not constants, so one graph per kind of pass serves them all (prompt pass, pass over
    a prompt's keys, with and without autograd). Inductor fuses the elementwise work around the
    products (norms, rotation, residual adds, SiLU × up, and their backward) into generated C++
    loops; the products stay library calls. The first pass of each kind compiles (tens of
    seconds on a CPU; inductor caches the result on disk for later processes)."""
    if "lean" not in _COMPILED:
        _COMPILED["lean"] = torch.compile(lean_layer, dynamic=True)
    return _COMPILED["lean"]


def compiled_joint_layer() -> Any:
    """:func:`joint_layer` through ``torch.compile``, as :func:`compiled_layer` compiles
    :func:`lean_layer`: one graph for every layer (with and without autograd), the two
    attention calls and the products library calls, the elementwise work around them fused."""
    if "joint" not in _COMPILED:
        _COMPILED["joint"] = torch.compile(joint_layer, dynamic=True)
    return _COMPILED["joint"]
