"""``matmul=onednn``: the trainer's log-prob passes with their products through oneDNN equal the
BLAS (``F.linear``) passes to fp32 rounding, values and gradients; ``auto``'s choice."""

import pytest
import torch
import torch.nn.functional as F

from gspo.models import onednn
from gspo.models.decode import onednn_available
from gspo.models.logprobs import head_logprobs, token_logprobs
from gspo.models.packing import shared_prefix_logprobs

from .test_lean_forward import MOE, _batch, _model

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch without oneDNN")


@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear_values_and_gradients(bias):
    """Forward, ∂x, ∂W, ∂b of a 3-D input, against F.linear (float64 as the reference)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 40, generator=g, requires_grad=True)
    w = torch.randn(24, 40, generator=g, requires_grad=True)
    b = torch.randn(24, generator=g, requires_grad=True) if bias else None
    up = torch.randn(3, 7, 24, generator=g)
    got = onednn.linear(x, w, b)
    gots = torch.autograd.grad((got * up).sum(), [x, w, *([b] if bias else [])])
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    refs = torch.autograd.grad((ref * up.double()).sum(), [x, w, *([b] if bias else [])])
    assert got.shape == ref.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    for a, r in zip(gots, refs):
        torch.testing.assert_close(a.double(), r.double(), rtol=1e-5, atol=1e-5)
    empty = onednn.linear(torch.zeros(0, 40), w.detach())  # no rows: no oneDNN call
    assert empty.shape == (0, 24)


@pytest.mark.parametrize("fn", [token_logprobs, shared_prefix_logprobs])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", MOE[1]])
def test_passes_through_onednn_equal_blas_values_and_gradients(kind, fn):
    """The lean passes (plain and packed) with ``onednn``: log-probs, entropy and every
    parameter's gradient equal BLAS's to fp32 rounding, and oneDNN ran every dense product
    (none left to ``F.linear``: an MoE's experts, its own module, excepted)."""
    model = _model(kind).train()
    b = _batch()
    out = {}
    for flag in (False, True):
        model.zero_grad(set_to_none=True)
        calls = {"linear": 0}
        real = torch.ops.mkldnn._linear_pointwise

        def counted(*a, real=real, calls=calls):
            calls["linear"] += 1
            return real(*a)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(onednn, "mm", lambda x, w, bias: counted(x, w, bias, "none", [], "")
                       if x.shape[0] else F.linear(x, w, bias))
            lp, ent = fn(model, b["input_ids"], b["attention_mask"], b["response_mask"],
                         temperature=0.7, chunk=5, with_entropy=True, lean=True, onednn=flag)
            (lp * torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)).sum().backward()
        out[flag] = (lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()
                                        if p.grad is not None}, calls["linear"])
    (lp0, ent0, g0, n0), (lp1, ent1, g1, n1) = out[False], out[True]
    assert n0 == 0 and n1 > 0
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent1, ent0, rtol=0, atol=1e-5)
    assert g1.keys() == g0.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-5, msg=name)


def test_head_through_onednn_without_autograd_equals_blas():
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(11, 32, generator=g), torch.randn(50, 32, generator=g)
    y = torch.randint(0, 50, (11,), generator=g)
    with torch.inference_mode():
        a = head_logprobs(h, w, None, y, chunk=4, with_entropy=True)
        c = head_logprobs(h, w, None, y, chunk=4, with_entropy=True, onednn=True)
    for x0, x1 in zip(a, c):
        torch.testing.assert_close(x1, x0, rtol=0, atol=1e-5)


def test_auto_uses_onednn_only_on_amd_with_avx512_and_large_layers(monkeypatch):
    """``pays``: None (oneDNN) for a large fp32 CPU model on an AMD CPU with AVX-512; a reason
    otherwise: another vendor, no AVX-512, layers too small (the tiny presets), not fp32."""
    import gspo.models.decode as decode

    model = _model("llama")
    amd = ("AuthenticAMD", frozenset({"avx2", "avx512f"}))
    monkeypatch.setattr(onednn, "_cpu", lambda: amd)
    assert "too small" in onednn.pays(model)
    monkeypatch.setattr(decode, "packing_pays", lambda m: True)
    assert onednn.pays(model) is None
    monkeypatch.setattr(onednn, "_cpu", lambda: ("GenuineIntel", amd[1]))
    assert "GenuineIntel" in onednn.pays(model)
    monkeypatch.setattr(onednn, "_cpu", lambda: ("AuthenticAMD", frozenset({"avx2"})))
    assert "without AVX-512" in onednn.pays(model)
    monkeypatch.setattr(onednn, "_cpu", lambda: amd)
    assert "float64" in onednn.pays(model.double())
    from gspo.config import LoRAConfig
    from gspo.models.lora import apply_lora

    assert "lean passes do not take" in onednn.pays(apply_lora(model, LoRAConfig(r=4, alpha=8)))
