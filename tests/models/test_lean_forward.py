"""The lean sequence pass equals Hugging Face's ``forward``: log-probs, entropy and gradients."""

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config

from gspo.models.lean_forward import compile_unsupported, key_bias, lean_unsupported
from gspo.models.logprobs import token_logprobs
from gspo.models.packing import shared_prefix_logprobs
from gspo.models.tiny import tiny_moe_config
from gspo.rollout import pad_batch

SIZES = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128)
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")


def _model(kind: str):
    if kind == "llama":
        cfg = LlamaConfig(**SIZES, rope_scaling={"rope_type": "linear", "factor": 2.0})
    elif kind == "llama_mha":  # as many key/value heads as query heads (no grouping)
        cfg = LlamaConfig(**{**SIZES, "num_key_value_heads": 6})
    elif kind == "qwen2":  # biases on q/k/v
        cfg = Qwen2Config(**SIZES)
    elif kind in MOE:  # sparse layers: the attention above, the MoE block as its module
        cfg = tiny_moe_config(kind, vocab_size=97, hidden_size=48, num_layers=3, num_experts=4,
                              top_k=2, num_heads=6, num_kv_heads=2, max_position_embeddings=128)
    else:  # qwen3: RMS norm on each query/key head; head_dim not hidden / heads
        cfg = Qwen3Config(**SIZES, head_dim=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # nonzero biases and norm weights, so a skipped one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _batch(seed=0):
    """Right-padded rows: three prompts of different lengths, each with three responses."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for n in (5, 9, 7):
        p = torch.randint(3, 97, (n,), generator=g).tolist()
        for _ in range(3):
            r = int(torch.randint(1, 9, (1,), generator=g))
            prompts.append(p)
            responses.append(torch.randint(3, 97, (r,), generator=g).tolist())
    return pad_batch(prompts, responses, pad_id=0)


def _run(fn, model, b, lean, compiled=False):
    model.zero_grad(set_to_none=True)
    lp, ent = fn(model, b["input_ids"], b["attention_mask"], b["response_mask"],
                 temperature=0.7, chunk=5, with_entropy=True, lean=lean, compiled=compiled)
    (lp * torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)).sum().backward()
    return lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("fn", [token_logprobs, shared_prefix_logprobs])
@pytest.mark.parametrize("kind", ["llama", "llama_mha", "qwen2", "qwen3", *MOE])
def test_lean_pass_equals_forward_values_and_gradients(kind, fn):
    model = _model(kind).train()
    assert lean_unsupported(model) is None
    b = _batch()
    lp0, ent0, g0 = _run(fn, model, b, lean=False)
    lp1, ent1, g1 = _run(fn, model, b, lean=True)
    mask = b["response_mask"].bool()
    assert torch.equal(lp1 != 0, mask)
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=2e-6)
    torch.testing.assert_close(ent1, ent0, rtol=0, atol=2e-6)
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)
        assert torch.isfinite(g1[name]).all(), name


@pytest.mark.slow  # inductor compiles C++ kernels: ~1 min a model on 2 cores, cold cache
@pytest.mark.skipif(compile_unsupported(torch.device("cpu")) is not None,
                    reason="no C++ compiler for torch.compile's inductor")
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_compiled_layers_equal_the_eager_lean_pass(kind):
    """compile_layers: each layer through torch.compile (one graph for every layer, dynamic
    shapes) gives the eager lean pass's log-probs and gradients to fp32 rounding, on the
    packed path (prompts and responses through each layer together) and the plain one, with
    and without autograd, for batches of other lengths than the first (no recompilation per
    shape or per layer)."""
    from torch._dynamo.utils import counters

    from gspo.models import lean_forward

    torch._dynamo.reset()
    counters.clear()
    lean_forward._COMPILED.clear()
    model = _model(kind).train()
    for seed, fn in ((0, shared_prefix_logprobs), (1, shared_prefix_logprobs),
                     (2, token_logprobs)):
        b = _batch(seed)
        lp0, ent0, g0 = _run(fn, model, b, lean=True)
        lp1, ent1, g1 = _run(fn, model, b, lean=True, compiled=True)
        torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-5)
        torch.testing.assert_close(ent1, ent0, rtol=0, atol=1e-5)
        for name in g0:
            torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-5, msg=name)
        with torch.inference_mode():  # the π_old pass
            args = (model, b["input_ids"], b["attention_mask"], b["response_mask"])
            torch.testing.assert_close(fn(*args, lean=True, compiled=True)[0],
                                       fn(*args, lean=True)[0], rtol=0, atol=1e-5)
    assert set(lean_forward._COMPILED) == {"lean", "joint"}  # both kinds of layer compiled
    assert counters["frames"]["ok"] >= 2
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_left_padded_queries_stay_finite_and_mask_matches_its_definition():
    """key_bias: query i (column K − S + i) sees key j ≤ that column where the key is real; a
    query with no such key (left padding) sees every key rather than none (NaN)."""
    key_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    bias = key_bias(key_mask, 3, torch.float32)
    assert bias.shape == (2, 1, 3, 5)
    for b in range(2):
        for i in range(3):
            for j in range(5):
                seen = j <= 2 + i and bool(key_mask[b, j])
                assert (bias[b, 0, i, j] == 0) == seen
    full = key_bias(torch.tensor([[0, 0, 1]]), 3, torch.float32)
    assert torch.equal(full[0, 0, :2], torch.zeros(2, 3))  # padding queries: every key
    assert full[0, 0, 2].tolist() == [float("-inf"), float("-inf"), 0.0]


def test_unsupported_names_what_forward_would_do_differently():
    model = _model("llama")
    model.gradient_checkpointing_enable()
    assert "gradient checkpointing" in lean_unsupported(model)
    cfg = LlamaConfig(**SIZES, attention_dropout=0.1)
    assert "dropout" in lean_unsupported(AutoModelForCausalLM.from_config(cfg))
    other = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=97, n_embd=48, n_layer=2,
                                                        n_head=6, n_positions=64))
    assert "model type" in lean_unsupported(other)


def test_fast_generate_returns_normal_tensors_and_leaves_module_state_alone():
    """The sampler's fast path runs in inference mode: its log-probs come back as normal
    tensors (autograd and in-place writes accept them), and a rope that adapts to the
    length seen keeps it off (its buffer would become an inference tensor)."""
    from gspo.models.lean_forward import inference_safe
    from gspo.rollout import SamplingParams, generate

    for kind, safe in (("llama", True), ("llama_dynamic", False)):
        model = _model(kind) if kind == "llama" else AutoModelForCausalLM.from_config(
            LlamaConfig(**{**SIZES, "max_position_embeddings": 12},
                        rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
        assert inference_safe(model) is safe
        roll = generate(model, [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]], group_size=2,
                        params=SamplingParams(6), eos=[1], pad_id=0,
                        generator=torch.Generator().manual_seed(0))
        assert not any(lp.is_inference() for lp in roll.logprobs)
        roll.logprobs[0].add_(0.0)  # an inference tensor would refuse this
        assert not any(b.is_inference() for b in model.buffers())


def test_compile_unsupported_names_the_missing_compiler(monkeypatch):
    """compile_layers on a CPU without a C++ compiler: one line naming what is missing, before
    the first step (inductor would fail inside it with a long trace)."""
    import gspo.models.lean_forward as lf

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(lf.shutil, "which", lambda name: None)
    assert "C++ compiler" in lf.compile_unsupported(torch.device("cpu"))
    monkeypatch.setattr(lf.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert lf.compile_unsupported(torch.device("cpu")) is None


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2_moe"])
def test_packed_lean_pass_multiplies_each_weight_once(kind, monkeypatch):
    """The packed lean pass runs the prompts and the responses through each layer together:
    every attention and MLP weight enters one matrix product per forward (two when the passes
    run one after the other, ``JOINT_LAYERS=False``), with the same log-probs and gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import gspo.models.packing as packing

    class Products(TorchDispatchMode):
        def __init__(self, weights):
            super().__init__()
            self.weights, self.calls = weights, dict.fromkeys(weights.values(), 0)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                        torch.ops.aten.bmm.default):
                for a in args:
                    name = self.weights.get(getattr(a, "data_ptr", lambda: None)())
                    if name is not None:
                        self.calls[name] += 1
            return func(*args, **(kwargs or {}))

    model = _model(kind).train()
    # attention and dense-MLP projections (an MoE block runs as its module on each part)
    weights = {p.data_ptr(): n for n, p in model.named_parameters()
               if (".self_attn." in n and n.endswith("proj.weight"))
               or n.split(".mlp.")[-1] in ("gate_proj.weight", "up_proj.weight",
                                           "down_proj.weight")}
    assert len(weights) == (4 if "moe" in kind else 7) * 3
    b = _batch()
    args = (model, b["input_ids"], b["attention_mask"], b["response_mask"])
    out = {}
    for joint in (True, False):
        monkeypatch.setattr(packing, "JOINT_LAYERS", joint)
        with torch.no_grad(), Products(weights) as count:
            shared_prefix_logprobs(*args, lean=True)
        assert set(count.calls.values()) == {1 if joint else 2}, count.calls
        out[joint] = _run(shared_prefix_logprobs, model, b, lean=True)
    (lp1, ent1, g1), (lp0, ent0, g0) = out[True], out[False]
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=2e-6)
    torch.testing.assert_close(ent1, ent0, rtol=0, atol=2e-6)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("fn", [token_logprobs, shared_prefix_logprobs])
def test_layer_boundaries_are_called_between_layers_forward_and_backward(fn):
    """at_layer_boundaries: the callable runs before each layer of the forward and after each
    layer's backward (3 layers: 3 + 3), nothing outside the block, the numbers unchanged."""
    from gspo.models.lean_forward import at_layer_boundaries

    model, b = _model("llama").train(), _batch()
    lp0, _, g0 = _run(fn, model, b, lean=True)
    calls: list[str] = []
    with at_layer_boundaries(  # autograd records in the forward, not in the backward
            lambda: calls.append("forward" if torch.is_grad_enabled() else "backward")):
        lp1, _, g1 = _run(fn, model, b, lean=True)
    assert calls == ["forward"] * 3 + ["backward"] * 3
    assert torch.equal(lp0, lp1) and all(torch.equal(g0[n], g1[n]) for n in g0)
    _run(fn, model, b, lean=True)
    assert len(calls) == 6
