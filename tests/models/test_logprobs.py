import pytest
import torch

from gspo.models.logprobs import _chunk_logprobs, head_logprobs, token_logprobs
from gspo.models.tiny import build_tiny


def _batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (3, 12), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 9:] = 0  # right padding
    target = torch.zeros(3, 12)
    target[:, 5:] = 1
    target[1, 9:] = 0
    return ids, attn, target


def _naive(model, ids, attn, target, temperature):
    logits = model(input_ids=ids, attention_mask=attn).logits.float() / temperature
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    out = torch.zeros(ids.shape)
    out[:, 1:] = lp
    return out * target


def test_chunked_logprobs_match_full_log_softmax_value_and_grad():
    model, _ = build_tiny("llama", seed=0)
    ids, attn, target = _batch(model.config.vocab_size)
    ref = _naive(model, ids, attn, target, 0.7)
    ref.sum().backward()
    ref_grad = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    lp, _ = token_logprobs(model, ids, attn, target, temperature=0.7, chunk=5)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)
    lp.sum().backward()
    for a, b in zip([p.grad for p in model.parameters()], ref_grad):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_padding_and_batch_composition_do_not_change_logprobs():
    model, _ = build_tiny("llama", seed=1)
    ids, attn, target = _batch(model.config.vocab_size, seed=3)
    with torch.no_grad():
        full, _ = token_logprobs(model, ids, attn, target)
        alone, _ = token_logprobs(model, ids[1:2, :9], attn[1:2, :9], target[1:2, :9])
    diff = (full[1, :9] - alone[0]).abs().max()
    assert diff < 1e-5
    assert torch.all(full[target == 0] == 0)


def test_entropy_is_computed_only_when_asked():
    model, _ = build_tiny("llama", seed=2)
    ids, attn, target = _batch(model.config.vocab_size)
    with torch.no_grad():
        _, none = token_logprobs(model, ids, attn, target)
        _, ent = token_logprobs(model, ids, attn, target, with_entropy=True)
    assert torch.all(none == 0)
    valid = ent[target.bool()]
    assert torch.all(valid > 0) and torch.all(valid <= torch.log(torch.tensor(259.0)) + 1e-4)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_head_matches_autograd(bias):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    b = torch.randn(50, generator=g, requires_grad=True) if bias else None
    y = torch.randint(0, 50, (37,), generator=g)
    up = torch.randn(37, generator=g)
    grads = []
    for fused in (False, True):  # the hand-written backward vs autograd through the same math
        if fused:
            lp, _ = head_logprobs(h, w, b, y, temperature=0.7, chunk=8)
        else:
            lp, _ = _chunk_logprobs(h, w, b, y, 0.7)
        inputs = [h, w] + ([b] if bias else [])
        grads.append((lp.detach(), torch.autograd.grad((lp * up).sum(), inputs)))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-6, atol=1e-6)
    for a, c in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6)


def test_fused_head_entropy_under_autograd_matches_the_no_grad_path():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(20, 8, generator=g, requires_grad=True)
    w = torch.randn(30, 8, generator=g)
    y = torch.randint(0, 30, (20,), generator=g)
    lp, ent = head_logprobs(h, w, None, y, temperature=0.9, chunk=6, with_entropy=True)
    with torch.no_grad():
        lp0, ent0 = _chunk_logprobs(h, w, None, y, 0.9, True)
    torch.testing.assert_close(ent, ent0)
    torch.testing.assert_close(lp.detach(), lp0)
    assert not ent.requires_grad and lp.requires_grad


def _head_model(kind: str):
    """Causal LMs whose logits are more than a linear layer on the backbone's last states."""
    from transformers import (
        AutoModelForCausalLM,
        FalconH1Config,
        ModernBertDecoderConfig,
        RecurrentGemmaConfig,
        RobertaConfig,
    )

    small = dict(vocab_size=97, intermediate_size=64, num_hidden_layers=2, pad_token_id=0)
    if kind == "falcon_h1":  # logits times lm_head_multiplier
        cfg = FalconH1Config(**small, hidden_size=64, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4,
                             mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
                             mamba_chunk_size=8, lm_head_multiplier=0.25)
    elif kind == "recurrent_gemma":  # tanh soft-cap of the logits
        cfg = RecurrentGemmaConfig(**{**small, "num_hidden_layers": 3}, hidden_size=64,
                                   num_attention_heads=4, num_key_value_heads=1, lru_width=64,
                                   attention_window_size=16, logits_soft_cap=2.0)
    elif kind == "roberta":  # output embeddings = lm_head.decoder, after dense, GELU, norm
        cfg = RobertaConfig(**small, hidden_size=32, num_attention_heads=4, is_decoder=True)
    else:  # modernbert_decoder: decoder(lm_head(h)), lm_head a dense + norm prediction head
        cfg = ModernBertDecoderConfig(**small, hidden_size=32, num_attention_heads=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # weights large enough that a skipped scale or transform shows
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
    return model


@pytest.mark.parametrize("kind", ["falcon_h1", "recurrent_gemma", "roberta",
                                  "modernbert_decoder"])
def test_heads_that_are_more_than_a_linear_layer_take_the_models_logits(kind):
    model = _head_model(kind)
    ids, attn, target = _batch(model.config.vocab_size)
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, attn, target, temperature=0.7)
        ref = _naive(model, ids, attn, target, 0.7)
    torch.testing.assert_close(lp, ref, rtol=0, atol=1e-5)


def test_plain_linear_heads_keep_the_fast_path():
    from gspo.models.logprobs import _split

    for name in ("llama", "qwen3_moe", "mixtral", "qwen2_moe"):
        assert _split(build_tiny(name)[0]) is not None, name
