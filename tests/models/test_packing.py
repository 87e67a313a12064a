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


def _adaptive_rope_model(kind):
    from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config

    sizes = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    if kind == "phi3_longrope":  # Phi-3/Phi-4-mini: short factors up to 12 positions, then long
        cfg = Phi3Config(**sizes, max_position_embeddings=64, original_max_position_embeddings=12,
                         rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 4,
                                       "long_factor": [3.0] * 4})
    else:  # dynamic NTK past 8 positions
        cfg = LlamaConfig(**sizes, max_position_embeddings=8,
                          rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


@pytest.mark.parametrize("lean", [False, True])
@pytest.mark.parametrize("kind", ["phi3_longrope", "llama_dynamic"])
def test_rope_that_adapts_to_the_length_takes_the_plain_path(kind, lean):
    """Its cos/sin depend on the largest position of each call: the prompt pass (short) and the
    response pass, or the joint pass's padded response positions (past the batch's width),
    would rotate with other frequencies than the plain pass over [B, T]."""
    if lean and kind == "phi3_longrope":
        pytest.skip("the lean passes do not take Phi-3")
    g = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for n, lens in ((3, (8, 8, 8)), (9, (1, 1, 2))):  # T = 11; padded positions reach 16
        p = torch.randint(3, 250, (n,), generator=g).tolist()
        for r in lens:
            prompts.append(p)
            responses.append(torch.randint(3, 250, (r,), generator=g).tolist())
    b = pad_batch(prompts, responses, pad_id=0)
    args = (b["input_ids"], b["attention_mask"], b["response_mask"])
    with torch.no_grad():  # a fresh model each: the rotary module keeps what it has seen
        lp0, _ = token_logprobs(_adaptive_rope_model(kind), *args)
        lp1, _ = shared_prefix_logprobs(_adaptive_rope_model(kind), *args, lean=lean)
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-5)


# --- Mixture-of-Experts: routing recorded and replayed through a packed pass keeps [B*T, k] ---

def _moe(family, seed=0):
    from gspo.models.tiny import tiny_moe_config

    torch.manual_seed(seed)
    cfg = tiny_moe_config(family, vocab_size=256, hidden_size=32, num_layers=2, num_experts=8,
                          top_k=2, num_heads=4, num_kv_heads=2)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(cfg).float()


def _real(b):
    """Flat [B*T] positions of real tokens (prompt and response, not padding)."""
    return b["attention_mask"].bool().reshape(-1)


MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.mark.parametrize("lean", [False, True])  # through forward / the joint lean pass
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_packed_capture_records_the_plain_layout(family, lean):
    from gspo.models.moe import capture_routing

    model = _moe(family).eval()
    b = _batch(seed=4)
    args = (model, b["input_ids"], b["attention_mask"], b["response_mask"])
    with torch.no_grad():
        with capture_routing(model) as plain:
            lp0, _ = token_logprobs(*args, lean=lean)
        with capture_routing(model, record_logits=True) as packed:
            lp1, _ = shared_prefix_logprobs(*args, lean=lean)
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-5)
    real = _real(b)
    n = b["input_ids"].numel()
    for old, new, logits in zip(plain.indices, packed.indices, packed.logits, strict=True):
        assert new.shape == old.shape == (n, 2) and logits.shape == (n, 8)
        assert torch.equal(new[real].sort(-1).values, old[real].sort(-1).values)
        assert torch.equal(logits.topk(2, -1).indices, new)  # logits follow the same layout


@pytest.mark.parametrize("lean", [False, True])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_packed_replay_equals_plain_replay(family, lean):
    """Replaying one recorded routing (here: random experts, far from the router's own) through
    the packed pass gives the plain pass's replayed log-probs, and its gradients."""
    from gspo.models.moe import replay_routing

    model = _moe(family, seed=1).train()
    b = _batch(seed=5)
    n = b["input_ids"].numel()
    g = torch.Generator().manual_seed(0)
    forced = [torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(n)])
              for _ in range(2)]
    # a shared prompt routes alike in every row that holds it, as any recorded routing does
    # (the packed pass runs it once and replays its first row's experts)
    starts = b["response_mask"].int().argmax(-1)
    for f in forced:
        rows = f.view(*b["input_ids"].shape, 2)
        for r in range(1, rows.shape[0]):
            if r % 3:  # _batch: groups of 3 rows
                rows[r, :starts[r]] = rows[r - r % 3, :starts[r]]
    w = torch.randn(b["input_ids"].shape, generator=g)
    out = []
    for fn in (token_logprobs, shared_prefix_logprobs):
        model.zero_grad(set_to_none=True)
        with replay_routing(model, forced) as rep:
            lp, _ = fn(model, b["input_ids"], b["attention_mask"], b["response_mask"],
                       lean=lean)
            (lp * w).sum().backward()
        out.append((lp.detach(), {k: p.grad.clone() for k, p in model.named_parameters()
                                  if p.grad is not None}, rep.calls))
    (lp0, g0, calls0), (lp1, g1, calls1) = out
    assert (calls0, calls1) == (2, 4)  # two routers; the packed pass calls each twice
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-5)
    assert g0.keys() == g1.keys()
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-6, msg=k)
    with torch.no_grad(), replay_routing(model, [f[:-1] for f in forced]):
        with pytest.raises(ValueError, match="same \\(B, T\\) layout"):
            shared_prefix_logprobs(model, b["input_ids"], b["attention_mask"],
                                   b["response_mask"], lean=lean)


@pytest.mark.parametrize("lean", [False, True])
def test_moe_packed_aux_logits_follow_the_plain_layout(lean):
    """The load-balancing loss reads router logits with gradient in the [B*T] layout."""
    from gspo.trainer.moe_hooks import moe_forward

    model = _moe("qwen3_moe", seed=2).train()
    b = _batch(seed=6)
    got = []
    for fn in (token_logprobs, shared_prefix_logprobs):
        with moe_forward(model, None, False, True) as out:
            fn(model, b["input_ids"], b["attention_mask"], b["response_mask"], lean=lean)
        got.append(out["live_logits"])
    real = _real(b)
    assert len(got[1]) == 2 and all(x.requires_grad for x in got[1])
    for plain, packed in zip(*got, strict=True):
        assert packed.shape == plain.shape
        torch.testing.assert_close(packed[real], plain[real], rtol=0, atol=1e-5)
