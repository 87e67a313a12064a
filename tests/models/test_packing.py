"""shared_prefix_logprobs equals token_logprobs (values, entropy and gradients) to fp32 rounding."""

import pytest
import torch

from gspo.models.logprobs import token_logprobs
from gspo.models.packing import shared_prefix_logprobs
from gspo.models.tiny import build_tiny
from gspo.rollout import pad_batch


def _batch(seed=0, group=3, prompt_lens=(5, 9, 7), max_resp=8):
    """Right-padded batch: each prompt repeated ``group`` times with its own random response."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for n in prompt_lens:
        p = torch.randint(3, 250, (n,), generator=g).tolist()
        for _ in range(group):
            r = int(torch.randint(1, max_resp + 1, (1,), generator=g))
            prompts.append(p)
            responses.append(torch.randint(3, 250, (r,), generator=g).tolist())
    return pad_batch(prompts, responses, pad_id=0)


def _both(model, b, **kw):
    args = (model, b["input_ids"], b["attention_mask"], b["response_mask"])
    return token_logprobs(*args, **kw), shared_prefix_logprobs(*args, **kw)


def test_values_and_entropy_match_the_plain_path():
    model, _ = build_tiny("llama", seed=1)
    model.eval()
    b = _batch()
    with torch.no_grad():
        (lp0, ent0), (lp1, ent1) = _both(model, b, temperature=0.7, chunk=5, with_entropy=True)
    mask = b["response_mask"].bool()
    assert torch.equal(lp1 != 0, mask) and torch.equal(lp0 != 0, mask)
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent1, ent0, rtol=0, atol=1e-5)
    seq0 = (lp0 * mask).sum(1) / mask.sum(1)  # the GSPO sequence log-ratio is this difference
    seq1 = (lp1 * mask).sum(1) / mask.sum(1)
    assert (seq1 - seq0).abs().max() < 3e-6


@pytest.mark.parametrize("chunk", [7, 4096])  # several checkpointed chunks / one plain chunk
def test_gradients_match_the_plain_path(chunk):
    model, _ = build_tiny("llama", seed=2)
    model.train()
    b = _batch(seed=3)
    w = torch.randn(b["input_ids"].shape, generator=torch.Generator().manual_seed(0))
    grads = []
    for fn in (token_logprobs, shared_prefix_logprobs):
        model.zero_grad(set_to_none=True)
        lp, _ = fn(model, b["input_ids"], b["attention_mask"], b["response_mask"], chunk=chunk)
        (lp * w).sum().backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-4, atol=1e-6, msg=k)


def test_unshared_prompts_fall_back_to_the_plain_path():
    model, _ = build_tiny("llama", seed=0)
    b = _batch(group=1)
    with torch.no_grad():
        (lp0, _), (lp1, _) = _both(model, b)
    assert torch.equal(lp0, lp1)
