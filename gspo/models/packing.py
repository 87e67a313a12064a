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
disables the cache), or when no prompt is shared.

The output layer runs through :func:`head_logprobs`, whose backward rebuilds one chunk of
logits at a time and overwrites it in place with its own gradient (about one [chunk, V] fp32
buffer at the peak, instead of the three to five that autograd with checkpointing keeps).
"""

from __future__ import annotations

from typing import Any

import torch

from gspo.models.logprobs import _chunk_logprobs, _split, token_logprobs


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


class ChunkedHeadLogprobs(torch.autograd.Function):
    """log_softmax(h Wᵀ + b)[y] / T-scaled, chunk by chunk, with a hand-written backward.

    Forward keeps only ``h``, ``W``, ``b``, ``y`` and one logsumexp per row; backward
    recomputes one chunk of logits at a time and turns it *in place* into
    ∂lp/∂z = onehot(y) − softmax(z), so the peak is about one [chunk, V] fp32 buffer (autograd
    with checkpointing holds three to five). Same values as :func:`_chunk_logprobs`.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, temperature: float, chunk: int) -> torch.Tensor:
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        out = torch.empty_like(lse)
        w, b = weight.float(), None if bias is None else bias.float()
        for s in range(0, hidden.shape[0], chunk):
            z = torch.nn.functional.linear(hidden[s:s + chunk].float(), w, b).div_(temperature)
            lse[s:s + chunk] = torch.logsumexp(z, dim=-1)
            out[s:s + chunk] = z.gather(-1, labels[s:s + chunk, None]).squeeze(-1)
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out - lse

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        w, b = weight.float(), None if bias is None else bias.float()
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g_h = torch.zeros_like(hidden, dtype=torch.float32) if need_h else None
        g_w = torch.zeros_like(w) if need_w else None
        g_b = torch.zeros_like(b) if need_b and b is not None else None
        for s in range(0, hidden.shape[0], chunk):
            h, y, g = hidden[s:s + chunk].float(), labels[s:s + chunk], grad[s:s + chunk] / t
            z = torch.nn.functional.linear(h, w, b).div_(t)
            dz = z.sub_(lse[s:s + chunk, None]).exp_().mul_(-g[:, None])  # −g·softmax, in place
            dz[torch.arange(len(y), device=y.device), y] += g  # + g·onehot(y)
            if g_h is not None:
                g_h[s:s + chunk] = dz @ w
            if g_w is not None:
                g_w.addmm_(dz.t(), h)
            if g_b is not None:
                g_b += dz.sum(0)
        cast = lambda x, like: None if x is None else x.to(like.dtype)  # noqa: E731
        return (cast(g_h, hidden), cast(g_w, weight),
                None if bias is None else cast(g_b, bias), None, None, None)


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  labels: torch.Tensor, *, temperature: float = 1.0, chunk: int = 256,
                  with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π(y | h) [M], entropy [M]) through the output layer, in fp32, chunk rows at a time.

    Under autograd it runs :class:`ChunkedHeadLogprobs`; without, plain chunks (and the
    entropy, which never carries a gradient). Args: hidden [M, H], weight [V, H], bias [V],
    labels [M].
    """
    if torch.is_grad_enabled() and not with_entropy:
        lp = ChunkedHeadLogprobs.apply(hidden, weight, bias, labels, temperature, chunk)
        return lp, torch.zeros_like(lp.detach())
    lps, ents = [], []
    for s in range(0, hidden.shape[0], chunk):
        lp, ent = _chunk_logprobs(hidden[s:s + chunk], weight, bias, labels[s:s + chunk],
                                  temperature, with_entropy)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(lps), torch.cat(ents).detach()


def shared_prefix_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           target_mask: torch.Tensor, *, temperature: float = 1.0,
                           chunk: int = 256,
                           with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(x_t | x_<t) / entropy where ``target_mask`` is 1, each distinct prompt run once.

    Args:
        input_ids, attention_mask, target_mask: [B, T], right-padded (as built by
            :func:`gspo.rollout.pad_batch`); a row's prompt is every token before its first
            target, and its targets lie between that token and its last real token.
        temperature, chunk, with_entropy: as in :func:`token_logprobs`.
    Returns:
        ``(logprobs, entropy)``, both fp32 [B, T], zero off target; entropy carries no gradient.
    """
    split = _split(model)
    lengths = attention_mask.sum(-1)
    has_target = target_mask.bool().any(-1)
    backbone = split[0] if split is not None else None
    if (split is None or getattr(backbone, "gradient_checkpointing", False)
            or not bool(has_target.all())):
        return token_logprobs(model, input_ids, attention_mask, target_mask,
                              temperature=temperature, chunk=chunk, with_entropy=with_entropy)
    prompts, owner, starts = _prefixes(input_ids, target_mask)
    if len(prompts) == input_ids.shape[0] or min(len(p) for p in prompts) == 0:
        return token_logprobs(model, input_ids, attention_mask, target_mask,
                              temperature=temperature, chunk=chunk, with_entropy=with_entropy)
    head = split[1]
    # 1. Each distinct prompt once, left-padded so that every prompt ends at the same column.
    width, dev = max(len(p) for p in prompts), input_ids.device
    p_ids = torch.zeros((len(prompts), width), dtype=torch.long, device=dev)
    p_mask = torch.zeros((len(prompts), width), dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        p_ids[i, width - len(p):] = torch.tensor(p, device=dev)
        p_mask[i, width - len(p):] = 1
    out = backbone(input_ids=p_ids, attention_mask=p_mask,
                   position_ids=(p_mask.cumsum(-1) - 1).clamp(min=0), use_cache=True)
    cache, last = out.cache, out.last_hidden_state[:, -1]
    cache.batch_select_indices(owner)  # row i reads prompt owner[i]'s keys and values
    # 2. The responses on top: right-padded, positions continuing each row's prompt.
    resp_len = lengths - starts
    r_width = int(resp_len.max())
    cols = torch.arange(r_width, device=dev)
    valid = cols[None] < resp_len[:, None]
    src = (starts[:, None] + cols[None]).clamp(max=input_ids.shape[1] - 1)
    r_ids = torch.where(valid, input_ids.gather(1, src), 0)
    mask = torch.cat([p_mask[owner], valid.long()], dim=1)
    hidden = backbone(input_ids=r_ids, attention_mask=mask,
                      position_ids=starts[:, None] + cols[None], cache=cache,
                      use_cache=True).last_hidden_state
    # 3. Response token j is predicted by the state before it: the prompt's last one for j = 0.
    before = torch.cat([last[owner][:, None], hidden[:, :-1]], dim=1)
    targets = valid & target_mask.bool().gather(1, src)
    rows, j = targets.nonzero(as_tuple=True)
    picked, labels = before[rows, j], r_ids[rows, j]
    lp, ent = head_logprobs(picked, head.weight, getattr(head, "bias", None), labels,
                            temperature=temperature, chunk=chunk, with_entropy=with_entropy)
    cols_out = starts[rows] + j
    logprobs = torch.zeros(target_mask.shape, dtype=torch.float32, device=dev)
    entropy = torch.zeros(target_mask.shape, dtype=torch.float32, device=dev)
    logprobs = logprobs.index_put((rows, cols_out), lp)
    entropy = entropy.index_put((rows, cols_out), ent)
    return logprobs, entropy
