"""Per-token log-probabilities of given tokens, in fp32, without (B, T, V) fp32 logits at once.

The backbone runs once; the output layer and log-softmax run over the response positions only,
``chunk`` positions at a time. Under autograd each chunk is checkpointed, so its logits are
recomputed in backward instead of being kept: peak extra memory is one chunk of logits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

# Config attributes of heads that do more than a linear layer; those models take the slow path.
_HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")


def _split(model: Any) -> tuple[Any, Any] | None:
    """(backbone, head) when logits are exactly ``head(backbone(...))``, else None."""
    if hasattr(model, "get_base_model"):  # PEFT wrapper: the transformers model inside
        model = model.get_base_model()
    if any(getattr(model.config, a, None) not in (None, 1, 1.0) for a in _HEAD_EXTRAS):
        return None
    backbone = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    head = model.get_output_embeddings()
    if backbone is None or head is None or backbone is model:
        return None
    return backbone, head


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    labels: torch.Tensor, temperature: float,
                    with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.nn.functional.linear(hidden.float(), weight.float(),
                                        None if bias is None else bias.float())
    logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, labels[:, None]).squeeze(-1)
    entropy = torch.zeros_like(lse)
    if with_entropy:
        with torch.no_grad():
            entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return picked - lse, entropy


def token_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   target_mask: torch.Tensor, *, temperature: float = 1.0, chunk: int = 256,
                   position_ids: torch.Tensor | None = None,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(x_t | x_<t) / entropy at every position where ``target_mask`` is 1, zero elsewhere.

    Args:
        input_ids, attention_mask, target_mask: [B, T]; position 0 is never a target.
        temperature: logits are divided by it (the rollout's sampling temperature).
        with_entropy: also compute the policy's entropy at those positions (else zeros).
    Returns:
        ``(logprobs, entropy)``, both fp32 [B, T]; entropy carries no gradient.
    """
    target_mask = target_mask.bool()
    rows, cols = target_mask[:, 1:].nonzero(as_tuple=True)
    labels = input_ids[rows, cols + 1]
    split = _split(model)
    if split is not None:
        backbone, head = split
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids, use_cache=False).last_hidden_state
        weight, bias = head.weight, getattr(head, "bias", None)
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=position_ids, use_cache=False).logits
        hidden, weight, bias = logits, None, None
    picked = hidden[rows, cols]  # hidden state (or logits) that predicts each target token
    out_lp, out_ent = [], []
    for start in range(0, picked.shape[0], chunk):
        h, y = picked[start:start + chunk], labels[start:start + chunk]
        if weight is None:
            logits = h.float() / temperature
            lp = logits.gather(-1, y[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
            ent = torch.zeros_like(lp).detach()
        elif torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk_logprobs, h, weight, bias, y, temperature, with_entropy,
                                 use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(h, weight, bias, y, temperature, with_entropy)
        out_lp.append(lp)
        out_ent.append(ent)
    shape = target_mask.shape
    logprobs = torch.zeros(shape, dtype=torch.float32, device=input_ids.device)
    entropy = torch.zeros(shape, dtype=torch.float32, device=input_ids.device)
    if out_lp:
        logprobs = logprobs.index_put((rows, cols + 1), torch.cat(out_lp))
        entropy = entropy.index_put((rows, cols + 1), torch.cat(out_ent).detach())
    return logprobs, entropy
