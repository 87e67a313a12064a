"""rollout.engine=llamacpp: the Q8_0 GGUF export (always) and the engine (with llama-cpp-python)."""

from __future__ import annotations

import sys
from typing import ClassVar

import numpy as np
import pytest
import torch

from gspo.models import token_logprobs
from gspo.models.tiny import build_tiny
from gspo.rollout import ENGINES, EngineOptions, SamplingParams, build_engine, pad_batch
from gspo.rollout.llamacpp_engine import (
    PRECISION,
    LlamaCppEngine,
    _permute_qk,
    context_size,
    export_gguf,
)


@pytest.fixture(scope="module")
def tiny():
    model, tok = build_tiny("llama", seed=0)
    return model.eval(), tok


def test_registered_with_its_declared_capabilities():
    caps = ENGINES["llamacpp"].declared_capabilities(EngineOptions())
    assert caps.precision == PRECISION and caps.returns_logprobs
    assert not caps.shares_policy_weights and caps.routing_unsupported


def test_export_holds_the_policy_in_q8_0(tiny, tmp_path):
    gguf = pytest.importorskip("gguf")
    model, tok = tiny
    reader = gguf.GGUFReader(export_gguf(model, tok, tmp_path / "m.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors  # tied: llama.cpp reuses token_embd
    cfg = model.config
    for hf_name, w in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue
        t = next(t for n, t in tensors.items() if n.endswith(hf_name.rsplit(".", 1)[-1])
                 and n.startswith(_gguf_prefix(hf_name)))
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
        want = w.numpy()
        if "q_proj" in hf_name:
            want = _permute_qk(want, cfg.num_attention_heads)
        elif "k_proj" in hf_name:
            want = _permute_qk(want, cfg.num_key_value_heads)
        if w.ndim == 2:
            assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
            # Q8_0: per block of 32, error <= scale / 2 = max|w| / 254 (+ the fp16 scale)
            assert np.abs(got - want).max() <= np.abs(want).max() / 200
        else:
            np.testing.assert_array_equal(got, want)


def _gguf_prefix(hf_name: str) -> str:
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    return names.get_name(hf_name.rpartition(".")[0])


def test_permute_is_a_rotary_layout_change():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)  # 4 heads of dim 8
    p = _permute_qk(w, 4)
    assert sorted(p[:8, 0]) == sorted(w[:8, 0])  # rows stay within their head
    assert list(p[:4, 0]) == [w[0, 0], w[4, 0], w[1, 0], w[5, 0]]  # halves interleaved


def test_without_the_package_starting_is_a_clear_error(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(ImportError, match="pip install 'gspo\\[llamacpp\\]'"):
        build_engine("llamacpp", *tiny, EngineOptions())


def test_non_llama_models_are_refused(tmp_path):
    model, tok = build_tiny("qwen3_moe", seed=0)
    with pytest.raises(NotImplementedError, match="Llama models only"):
        export_gguf(model, tok, tmp_path / "m.gguf")



def _llama(rope: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tok = build_tiny("llama")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=True,
                      rope_parameters={"rope_theta": 500000.0, **rope})
    return LlamaForCausalLM(cfg).eval(), tok


def test_llama3_rope_scaling_goes_into_the_rope_freqs_tensor(tmp_path):
    """A Llama 3.x policy (rope_type llama3) rotates with rescaled frequencies: without
    ``rope_freqs`` llama.cpp would run plain RoPE, another model. The factors are those
    convert_hf_to_gguf.py writes (1 for short wavelengths, ``factor`` for long ones, smoothed
    between); a rescaling llama.cpp cannot take from the file is refused."""
    import math

    gguf = pytest.importorskip("gguf")
    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model, tok = _llama(rope)
    reader = gguf.GGUFReader(export_gguf(model, tok, tmp_path / "m.gguf"))
    got = next(t for t in reader.tensors if t.name == "rope_freqs.weight").data
    want = []
    for i in range(0, 16, 2):  # head_dim 16
        wavelen = 2 * math.pi * 500000.0 ** (i / 16)
        if wavelen < 64 / 4.0:
            want.append(1.0)
        elif wavelen > 64 / 1.0:
            want.append(32.0)
        else:
            smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
            want.append(1 / ((1 - smooth) / 32.0 + smooth))
    assert len(set(want)) == 3  # every case of the formula is met
    np.testing.assert_allclose(got, want, rtol=1e-5)
    plain, tok = _llama({"rope_type": "default"})
    reader = gguf.GGUFReader(export_gguf(plain, tok, tmp_path / "plain.gguf"))
    assert not [t for t in reader.tensors if "rope" in t.name]
    yarn, tok = _llama({"rope_type": "yarn", "factor": 4.0,
                        "original_max_position_embeddings": 128})
    with pytest.raises(NotImplementedError, match="rope_type='yarn'"):
        export_gguf(yarn, tok, tmp_path / "yarn.gguf")

class _FakeLlama:
    """The part of ``llama_cpp.Llama`` the engine uses, failing as llama.cpp does when more
    tokens are evaluated than its context holds; logits a fixed function of the last token."""

    loads: ClassVar[list[int]] = []

    def __init__(self, model_path, n_ctx, **kw):
        self.n_ctx_, self.n_tokens, self.ctx = n_ctx, 0, self
        _FakeLlama.loads.append(n_ctx)
        self.table = np.random.default_rng(0).standard_normal((300, 300)).astype(np.float32)

    def n_vocab(self):
        return 300

    def reset(self):
        self.n_tokens = 0

    def eval(self, tokens):
        if self.n_tokens + len(tokens) > self.n_ctx_:
            raise RuntimeError("llama_decode returned 1: out of context")
        self.n_tokens += len(tokens)
        self.row = np.ascontiguousarray(self.table[tokens[-1] % 300])


def _fake_llama_cpp():
    import ctypes
    import types

    return types.SimpleNamespace(Llama=_FakeLlama, llama_get_logits_ith=lambda ctx, i: (
        ctx.row.ctypes.data_as(ctypes.POINTER(ctypes.c_float))))


def test_a_prompt_longer_than_the_context_reloads_a_larger_one(tiny, monkeypatch):
    """prompt + max_new_tokens past the context the engine started with is sampled, on a
    context reloaded large enough (llama-cpp-python stands in for a fake here)."""
    pytest.importorskip("gguf")
    monkeypatch.setitem(sys.modules, "llama_cpp", _fake_llama_cpp())
    _FakeLlama.loads = []
    engine = LlamaCppEngine(*tiny, EngineOptions(), n_ctx=16, n_threads=1)
    try:
        prompt = list(range(3, 15))  # 12 tokens + 8 new > 16
        roll = engine.generate([prompt], group_size=2, seeds=[0],
                               params=SamplingParams(max_new_tokens=8))
        assert len(roll) == 2 and _FakeLlama.loads[0] == 16 and engine.n_ctx >= 20
        assert _FakeLlama.loads[-1] == engine.n_ctx
        engine.generate([prompt], group_size=1, seeds=[0], params=SamplingParams(4))
        assert len(_FakeLlama.loads) == 2  # enough room: no reload
    finally:
        engine.close()


def test_context_size_grows_to_what_a_request_needs():
    assert context_size(2048, 300, 8192) == 2048
    assert context_size(2048, 2100, 8192) == 4096
    assert context_size(2048, 9000, 8192) == 9000
    assert context_size(2048, 2100, 2048) == 2100
    assert context_size(16, 20, None) == 32


# ------------------------------------------------------------------ with llama-cpp-python
def _engine(tiny):
    pytest.importorskip("llama_cpp")
    return LlamaCppEngine(*tiny, EngineOptions(), n_ctx=256, n_threads=1)


PROMPTS = [[2, 72, 101, 108], [2, 111, 32, 119, 111, 114]]
PARAMS = SamplingParams(max_new_tokens=8, temperature=0.7)


def test_engine_samples_with_its_own_logprobs_close_to_fp32(tiny):
    engine = _engine(tiny)
    try:
        roll = engine.generate(PROMPTS, group_size=3, params=PARAMS, seeds=[5, 6])
        assert len(roll) == 6 and roll.prompt_ids[3] == PROMPTS[1]
        assert all(len(r) == len(lp) >= 1 for r, lp in zip(roll.response_ids, roll.logprobs))
        model, tok = tiny
        b = pad_batch(roll.prompt_ids, roll.response_ids, tok.pad_token_id, roll.logprobs)
        with torch.no_grad():
            fp32, _ = token_logprobs(model, b["input_ids"], b["attention_mask"],
                                     b["response_mask"], temperature=PARAMS.temperature)
        gap = ((fp32 - b["old_logprobs"]) * b["response_mask"]).abs().max()
        assert 0 < gap < 0.05  # 8-bit weights: a mismatch, but a small one
        # one seed per prompt: a prompt's samples do not depend on its batch
        alone = engine.generate(PROMPTS[1:], group_size=3, params=PARAMS, seeds=[6])
        assert alone.response_ids == roll.response_ids[3:]
    finally:
        engine.close()


def test_sync_weights_follows_the_policy(tiny):
    model, _ = tiny
    engine = _engine(tiny)
    try:
        before = engine.generate(PROMPTS, group_size=2, params=PARAMS, seeds=[1, 2])
        changed, _ = build_tiny("llama", seed=1)
        engine.sync_weights(changed)
        after = engine.generate(PROMPTS, group_size=2, params=PARAMS, seeds=[1, 2])
        assert after.logprobs[0][0] != before.logprobs[0][0]
        engine.sync_weights(model)
        again = engine.generate(PROMPTS, group_size=2, params=PARAMS, seeds=[1, 2])
        assert again.response_ids == before.response_ids
        assert all(torch.equal(a, b) for a, b in zip(again.logprobs, before.logprobs))
    finally:
        engine.close()
