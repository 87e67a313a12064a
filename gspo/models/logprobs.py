"""Per-token log-probabilities of given tokens, in fp32, without (B, T, V) fp32 logits at once.

The backbone runs once; the output layer and log-softmax run over the response positions only,
``chunk`` positions at a time. Under autograd the head runs through :class:`ChunkedHeadLogprobs`,
whose hand-written backward rebuilds one chunk of logits at a time and turns it in place into its
own gradient, so the peak extra memory is about one [chunk, V] fp32 buffer (autograd with
per-chunk checkpointing holds three to five; benchmarks/bench_update.py measures both).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from gspo.models.lean_forward import key_bias, lean_hidden
from gspo.models.onednn import linear as onednn_linear
from gspo.models.onednn import mm

# Config attributes of heads that do more than a linear layer; those models take the slow path:
# Gemma 2/3 and Inkling 2 (soft-capping), Cohere (logit_scale), Granite and MiniCPM3
# (logits_scaling), Falcon-H1 (lm_head_multiplier), Inkling (logits_mup_width_multiplier),
# RecurrentGemma (logits_soft_cap).
_HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier",
                "lm_head_multiplier", "logits_mup_width_multiplier", "logits_soft_cap")


def _split(model: Any) -> tuple[Any, Any] | None:
    """(backbone, head) when logits are exactly ``head(backbone(...))``, else None."""
    if hasattr(model, "get_base_model"):  # PEFT wrapper: the transformers model inside
        model = model.get_base_model()
    configs = (model.config, model.config.get_text_config())
    if any(getattr(c, a, None) not in (None, 1, 1.0) for c in configs for a in _HEAD_EXTRAS):
        return None
    if any(getattr(c, "unpadded_vocab_size", None) not in (None, c.vocab_size)
           for c in configs):  # logits cut to the unpadded vocabulary (Inkling)
        return None
    backbone = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    head = model.get_output_embeddings()
    if backbone is None or head is None or backbone is model:
        return None
    # the backbone and the head are the model's only children with weights: not a head that
    # is the last layer of a prediction head (BERT-style ``lm_head.decoder``, whose dense,
    # activation and norm come first) or follows another module (ModernBERT's decoder)
    weighted = [c for c in model.children() if next(c.parameters(), None) is not None]
    if not any(c is head for c in weighted) or any(c is not head and c is not backbone
                                                   for c in weighted):
        return None
    if not isinstance(head, torch.nn.Linear):  # e.g. a LoRA-adapted output layer, whose
        return None  # ``weight`` is its base layer's: the adapter's term would be left out
    return backbone, head


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    labels: torch.Tensor, temperature: float,
                    with_entropy: bool = False, onednn: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    logits = (mm if onednn else F.linear)(hidden.float(), weight.float(),
                                           None if bias is None else bias.float())
    logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, labels[:, None]).squeeze(-1)
    entropy = torch.zeros_like(lse)
    if with_entropy:
        with torch.no_grad():
            entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return picked - lse, entropy


class ChunkedHeadLogprobs(torch.autograd.Function):
    """log_softmax(h Wᵀ + b)[y] / T-scaled, chunk by chunk, with a hand-written backward.

    Forward keeps only ``h``, ``W``, ``b``, ``y`` and one logsumexp per row; backward
    recomputes one chunk of logits at a time and turns it *in place* into
    ∂lp/∂z = onehot(y) − softmax(z), so the peak is about one [chunk, V] fp32 buffer (autograd
    with checkpointing holds three to five). Same values as :func:`_chunk_logprobs`.
    ``onednn``: the logits and ∂h products through oneDNN (:mod:`gspo.models.onednn`); ∂W
    stays one accumulating BLAS product per chunk.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, temperature: float, chunk: int,
                with_entropy: bool, onednn: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        out, ent = torch.empty_like(lse), torch.zeros_like(lse)
        w, b = weight.float(), None if bias is None else bias.float()
        product = mm if onednn else F.linear
        for s in range(0, hidden.shape[0], chunk):
            z = product(hidden[s:s + chunk].float(), w, b).div_(temperature)
            lse[s:s + chunk] = torch.logsumexp(z, dim=-1)
            out[s:s + chunk] = z.gather(-1, labels[s:s + chunk, None]).squeeze(-1)
            if with_entropy:  # H = lse − Σ p z
                ent[s:s + chunk] = lse[s:s + chunk] - (torch.softmax(z, -1) * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.temperature, ctx.chunk, ctx.onednn = temperature, chunk, onednn
        ctx.mark_non_differentiable(ent)
        return out - lse, ent

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        w, b = weight.float(), None if bias is None else bias.float()
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        # Every row of g_h is written and g_w / g_b start from the first chunk's product, so
        # nothing is zero-filled (at V × H = 49k × 576 a fill costs as much as a small matmul).
        g_h = torch.empty_like(hidden, dtype=torch.float32) if need_h else None
        g_w = g_b = None
        product = mm if ctx.onednn else F.linear
        for s in range(0, hidden.shape[0], chunk):
            h, y, g = hidden[s:s + chunk].float(), labels[s:s + chunk], grad[s:s + chunk] / t
            z = product(h, w, b).div_(t)
            dz = z.sub_(lse[s:s + chunk, None]).exp_().mul_(-g[:, None])  # −g·softmax, in place
            dz[torch.arange(len(y), device=y.device), y] += g  # + g·onehot(y)
            if g_h is not None and ctx.onednn:
                g_h[s:s + chunk] = mm(dz, w.t(), None)
            elif g_h is not None:
                torch.mm(dz, w, out=g_h[s:s + chunk])
            if need_w:
                g_w = dz.t() @ h if g_w is None else g_w.addmm_(dz.t(), h)
            if need_b and b is not None:
                g_b = dz.sum(0) if g_b is None else g_b.add_(dz.sum(0))
        if need_w and g_w is None:  # no rows
            g_w = torch.zeros_like(w)
        if need_b and b is not None and g_b is None:
            g_b = torch.zeros_like(b)
        cast = lambda x, like: None if x is None else x.to(like.dtype)  # noqa: E731
        return (cast(g_h, hidden), cast(g_w, weight),
                None if bias is None else cast(g_b, bias), None, None, None, None, None)


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  labels: torch.Tensor, *, temperature: float = 1.0, chunk: int = 256,
                  with_entropy: bool = False, onednn: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π(y | h) [M], entropy [M]) through the output layer, in fp32, chunk rows at a time.

    Under autograd it runs :class:`ChunkedHeadLogprobs`; without, plain chunks. The entropy
    never carries a gradient. Args: hidden [M, H], weight [V, H], bias [V], labels [M];
    ``onednn``: the products through oneDNN (:mod:`gspo.models.onednn`).
    """
    if torch.is_grad_enabled():
        return ChunkedHeadLogprobs.apply(hidden, weight, bias, labels, temperature, chunk,
                                         with_entropy, onednn)
    lps, ents = [], []
    for s in range(0, hidden.shape[0], chunk):
        lp, ent = _chunk_logprobs(hidden[s:s + chunk], weight, bias, labels[s:s + chunk],
                                  temperature, with_entropy, onednn)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(lps), torch.cat(ents).detach()


def token_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   target_mask: torch.Tensor, *, temperature: float = 1.0, chunk: int = 256,
                   position_ids: torch.Tensor | None = None, with_entropy: bool = False,
                   lean: bool = False, compiled: bool = False, onednn: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(x_t | x_<t) / entropy at every position where ``target_mask`` is 1, zero elsewhere.

    Args:
        input_ids, attention_mask, target_mask: [B, T]; position 0 is never a target.
        temperature: logits are divided by it (the rollout's sampling temperature).
        with_entropy: also compute the policy's entropy at those positions (else zeros).
        lean: run the backbone through :func:`gspo.models.lean_forward.lean_hidden` (same
            arithmetic, less per-call work); the caller has checked
            :func:`gspo.models.lean_forward.lean_unsupported`.
        compiled: with ``lean``, each layer through torch.compile
            (:func:`gspo.models.lean_forward.compiled_layer`; equal to fp32 rounding).
        onednn: with ``lean``, the eager layers' and the output layer's products through
            oneDNN (:func:`gspo.models.onednn.linear`; equal to BLAS's to fp32 rounding).
    Returns:
        ``(logprobs, entropy)``, both fp32 [B, T]; entropy carries no gradient.
    """
    target_mask = target_mask.bool()
    rows, cols = target_mask[:, 1:].nonzero(as_tuple=True)
    labels = input_ids[rows, cols + 1]
    split = _split(model)
    if split is not None:
        backbone, head = split
        if lean:
            if position_ids is None:  # forward's default: the column index
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
            attn_bias = key_bias(attention_mask, input_ids.shape[1], head.weight.dtype)
            hidden = lean_hidden(backbone, input_ids, position_ids.expand_as(input_ids),
                                 attn_bias, compiled=compiled,
                                 linear=onednn_linear if onednn else F.linear)[0]
        else:
            hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids, use_cache=False).last_hidden_state
        weight, bias = head.weight, getattr(head, "bias", None)
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=position_ids, use_cache=False).logits
        hidden, weight, bias = logits, None, None
    picked = hidden[rows, cols]  # hidden state (or logits) that predicts each target token
    if weight is not None:
        lp, ent = head_logprobs(picked, weight, bias, labels, temperature=temperature,
                                chunk=chunk, with_entropy=with_entropy,
                                onednn=onednn and lean)
    else:  # the model's own logits (a head that is not a plain linear layer)
        logits = picked.float() / temperature
        lp = logits.gather(-1, labels[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
        with torch.no_grad():
            ent = (torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)
                   if with_entropy else torch.zeros_like(lp))
    shape = target_mask.shape
    logprobs = torch.zeros(shape, dtype=torch.float32, device=input_ids.device)
    entropy = torch.zeros(shape, dtype=torch.float32, device=input_ids.device)
    logprobs = logprobs.index_put((rows, cols + 1), lp)
    entropy = entropy.index_put((rows, cols + 1), ent)
    return logprobs, entropy
