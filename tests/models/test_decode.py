"""The lean decode step equals Hugging Face's ``forward`` to fp32 rounding."""

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config

from gspo.models.decode import (
    FUSE_MAX_BYTES,
    DenseDecoder,
    bf16_kernels,
    onednn_available,
    packable,
    packing_pays,
    unsupported,
)
from gspo.models.tiny import build_tiny, tiny_moe_config
from gspo.rollout import SamplingParams, generate, greedy_generate
from gspo.rollout.sampler import _left_pad

SIZES = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128)
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")


def _model(kind: str, seed: int = 0):
    if kind == "llama":
        cfg = LlamaConfig(**SIZES, rope_scaling={"rope_type": "linear", "factor": 2.0})
    elif kind == "llama_dynamic":  # rope that adapts to the length seen: computed per step
        cfg = LlamaConfig(**{**SIZES, "max_position_embeddings": 12},
                          rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    elif kind == "llama_bias_tied":  # biases on every projection, tied output layer, llama3 rope
        cfg = LlamaConfig(**SIZES, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 16})
    elif kind == "llama_yarn":  # rope with an attention scaling folded into cos/sin
        cfg = LlamaConfig(**SIZES, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 32})
    elif kind == "qwen2":  # biases on q/k/v
        cfg = Qwen2Config(**SIZES)
    elif kind in MOE:  # sparse layers: the attention above, the MoE block as its module
        cfg = tiny_moe_config(kind, vocab_size=97, hidden_size=48, num_layers=3, num_experts=4,
                              top_k=2, num_heads=6, num_kv_heads=2, max_position_embeddings=128)
    else:  # qwen3: RMS norm on each query/key head; head_dim not hidden / heads
        cfg = Qwen3Config(**SIZES, head_dim=16)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # nonzero biases and norm weights, so a skipped one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]


needs_onednn = pytest.mark.skipif(not onednn_available(), reason="no oneDNN in this torch")


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_onednn)])
@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("kind", ["llama", "llama_dynamic", "llama_bias_tied", "llama_yarn",
                                  "qwen2", "qwen3", *MOE])
def test_decode_steps_equal_forward_with_padding_and_dropped_rows(kind, fuse, packed):
    """Plain (F.linear) and oneDNN-packed products alike, the packed ones with rows dropped
    below the batch size their weights were packed for."""
    model = _model(kind)
    assert unsupported(model) is None
    ids, mask = _left_pad(PROMPTS, 0)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        lean = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    decoder = DenseDecoder(model, lean.cache, mask, extra=6, fuse=fuse, packed=packed)
    assert all(layer.fused == fuse for layer in decoder.layers)
    assert (decoder.head.packed is not None) == packed
    assert (decoder.rope_table is None) == (kind == "llama_dynamic")
    cache, next_pos, rows = ref.cache, mask.sum(-1), torch.arange(3)
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        if step == 3:  # drop the middle row, as the sampler does when a row finishes
            keep = torch.tensor([0, 2])
            cache.batch_select_indices(keep)
            decoder.batch_select_indices(keep)
            mask, next_pos, rows = mask[keep], next_pos[keep], rows[keep]
        tok = torch.randint(3, 97, (len(rows),), generator=gen)
        mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype)], dim=1)
        with torch.no_grad():
            out = model(input_ids=tok[:, None], attention_mask=mask,
                        position_ids=next_pos[:, None], cache=cache, use_cache=True)
        got = decoder.step(tok, next_pos)
        torch.testing.assert_close(got, out.logits[:, -1], rtol=0, atol=2e-5)
        next_pos = next_pos + 1


@pytest.mark.skipif(not (onednn_available() and bf16_kernels()),
                    reason="oneDNN has no bfloat16 kernels on this CPU")
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen2_moe"])
def test_bf16_decode_steps_packed_equal_forward_to_bf16_rounding(kind):
    """A bfloat16 model (rollout.precision=bf16's copy) on weights packed for oneDNN: the
    logits of ``forward`` in bf16 to two bf16 steps at their scale (~0.5 here)."""
    model = _model(kind).to(torch.bfloat16)
    ids, mask = _left_pad(PROMPTS, 0)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        lean = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    decoder = DenseDecoder(model, lean.cache, mask, extra=4, packed=True)
    assert decoder.head.packed is not None
    cache, next_pos = ref.cache, mask.sum(-1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        tok = torch.randint(3, 97, (3,), generator=gen)
        mask = torch.cat([mask, torch.ones((3, 1), dtype=mask.dtype)], dim=1)
        with torch.no_grad():
            out = model(input_ids=tok[:, None], attention_mask=mask,
                        position_ids=next_pos[:, None], cache=cache, use_cache=True)
        got = decoder.step(tok, next_pos)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), out.logits[:, -1].float(), rtol=0, atol=8e-3)
        next_pos = next_pos + 1


def test_generate_with_and_without_the_lean_decoder_agree():
    model, _ = build_tiny("llama", seed=3)
    prompts = [[2, 40, 41, 42, 43], [2, 50], [2, 60, 61, 62]]
    eos = list(range(1, 40))  # rows end at different steps, so rows get dropped
    params = SamplingParams(max_new_tokens=12, temperature=0.9)
    runs = [generate(model, prompts, group_size=4, params=params, eos=eos, pad_id=0,
                     generator=[torch.Generator().manual_seed(s) for s in range(3)],
                     fast_decode=fast) for fast in (True, False)]
    assert runs[0].response_ids == runs[1].response_ids
    assert len({len(r) for r in runs[0].response_ids}) > 1
    for a, b in zip(runs[0].logprobs, runs[1].logprobs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    greedy = [greedy_generate(model, prompts, max_new_tokens=12, eos=eos, pad_id=0,
                              fast_decode=fast) for fast in (True, False)]
    assert greedy[0] == greedy[1]


@needs_onednn
def test_onednn_and_blas_decode_sample_the_same_tokens_to_fp32_rounding():
    """rollout.decode_matmul: the packed oneDNN products (and the prefill's through oneDNN)
    and F.linear give the same samples and log-probs to fp32 rounding (on a tiny model no
    sampled token flips); 'auto' is blas for a model this small (packing does not pay below
    1 MiB a layer)."""
    model, _ = build_tiny("llama", seed=3)
    assert packable(model) is None and not packing_pays(model)
    prompts = [[2, 40, 41, 42, 43], [2, 50], [2, 60, 61, 62]]
    eos = list(range(1, 40))
    params = SamplingParams(max_new_tokens=12, temperature=0.9)
    runs = {m: generate(model, prompts, group_size=4, params=params, eos=eos, pad_id=0,
                        generator=[torch.Generator().manual_seed(s) for s in range(3)],
                        decode_matmul=m) for m in ("blas", "onednn", "auto")}
    assert runs["blas"].response_ids == runs["onednn"].response_ids
    for a, b, c in zip(runs["blas"].logprobs, runs["onednn"].logprobs, runs["auto"].logprobs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        assert torch.equal(a, c)
    with pytest.raises(ValueError, match="decode_matmul: 'mkl'"):
        generate(model, prompts, group_size=1, params=params, eos=eos, pad_id=0,
                 decode_matmul="mkl")


def test_packable_names_what_stops_onednn():
    """The trainer's passes take fp32 only; the decode steps also bf16 where oneDNN has bf16
    kernels, and a model in another dtype is refused by name."""
    bf16, _ = build_tiny("llama", seed=1, dtype=torch.bfloat16)
    assert "bfloat16" in packable(bf16)
    assert packable(bf16, bf16=True) == (None if bf16_kernels() else
                                         "oneDNN has no bfloat16 kernels on this CPU")
    # a tiny bf16 model under "auto" decodes through F.linear (packing does not pay)
    assert generate(bf16, [[2, 40]], group_size=1, params=SamplingParams(3), eos=[1],
                    pad_id=0, greedy=True).response_ids
    fp16, _ = build_tiny("llama", seed=1, dtype=torch.float16)
    assert packable(fp16, bf16=True) == "the model is in torch.float16, not float32 or bfloat16"
    with pytest.raises(ValueError, match=r"decode_matmul=onednn: the model is in torch\.float16"):
        generate(fp16, [[2, 40]], group_size=1, params=SamplingParams(3), eos=[1], pad_id=0,
                 greedy=True, decode_matmul="onednn")


@pytest.mark.skipif(not (onednn_available() and bf16_kernels()),
                    reason="oneDNN has no bfloat16 kernels on this CPU")
def test_bf16_decode_packed_agrees_with_f_linear_to_bf16_rounding(monkeypatch):
    """rollout.precision=bf16's copy: its decode steps on bf16 weights packed for oneDNN give
    the greedy tokens of F.linear's and the log-probs to bf16 rounding."""
    import gspo.rollout.sampler as sampler

    packed = []

    class Recorded(DenseDecoder):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            packed.append(self.head.packed is not None)

    monkeypatch.setattr(sampler, "DenseDecoder", Recorded)
    model, _ = build_tiny("llama", seed=1, dtype=torch.bfloat16)
    runs = {m: generate(model, [[2, 40, 41, 42], [2, 50, 51]], group_size=3, eos=[1],
                        pad_id=0, params=SamplingParams(10), greedy=True, decode_matmul=m)
            for m in ("blas", "onednn")}
    assert packed == [False, True]
    assert runs["blas"].response_ids == runs["onednn"].response_ids
    for a, b in zip(runs["blas"].logprobs, runs["onednn"].logprobs):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2)


def test_models_it_does_not_cover_are_named_and_fall_back_to_forward():
    other = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=97, n_embd=48, n_layer=2,
                                                        n_head=6, n_positions=64))
    assert "gpt2" in unsupported(other)
    sliding = AutoModelForCausalLM.from_config(
        Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=4, max_window_layers=0))
    assert "sliding" in unsupported(sliding)
    llama = _model("llama")
    llama.model.layers[1].mlp.up_proj = torch.nn.Sequential(llama.model.layers[1].mlp.up_proj)
    assert "Sequential" in unsupported(llama)
    hooked = _model("qwen2")
    handle = hooked.lm_head.register_forward_pre_hook(lambda _, args: (args[0] * 2,))
    assert "hooks" in unsupported(hooked)
    handle.remove()
    assert unsupported(hooked) is None
    hooked.lm_head.double()
    assert "mixed dtypes" in unsupported(hooked)
    with pytest.raises(ValueError, match="DenseDecoder: projection Sequential"):
        DenseDecoder(llama, None, torch.ones(1, 1), 1)
    # generate() still runs them, through forward
    roll = generate(other, [[3, 4, 5]], group_size=2, params=SamplingParams(4), eos=[1], pad_id=0,
                    generator=torch.Generator().manual_seed(0))
    assert len(roll) == 2


def test_mixtral_with_a_sliding_window_falls_back_to_forward():
    """Mixtral's config has no use_sliding_window or layer_types: its forward applies
    config.sliding_window to every layer, which the lean passes do not (the fast path sampled
    other tokens than forward once a sequence outgrew the window)."""
    cfg = tiny_moe_config("mixtral", vocab_size=97, hidden_size=48, num_layers=2, num_experts=4,
                          top_k=2, num_heads=6, num_kv_heads=2, sliding_window=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    runs = [generate(model, [[5, 6, 7, 8, 9, 10, 11, 12, 13], [12, 13]], group_size=2,
                     params=SamplingParams(max_new_tokens=10), eos=[], pad_id=0,
                     generator=torch.Generator().manual_seed(0), fast_decode=fast)
            for fast in (True, False)]
    assert runs[0].response_ids == runs[1].response_ids
    for a, b in zip(runs[0].logprobs, runs[1].logprobs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert "sliding" in (unsupported(model) or "")


def test_lora_wrapped_projections_fall_back():
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_config(LlamaConfig(**SIZES))
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert unsupported(peft_model) is not None
    assert unsupported(peft_model.get_base_model()) is not None


def test_bf16_model_agrees_with_forward_to_bf16_rounding():
    model, _ = build_tiny("llama", seed=1, dtype=torch.bfloat16)
    assert unsupported(model) is None
    runs = [generate(model, [[2, 40, 41, 42], [2, 50, 51]], group_size=3, eos=[1], pad_id=0,
                     params=SamplingParams(10), greedy=True, fast_decode=fast)
            for fast in (True, False)]
    assert runs[0].response_ids == runs[1].response_ids
    for a, b in zip(runs[0].logprobs, runs[1].logprobs):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_written_out_rms_norm_is_bitwise_the_module(kind):
    from gspo.models.decode import _Norm

    model = _model(kind)
    norms = [model.model.norm, model.model.layers[0].input_layernorm]
    if kind == "qwen3":
        norms.append(model.model.layers[0].self_attn.q_norm)
    x = torch.randn(5, 3, norms[-1].weight.shape[0]) * 4
    for module in norms:
        xs = x if module.weight.shape[0] == x.shape[-1] else torch.randn(5, module.weight.shape[0])
        norm = _Norm(module)
        assert norm.inline
        with torch.no_grad():
            assert torch.equal(norm(xs), module(xs))


def test_auto_packs_layers_larger_than_the_threshold():
    small = _model("llama")
    assert not packing_pays(small)
    big = AutoModelForCausalLM.from_config(LlamaConfig(**{**SIZES, "hidden_size": 384,
                                                          "intermediate_size": 1024}))
    assert sum(p.numel() * 4 for p in big.model.layers[0].mlp.parameters()) > FUSE_MAX_BYTES
    assert packing_pays(big)
