"""Noise drawn in training mode (dropout, router jitter) and `disable_dropout`, which removes it."""

import pytest
import torch

from gspo.config import ConfigError, LoRAConfig, load_config
from gspo.models.logprobs import token_logprobs
from gspo.models.tiny import build_tiny
from gspo.models.train_noise import disable_train_noise, train_noise
from gspo.trainer import Trainer


def _seq_log_ratio(model, seed=0):
    """Per-sequence mean log π_train − log π_eval at the same weights: log s_i at θ = θ_old."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 200, (8, 24), generator=g)
    mask = torch.ones_like(ids)
    target = torch.zeros_like(ids)
    target[:, 8:] = 1
    with torch.no_grad():
        model.eval()
        old, _ = token_logprobs(model, ids, mask, target)
        model.train()
        torch.manual_seed(seed)
        new, _ = token_logprobs(model, ids, mask, target)
    model.eval()
    return ((new - old) * target).sum(1) / target.sum(1)


def _noisy_lora_llama():
    from gspo.models.lora import apply_lora

    model, _ = build_tiny("llama")
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model = apply_lora(model, LoRAConfig(r=4, alpha=8, dropout=0.05))
    with torch.no_grad():  # lora_B starts at zero, where the adapter's dropout has no effect
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def test_dropout_moves_the_ratio_at_theta_old_and_disabling_removes_it():
    model = _noisy_lora_llama()
    found = train_noise(model)
    assert any("attention_dropout=0.1" in f for f in found)
    assert any("lora_dropout" in f and "p=0.05" in f for f in found)
    noisy = _seq_log_ratio(model).abs().max().item()
    assert noisy > 3e-4  # beyond GSPO's clip range
    assert disable_train_noise(model) == found
    assert train_noise(model) == []
    assert torch.equal(_seq_log_ratio(model), torch.zeros(8))


def test_router_jitter_is_found_and_disabled():
    model, _ = build_tiny("mixtral")
    assert train_noise(model) == []
    model.config.router_jitter_noise = 0.01
    blocks = [m for m in model.modules() if hasattr(m, "jitter_noise")]
    assert blocks  # Mixtral's sparse block reads its own copy in forward
    for block in blocks:
        block.jitter_noise = 0.01
    found = train_noise(model)
    assert "config.router_jitter_noise=0.01" in found and len(found) > 1
    assert _seq_log_ratio(model).abs().max().item() > 0
    disable_train_noise(model)
    assert train_noise(model) == []
    assert torch.equal(_seq_log_ratio(model), torch.zeros(8))



def test_layerdrop_is_found_and_disabled():
    """LayerDrop (OPT, XGLM, BioGPT: ``config.layerdrop``, read by the decoder as its own
    ``layerdrop``) skips whole layers at random in training mode, so π_θ ≠ π_old at
    θ = θ_old; disable_dropout left it on (found nothing) and the first minibatch's forward
    was taken as π_old."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(
        vocab_size=259, hidden_size=32, num_hidden_layers=4, ffn_dim=64, num_attention_heads=4,
        word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, layerdrop=0.5,
        max_position_embeddings=64))
    found = train_noise(model)
    assert "config.layerdrop=0.5" in found and "model.decoder.layerdrop=0.5" in found
    assert _seq_log_ratio(model).abs().max().item() > 3e-4
    assert disable_train_noise(model) == found
    assert train_noise(model) == []
    assert torch.equal(_seq_log_ratio(model), torch.zeros(8))

def test_lora_dropout_needs_disable_dropout_false():
    with pytest.raises(ConfigError, match=r"lora\.dropout > 0 is unused with disable_dropout"):
        load_config(None, ["lora.r=4", "lora.dropout=0.05"])
    cfg = load_config(None, ["lora.r=4", "lora.dropout=0.05", "disable_dropout=false"])
    assert cfg.lora.dropout == 0.05


def starts_with_digit(prompts, completions, **_):
    return [float(bool(c) and c[0].isdigit()) for c in completions]


@pytest.mark.parametrize("disable", [True, False])
def test_the_trainer_builds_the_policy_without_noise_unless_told_otherwise(tmp_path, disable):
    model, tok = build_tiny("llama")
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    cfg = load_config(None, [
        "model=tiny:llama", f"output_dir={tmp_path}", "run_name=r", "progress=false",
        "steps=1", "rollout.max_new_tokens=4", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "task.eval_size=2", "eval_before=false",
        f"disable_dropout={str(disable).lower()}"])
    trainer = Trainer(cfg, model=model, tokenizer=tok, reward_fns=[starts_with_digit]).setup()
    assert (train_noise(trainer.model) == []) == disable
