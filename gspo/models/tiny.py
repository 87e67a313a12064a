"""Tiny models built from configs, for tests and laptop-sized runs (no download, no weights).

They use a byte-level tokenizer (256 byte tokens + 3 specials) so the vocabulary stays small:
with a 49k vocabulary the output layer dominates a tiny model's cost.
"""

from __future__ import annotations

from typing import Any

import torch

from gspo.models.moe import SUPPORTED_MOE

SPECIALS = ["<pad>", "<eos>", "<bos>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def byte_tokenizer() -> Any:
    """A byte-level BPE tokenizer with no merges: any text encodes, vocabulary 259."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


# Sized MoE presets: name -> (family, tiny_moe_config arguments).
# tiny_moe: the model of the MoE comparison (configs/moe/): a Qwen3-MoE with 8 experts, top-2,
# in every one of 4 layers (~1M parameters, about 1-3 s per RL step of 64 responses on 2 cores).
MOE_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny_moe": ("qwen3_moe", {"hidden_size": 96, "num_layers": 4, "num_experts": 8, "top_k": 2,
                               "moe_intermediate_size": 96, "num_heads": 4, "num_kv_heads": 2}),
    # deep_moe: the fine-grained deep testbed (configs/moe/deep_moe.yaml): 16 Qwen3-MoE layers of
    # 32 small experts with top-4, closer in shape to the paper's 48 layers x 128 experts, top-8.
    "deep_moe": ("qwen3_moe", {"hidden_size": 64, "num_layers": 16, "num_experts": 32,
                               "top_k": 4, "moe_intermediate_size": 32, "num_heads": 4,
                               "num_kv_heads": 2}),
    # deep_moe_128: deep_moe's 16 layers with the paper's expert count and top-k (128 experts,
    # top-8), each expert half as wide (16), so a token's active expert FLOPs equal deep_moe's.
    "deep_moe_128": ("qwen3_moe", {"hidden_size": 64, "num_layers": 16, "num_experts": 128,
                                   "top_k": 8, "moe_intermediate_size": 16, "num_heads": 4,
                                   "num_kv_heads": 2}),
}


def tiny_moe_config(
    family: str = "qwen3_moe",
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_experts: int = 8,
    top_k: int = 2,
    moe_intermediate_size: int | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    norm_topk_prob: bool = True,
    max_position_embeddings: int = 512,
    **overrides: Any,
) -> Any:
    """A small ``PretrainedConfig`` of a supported MoE family (for tests and presets).

    Every layer is sparse (no ``mlp_only_layers``, ``decoder_sparse_step=1``), router jitter is
    off, and the auxiliary loss is off (``output_router_logits=False``,
    ``router_aux_loss_coef=0.0``).  ``norm_topk_prob`` is ignored by Mixtral (always
    renormalised).  Token ids default to ``pad=0, bos=1, eos=2``.  ``overrides`` are passed to
    the config constructor last.
    """
    family = family.replace("-", "_").lower()
    if family not in SUPPORTED_MOE:
        raise ValueError(
            f"tiny_moe_config: unknown family '{family}' (supported: "
            f"{', '.join(sorted(SUPPORTED_MOE))})"
        )
    import transformers

    inter = moe_intermediate_size if moe_intermediate_size is not None else hidden_size
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "num_experts_per_tok": top_k,
        "max_position_embeddings": max_position_embeddings,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.0,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    kwargs = {**common, **_family_kwargs(family, hidden_size // num_heads, inter, num_experts,
                                         norm_topk_prob)}
    kwargs.update(overrides)
    config_cls = getattr(transformers, SUPPORTED_MOE[family].config_class_name)
    return config_cls(**kwargs)


def _family_kwargs(family: str, head_dim: int, inter: int, num_experts: int,
                   norm_topk_prob: bool) -> dict[str, Any]:
    """The config arguments of :func:`tiny_moe_config` that differ between MoE families."""
    if family == "qwen3_moe":
        return {
            "head_dim": head_dim,
            "intermediate_size": 2 * inter,
            "moe_intermediate_size": inter,
            "num_experts": num_experts,
            "norm_topk_prob": norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    if family == "mixtral":
        return {
            "head_dim": head_dim,
            "intermediate_size": inter,
            "num_local_experts": num_experts,
            "router_jitter_noise": 0.0,
        }
    if family == "olmoe":
        return {
            "intermediate_size": inter,
            "num_experts": num_experts,
            "norm_topk_prob": norm_topk_prob,
        }
    # qwen2_moe
    return {
        "intermediate_size": 2 * inter,
        "moe_intermediate_size": inter,
        "shared_expert_intermediate_size": inter,
        "num_experts": num_experts,
        "norm_topk_prob": norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def tiny_names() -> list[str]:
    """The names ``tiny:<name>`` takes, sorted."""
    return sorted(["llama", *SUPPORTED_MOE, *MOE_PRESETS])


def tiny_config(name: str, vocab_size: int) -> Any:
    """Configs of the tiny presets: ``llama`` (dense), the MoE families of gspo.models.moe at
    their test size, and the sized presets of :data:`MOE_PRESETS`."""
    from transformers import LlamaConfig

    if name == "llama":
        return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=512, tie_word_embeddings=True,
                           pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if name in SUPPORTED_MOE or name in MOE_PRESETS:
        family, sizes = MOE_PRESETS.get(name, (name, {}))
        cfg = tiny_moe_config(family, vocab_size=vocab_size, **sizes)
        cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = 0, 1, 2
        return cfg
    raise ValueError(f"unknown tiny model '{name}' (choose one of {', '.join(tiny_names())})")


def build_tiny(name: str, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    tokenizer = byte_tokenizer()
    config = tiny_config(name, vocab_size=len(tokenizer))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model, tokenizer
