"""Decode steps of Llama-family dense models without the per-call machinery of ``forward``.

A decode step feeds one token per row through the model. Hugging Face's ``forward`` does the
same arithmetic, but wraps it in work that is constant per call: output-capture decorators, a
causal mask built from the cache, the cache's layer dispatch, the attention-function registry,
output dataclasses. For a small model that overhead is most of a step (the tiny Llama preset:
about 1.6 ms per step, of which its matrix products are 6%), and it is paid at every one of a
rollout's ``max_new_tokens`` steps.

:class:`DenseDecoder` reads the model's own modules and weights and runs the step directly:

- keys and values go into the prefill's cache through its layers' ``update`` (the sampler
  reserves room there for every step of the rollout); rows that finish are dropped from it;
- the attention mask is an additive buffer (0 or -inf) updated in place, one column a step;
- attention for the single query token is written out (scores, softmax, weighted sum) with the
  query heads grouped under their key/value head, as ``sdpa_attention_forward`` does for decode;
- norms, rotary embedding and activation are the model's own modules, so their variants (rope
  scaling types, Qwen3's per-head q/k norms) come for free; the rotary embedding's cos/sin are
  tabulated once per rollout for the positions it can reach (per step for the rope types that
  adapt to the length seen so far);
- Llama-family RMS norms are written out (bitwise equal, fewer temporaries), and in small layers
  the q/k/v and gate/up projections run as one matrix product each;
- with ``packed`` (a CPU model in float32, or in bfloat16 where oneDNN has bf16 kernels:
  ``rollout.decode_matmul``), every projection and the output layer multiply through oneDNN
  on weights packed once per rollout (:class:`_Linear`).

It covers the architectures whose decoder layers are exactly Llama's shape (``llama``,
``qwen2``, ``qwen3`` without sliding-window layers) with plain ``nn.Linear`` projections, and
their Mixture-of-Experts siblings (``mixtral``, ``qwen2_moe``, ``qwen3_moe``, also without
sliding-window attention): the same attention, with each sparse layer's MoE block (router and
experts) run as the model's own module (:func:`sparse_block`), so its routing and any hooks on
its router are the model's;
:func:`unsupported` names what stops any other model, and the sampler then uses ``forward``.
The logits equal ``forward``'s to fp32 rounding (``tests/models/test_decode.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FAMILIES = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")


def sparse_block(mlp: nn.Module) -> bool:
    """Whether a decoder layer's ``mlp`` is a Mixture-of-Experts block (router and experts,
    ``[B, S, hidden] -> [B, S, hidden]``), which the lean passes call as a module, rather than
    a gate/up/down MLP, which they run as products on its weights."""
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def unsupported(model: Any) -> str | None:
    """Why :class:`DenseDecoder` cannot run ``model`` (None when it can)."""
    if hasattr(model, "peft_config"):  # said as such, not as a wrapper it does not know
        return "a LoRA (PEFT) policy, whose adapted layers are not plain nn.Linear"
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in FAMILIES:
        return f"model type {kind!r} is not one of {', '.join(FAMILIES)}"
    if getattr(cfg, "use_sliding_window", False) or any(
            t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "sliding-window attention layers"
    # Mixtral has no use_sliding_window or layer_types: its forward applies the window
    # whenever config.sliding_window is set (every layer)
    if kind == "mixtral" and getattr(cfg, "sliding_window", None) is not None:
        return "sliding-window attention layers"
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if layers is None or not isinstance(getattr(body, "embed_tokens", None), nn.Embedding):
        return "not a causal-LM wrapper around a decoder with plain embeddings"
    if any(type(p) is not nn.Parameter and type(p) is not torch.Tensor
           for p in model.parameters()):  # e.g. FSDP2's sharded DTensors outside a gather
        return "parameters that are not plain tensors (sharded or wrapped)"
    if len({p.dtype for p in model.parameters()}) > 1:
        return "parameters of mixed dtypes"
    # hooks inside an MoE block fire (the block runs as a module): routing capture and replay
    called = {id(m) for layer in layers if sparse_block(layer.mlp) for m in layer.mlp.modules()}
    if any((m._forward_hooks or m._forward_pre_hooks) and id(m) not in called
           for m in model.modules()) or (
            nn.modules.module._global_forward_hooks
            or nn.modules.module._global_forward_pre_hooks):
        return "forward hooks, which the decode step would bypass (e.g. FSDP2's)"
    if type(getattr(model, "lm_head", None)) is not nn.Linear:
        return "the output layer is not a plain nn.Linear"
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        dense = () if sparse_block(mlp) else (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, *dense):
            if type(proj) is not nn.Linear:  # LoRA, quantised or otherwise wrapped layers
                return f"projection {type(proj).__name__} is not a plain nn.Linear"
        if getattr(attn, "sliding_window", None) is not None:
            return "sliding-window attention layers"
    return None


def rope_adapts(rotary: nn.Module) -> bool:
    """Whether a rotary module's cos/sin depend on the longest sequence it has seen (rope
    types ``dynamic`` and ``longrope``: they replace their ``inv_freq`` buffer as it grows)."""
    kind = getattr(rotary, "rope_type", None)
    return not isinstance(kind, str) or "dynamic" in kind or kind == "longrope"


def _signed(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated, for :func:`_rope`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Llama's ``x * cos + rotate_half(x) * sin``, bitwise: ``rotate_half(x) = [-x2, x1]`` is
    ``roll(x)`` = [x2, x1] times the sign carried by ``signed_sin`` = [-sin1, sin2] (half the
    operations)."""
    return torch.mul(x, cos).add_(x.roll(x.shape[-1] // 2, -1).mul_(signed_sin))


class _Norm:
    """An RMS norm module as the decode step calls it. For the Llama-family one in fp32
    (``weight * (x * rsqrt(mean(x²) + eps))``) the same operations are written out with the
    intermediate updated in place: bitwise equal to the module, and per call on 16 rows 18 µs
    against the module's 32 µs and ``F.rms_norm``'s 20 µs (hidden 64; measured on the CI machine
    type). Anything else calls the module itself."""

    KINDS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.eps = getattr(module, "variance_epsilon", None)
        weight = getattr(module, "weight", None)
        self.inline = (type(module).__name__ in self.KINDS and self.eps is not None
                       and weight is not None and weight.dtype == torch.float32)
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.inline and x.dtype == torch.float32:
            var = torch.mul(x, x).mean(-1, keepdim=True)
            return torch.mul(x, var.add_(self.eps).rsqrt_()).mul_(self.weight)
        return self.module(x)


# Fusing copies a layer's q/k/v and gate/up weights once per rollout and saves three matrix-product
# calls per layer and step. Measured: worth it for small layers (tiny Llama, 0.1 MiB a layer:
# 0.98 -> 0.89 ms a step), not for SmolLM2 (8.9 MiB a layer: the copy takes ~0.14 s a rollout,
# more than the ~0.03 s the saved calls are worth over 32 steps).
FUSE_MAX_BYTES = 1 << 20


def onednn_available() -> bool:
    """Whether this torch build can run :class:`_Linear`'s oneDNN path (CPU, fp32)."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def bf16_kernels() -> bool:
    """Whether oneDNN has bfloat16 kernels on this CPU (torch's own check: AVX-512 on x86)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return check is not None and bool(check())


def packable(model: Any, bf16: bool = False) -> str | None:
    """Why the products of ``model`` cannot go through oneDNN (None: they can): they need a
    CPU model in float32 and a torch build with oneDNN. With ``bf16`` (the decode steps) a
    model in bfloat16 also can, where oneDNN has bf16 kernels on this CPU (:func:`bf16_kernels`).
    The trainer's log-prob passes (:mod:`gspo.models.onednn`) take fp32 only."""
    w = model.get_input_embeddings().weight
    if w.device.type != "cpu":
        return f"the model is on {w.device.type}, not the CPU"
    if not onednn_available():
        return "this torch build has no oneDNN (mkldnn) CPU kernels"
    if w.dtype == torch.bfloat16 and bf16:
        return None if bf16_kernels() else "oneDNN has no bfloat16 kernels on this CPU"
    if w.dtype != torch.float32:
        return f"the model is in {w.dtype}, not float32{' or bfloat16' if bf16 else ''}"
    return None


def packing_pays(model: Any) -> bool:
    """Whether ``rollout.decode_matmul=auto`` packs: for layers above :data:`FUSE_MAX_BYTES`
    of q/k/v and gate/up weights. Measured (``bench_async``): SmolLM2's rollout (8.9 MiB a
    layer) 1.5x faster packed; the tiny Llama preset's (0.1 MiB) 1.6x slower, oneDNN's cost per
    call and the per-rollout packing outweighing its faster kernel there."""
    return all(_fused_bytes(layer) > FUSE_MAX_BYTES for layer in model.model.layers)


class _Linear:
    """``x Wᵀ + b`` for one projection of the decode step.

    Plain (``rows`` None): ``F.linear``, i.e. torch's BLAS (MKL on x86). Packed (``rows``: the
    rows of the decode batch): the weight is reordered once per rollout into oneDNN's blocked
    layout for that batch size, and every step multiplies through oneDNN, the path PyTorch's
    own inductor takes for frozen CPU linears. At a decode step's shapes (16 rows, weights
    read from memory) MKL's fp32 GEMM is far from both the core's FLOP rate and the memory
    bandwidth on the 2-core AMD CI machine, and gains little from a second core; the packed
    product is 1.5-3x faster and scales better (``python -m benchmarks.bench_decode_matmul``).
    The two agree to fp32 rounding (tests/models/test_decode.py). Packing copies the weights
    when the decoder is built (once per rollout: ~0.2 s for SmolLM2), so a decoder never
    outlives an update.

    A bfloat16 model (``rollout.precision=bf16``'s copy) packs the same way where oneDNN has
    bf16 kernels. Its plain products run through oneDNN already (torch's CPU bf16 matmul),
    reordering the weight at every call; packed, once per rollout. On the Zen 5 host SmolLM2's
    bf16 rollout took 1.12 s against 1.25 on 1 thread and 0.85 against 1.03 on 2
    (``bench_async --arms sync-bf16blas@1,sync-bf16@1,... --tag zen5_bf16_packed``); the logits
    agree with ``forward``'s in bf16 to bf16 rounding.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int | None
                 ) -> None:
        self.weight, self.bias = weight, bias
        self.packed = (None if rows is None else
                       torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _fused_bytes(layer: nn.Module) -> int:
    """Bytes of a layer's q/k/v and gate/up weights (a sparse layer: q/k/v and half of one
    expert's weights, the size class of its gate/up; only compared with FUSE_MAX_BYTES)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = sum(p.weight.numel() * p.weight.element_size()
              for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    if sparse_block(mlp):
        experts = mlp.experts
        weights = [w for w in experts.parameters() if w.dim() == 3] or list(experts.parameters())
        return qkv + sum(w.numel() * w.element_size() for w in weights) // (
            2 * max(int(getattr(experts, "num_experts", 1)), 1))
    return qkv + sum(p.weight.numel() * p.weight.element_size()
                     for p in (mlp.gate_proj, mlp.up_proj))


class _Layer:
    """One decoder layer's weights as the decode step uses them. With ``fuse``, the q/k/v and
    the gate/up projections run as one matrix product each on concatenated weights (a copy,
    made once per rollout; fewer calls per step), else one call per projection."""

    def __init__(self, layer: nn.Module, fuse: bool, rows: int | None = None) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1, self.norm2 = _Norm(layer.input_layernorm), _Norm(layer.post_attention_layernorm)
        self.q_norm = _Norm(attn.q_norm) if hasattr(attn, "q_norm") else None
        self.k_norm = _Norm(attn.k_norm) if hasattr(attn, "k_norm") else None
        self.o = _Linear(attn.o_proj.weight, attn.o_proj.bias, rows)
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.splits = [p.out_features for p in projs]
        self.block = mlp if sparse_block(mlp) else None  # MoE: the model's own module
        groups: tuple[tuple[nn.Module, ...], ...] = (projs,)
        if self.block is None:
            self.act = mlp.act_fn
            self.down = _Linear(mlp.down_proj.weight, mlp.down_proj.bias, rows)
            groups = (projs, (mlp.gate_proj, mlp.up_proj))
        # a group whose projections disagree on having a bias stays unfused
        self.fused = fuse = fuse and all(len({p.bias is None for p in g}) == 1 for g in groups)
        if fuse:
            fused = [_Linear(torch.cat([p.weight for p in g]),
                             None if g[0].bias is None else torch.cat([p.bias for p in g]), rows)
                     for g in groups]
            self.qkv_all = fused[0]
            if self.block is None:
                self.gate_up = fused[1]
        else:
            self.projs = [_Linear(p.weight, p.bias, rows) for p in projs]
            if self.block is None:
                self.gate, self.up = (_Linear(p.weight, p.bias, rows)
                                      for p in (mlp.gate_proj, mlp.up_proj))

    def qkv(self, h: torch.Tensor, n: int, d: int, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries and keys, and values, of ``h`` [n, hidden]: [n, heads, 1, d] each."""
        nq, nk = self.splits[0] // d, self.splits[1] // d
        if self.fused and self.q_norm is None:  # one rotation for the queries and keys together
            qkv = self.qkv_all(h)
            qk = _rope(qkv[:, :(nq + nk) * d].view(n, -1, 1, d), cos, sin)
            return qk[:, :nq], qk[:, nq:], qkv[:, (nq + nk) * d:].view(n, -1, 1, d)
        if self.fused:
            q, k, v = self.qkv_all(h).split(self.splits, dim=-1)
        else:
            q, k, v = (p(h) for p in self.projs)
        q, k, v = q.view(n, -1, 1, d), k.view(n, -1, 1, d), v.view(n, -1, 1, d)
        if self.q_norm is not None:  # Qwen3: RMS norm per head before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.block is not None:  # [n, hidden] as n sequences of one token
            return self.block(h[:, None])[:, 0]
        if self.fused:
            gate, up = self.gate_up(h).chunk(2, dim=-1)
        else:
            gate, up = self.gate(h), self.up(h)
        return self.down(self.act(gate) * up)


class DenseDecoder:
    """Decode steps for a batch of rows that share a prefilled Hugging Face cache.

    ``cache`` is the cache ``forward`` returned for the prompts (its layers' ``keys``/``values``
    are ``[rows, kv_heads, width, head_dim]``; each step appends to it through its layers'
    ``update``), ``mask`` the ``[rows, width]`` attention mask of that prefill, ``extra`` the
    number of steps to come. Every :meth:`step` appends one token per row;
    :meth:`batch_select_indices` drops rows, from the cache too. ``fuse`` (default: for layers
    of at most :data:`FUSE_MAX_BYTES` of q/k/v and gate/up weights) concatenates those weights.
    """

    def __init__(self, model: Any, cache: Any, mask: torch.Tensor, extra: int,
                 fuse: bool | None = None, packed: bool = False) -> None:
        why = unsupported(model) or (packable(model, bf16=True) if packed else None)
        if why is not None:
            raise ValueError(f"DenseDecoder: {why}")
        body = model.model
        self.embed, self.norm, self.rotary = body.embed_tokens, _Norm(body.norm), body.rotary_emb
        rows = mask.shape[0] if packed else None
        self.head = _Linear(model.lm_head.weight, model.lm_head.bias, rows)
        if fuse is None:
            fuse = all(_fused_bytes(layer) <= FUSE_MAX_BYTES for layer in body.layers)
        self.layers = [_Layer(layer, fuse, rows) for layer in body.layers]
        attn = body.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.groups = attn.num_key_value_groups
        self.scaling = attn.scaling
        rows, width = mask.shape
        self.width = width
        # cos/sin of every position the rollout can reach, looked up per step; rope types that
        # adapt to the sequence length seen so far (dynamic, longrope) are computed per step.
        self.rope_table = None
        if not rope_adapts(self.rotary):
            top = int(mask.sum(-1).max()) + extra
            cos, sin = self.rotary(self.embed.weight[:1],
                                   torch.arange(top, device=mask.device)[None])
            self.rope_table = (cos, _signed(sin))
        # Additive attention mask over the cache, shared by every head and layer: 0 where a
        # row attends, -inf at its left padding and at the positions still to be filled.
        self.bias = torch.full((rows, 1, 1, width + extra), float("-inf"),
                               dtype=self.embed.weight.dtype, device=mask.device)
        self.bias[:, 0, 0, :width].masked_fill_(mask.bool(), 0.0)
        # Keys and values are appended through the cache's own layers: the sampler swaps them
        # for ones with room reserved for the rollout (gspo.rollout.sampler._reserve).
        self.cache = cache
        for layer in cache.layers:
            if layer.keys.shape[0] != rows or layer.keys.shape[2] != width:
                raise ValueError(f"DenseDecoder: cache layer is {tuple(layer.keys.shape)}, "
                                 f"expected {rows} rows of width {width}")

    def batch_select_indices(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the current rows), in that order."""
        self.bias = self.bias[rows]
        self.cache.batch_select_indices(rows)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` [rows] at ``positions`` [rows]; return the next-token logits
        [rows, vocab] (fp32 when the model is)."""
        n, s, d, g = tokens.shape[0], self.width, self.head_dim, self.groups
        x = self.embed(tokens)  # [n, hidden]
        if self.rope_table is not None:
            cos, sin = (t[0, positions].view(n, 1, 1, -1) for t in self.rope_table)
        else:
            cos, sin = self.rotary(x[:, None], positions[:, None])  # [n, 1, d]
            cos, sin = cos[:, None], _signed(sin[:, None])
        # cos, sin (first half negated): [n, 1, 1, d], broadcast over heads
        self.bias[..., s] = 0.0
        bias = self.bias[..., :s + 1]
        for layer, cached in zip(self.layers, self.cache.layers):
            q, k, v = layer.qkv(layer.norm1(x), n, d, cos, sin)
            keys, values = cached.update(k, v)  # [n, kv, s + 1, d]
            # The query heads of each key/value head as a [groups, d] block: [n, kv, g, d].
            scores = torch.matmul(q.view(n, -1, g, d), keys.transpose(-1, -2))
            # softmax in fp32 whatever the model's dtype, as the eager attention does
            weights = torch.softmax(scores.mul_(self.scaling).add_(bias), dim=-1,
                                    dtype=torch.float32).to(values.dtype)
            o = torch.matmul(weights, values).reshape(n, -1)  # [n, heads * d]
            x = x + layer.o(o)
            x = x + layer.mlp(layer.norm2(x))
        self.width = s + 1
        return self.head(self.norm(x))
