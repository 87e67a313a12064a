"""Tests for gspo.models.moe: routing capture / replay / drift on tiny transformers MoE models."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from gspo.models.moe import (
    SUPPORTED_MOE,
    capture_routing,
    is_moe,
    load_balancing_loss,
    moe_adapter,
    replay_routing,
    router_modules,
    routing_change,
    select_sequences,
)
from gspo.models.tiny import tiny_moe_config

FAMILIES = sorted(SUPPORTED_MOE)
NUM_LAYERS = 2
VOCAB = 64
B, T = 3, 6


def _model(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = tiny_moe_config(
        family,
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=NUM_LAYERS,
        num_experts=8,
        top_k=2,
        num_heads=2,
        num_kv_heads=1,
        moe_intermediate_size=16,
    )
    return AutoModelForCausalLM.from_config(cfg).float()


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (B, T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    mask[2, -3:] = 0  # right padding
    return ids, mask


def _enable_checkpointing(model: torch.nn.Module) -> None:
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable()
    else:  # older transformers
        model.gradient_checkpointing_enable()


def _record(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor):
    model.eval()
    with torch.no_grad(), capture_routing(model) as rec:
        logits = model(input_ids=ids, attention_mask=mask).logits
    return logits, rec.take()


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_config_builds_moe_model(family: str) -> None:
    model = _model(family)
    cfg = model.config
    assert cfg.model_type == family
    assert cfg.output_router_logits is False
    assert cfg.router_aux_loss_coef == 0.0
    assert is_moe(model)
    assert moe_adapter(model) is SUPPORTED_MOE[family]
    routers = router_modules(model)
    assert len(routers) == NUM_LAYERS
    assert all(type(r).__name__ == SUPPORTED_MOE[family].router_class_name for r in routers)
    ids, mask = _batch()
    out = model(input_ids=ids, attention_mask=mask)
    assert out.logits.shape == (B, T, VOCAB)


def test_deep_presets_share_active_expert_compute() -> None:
    """deep_moe_128 has the paper's 128 experts and top-8, in deep_moe's 16 layers, with
    half-width experts: a token's active expert FLOPs equal deep_moe's (the granularity grid of
    benchmarks/bench_routing_volatility.py compares the two at equal compute)."""
    from gspo.models.tiny import tiny_config

    deep, fine = tiny_config("deep_moe", 259), tiny_config("deep_moe_128", 259)
    assert (fine.num_experts, fine.num_experts_per_tok, fine.num_hidden_layers) == (128, 8, 16)
    assert fine.hidden_size == deep.hidden_size and fine.num_hidden_layers == deep.num_hidden_layers
    active = lambda c: c.num_experts_per_tok * c.moe_intermediate_size  # noqa: E731
    assert active(fine) == active(deep)


@pytest.mark.parametrize("family", FAMILIES)
def test_record_then_replay_is_exact_on_padded_batch(family: str) -> None:
    model = _model(family)
    ids, mask = _batch()
    ref, idx = _record(model, ids, mask)
    assert len(idx) == NUM_LAYERS
    for t in idx:
        assert t.shape == (B * T, 2) and t.dtype == torch.long and t.device.type == "cpu"
    with torch.no_grad(), replay_routing(model, idx) as rp:
        out = model(input_ids=ids, attention_mask=mask).logits
    assert rp.calls == NUM_LAYERS
    assert torch.equal(out, ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_train_mode_with_checkpointing(family: str) -> None:
    model = _model(family)
    ids, mask = _batch()
    ref, idx = _record(model, ids, mask)

    # reference gradients: plain training forward (routing chosen by the model itself)
    model.train()
    model(input_ids=ids, attention_mask=mask).logits.float().pow(2).mean().backward()
    ref_grads = [r.weight.grad.clone() for r in router_modules(model)]
    model.zero_grad(set_to_none=True)

    _enable_checkpointing(model)
    model.train()
    with replay_routing(model, idx) as rp:
        out = model(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(out, ref)
        out.float().pow(2).mean().backward()
    # each router ran twice: forward + checkpoint recomputation, both replayed
    assert rp.calls == 2 * NUM_LAYERS
    for router, g_ref in zip(router_modules(model), ref_grads, strict=True):
        assert router.weight.grad is not None
        assert router.weight.grad.abs().sum() > 0
        torch.testing.assert_close(router.weight.grad, g_ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_pins_old_routing_after_router_update(family: str) -> None:
    model = _model(family)
    ids, mask = _batch()
    _, old = _record(model, ids, mask)
    assert routing_change(old, old)["overall"] == 0

    with torch.no_grad():
        for r in router_modules(model):
            r.weight.add_(torch.randn_like(r.weight) * 5 * r.weight.std())
    free_logits, new = _record(model, ids, mask)
    change = routing_change(old, new, token_mask=mask.reshape(-1))
    assert change["per_layer"].shape == (NUM_LAYERS,)
    assert change["overall"] > 0

    model.train()
    with replay_routing(model, old), capture_routing(model) as rec:
        replayed = model(input_ids=ids, attention_mask=mask).logits
        replayed.float().pow(2).mean().backward()
    seen = rec.take()
    for a, b in zip(seen, old, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(replayed.detach(), free_logits)
    assert all(r.weight.grad.abs().sum() > 0 for r in router_modules(model))


@pytest.mark.parametrize("family", FAMILIES[:2])
def test_replay_of_other_routing_changes_output(family: str) -> None:
    model = _model(family)
    ids, mask = _batch()
    ref, idx = _record(model, ids, mask)
    shifted = [(t + 1) % 8 for t in idx]
    with torch.no_grad(), replay_routing(model, shifted):
        out = model(input_ids=ids, attention_mask=mask).logits
    assert not torch.equal(out, ref)


def test_capture_concatenates_calls_and_take_clears() -> None:
    model = _model("qwen3_moe")
    ids, mask = _batch()
    _, full = _record(model, ids, mask)
    with torch.no_grad(), capture_routing(model, record_logits=True) as rec:
        model(input_ids=ids[:1], attention_mask=mask[:1])
        model(input_ids=ids[1:], attention_mask=mask[1:])
        assert [t.shape for t in rec.logits] == [(B * T, 8)] * NUM_LAYERS
        parts = rec.take()
        assert rec.indices[0].shape == (0, 2) and rec.logits[0].shape[0] == 0
    for a, b in zip(parts, full, strict=True):
        assert torch.equal(a, b)
    # minibatch slicing of a full-batch recording replays exactly
    sub = select_sequences(full, T, slice(1, 3))
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=ids[1:], attention_mask=mask[1:]).logits
        with replay_routing(model, sub):
            out = model(input_ids=ids[1:], attention_mask=mask[1:]).logits
    assert torch.equal(out, ref)


def test_capture_ignores_checkpoint_recompute() -> None:
    model = _model("mixtral")
    ids, mask = _batch()
    _enable_checkpointing(model)
    model.train()
    with capture_routing(model) as rec:
        model(input_ids=ids, attention_mask=mask).logits.float().pow(2).mean().backward()
    assert rec.calls == NUM_LAYERS
    assert rec.indices[0].shape == (B * T, 2)


def test_routing_change_hand_example() -> None:
    old = [torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.tensor([[1, 2], [3, 4], [5, 6]])]
    new = [torch.tensor([[1, 0], [2, 4], [6, 7]]), torch.tensor([[2, 1], [4, 3], [6, 5]])]
    res = routing_change(old, new)
    # layer 0: token0 same set (order swapped), token1 and token2 differ; layer 1: all same sets
    torch.testing.assert_close(res["per_layer"], torch.tensor([2 / 3, 0.0]))
    torch.testing.assert_close(res["overall"], torch.tensor(1 / 3))
    masked = routing_change(old, new, token_mask=torch.tensor([True, True, False]))
    torch.testing.assert_close(masked["per_layer"], torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(masked["overall"], torch.tensor(0.25))
    assert masked["n_tokens"] == 2
    as_float = routing_change(old, new, token_mask=torch.tensor([1.0, 0.0, 0.0]))
    assert as_float["overall"] == 0
    same = routing_change(old, old, token_mask=torch.tensor([1, 1, 1]))
    assert same["overall"] == 0 and torch.all(same["per_layer"] == 0)
    with pytest.raises(ValueError, match="token_mask"):
        routing_change(old, new, token_mask=torch.ones(4))
    with pytest.raises(ValueError, match="layers"):
        routing_change(old, new[:1])


def test_unsupported_and_dense_models() -> None:
    from transformers import GraniteMoeConfig, Qwen2Config

    granite = AutoModelForCausalLM.from_config(
        GraniteMoeConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    )
    assert is_moe(granite)
    with pytest.raises(ValueError, match=r"does not support model_type 'granitemoe' \(supported"):
        moe_adapter(granite)
    with pytest.raises(ValueError, match="granitemoe"), replay_routing(granite, []):
        pass

    dense = AutoModelForCausalLM.from_config(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    assert not is_moe(dense)
    with pytest.raises(ValueError, match="not a Mixture-of-Experts"):
        router_modules(dense)


def test_replay_shape_and_usage_errors() -> None:
    model = _model("qwen2_moe")
    ids, mask = _batch()
    _, idx = _record(model, ids, mask)
    with (
        pytest.raises(ValueError, match=r"same \(B, T\) layout"),
        torch.no_grad(),
        replay_routing(model, idx),
    ):
        model(input_ids=ids[:2], attention_mask=mask[:2])
    bad_inputs = {
        "MoE layers": idx[:1],
        "out of range": [t + 8 for t in idx],
        r"\[N, k\]": [t.reshape(-1) for t in idx],
    }
    for message, bad in bad_inputs.items():
        with pytest.raises(ValueError, match=message), replay_routing(model, bad):
            pass
    with (
        replay_routing(model, idx),
        pytest.raises(RuntimeError, match="already active"),
        replay_routing(model, idx),
    ):
        pass
    # hooks are removed after the block: a different layout works again
    with torch.no_grad():
        model(input_ids=ids[:2], attention_mask=mask[:2])


def test_load_balancing_loss_matches_transformers() -> None:
    model = _model("qwen3_moe")
    model.config.router_aux_loss_coef = 1.0
    ids, mask = _batch()
    out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    assert len(out.router_logits) == NUM_LAYERS
    loss = load_balancing_loss(out.router_logits, top_k=2, n_experts=8, mask=mask)
    torch.testing.assert_close(loss, out.aux_loss)
    flat = load_balancing_loss(out.router_logits, 2, 8, mask=mask.reshape(-1))
    torch.testing.assert_close(flat, loss)
    loss.backward()
    assert router_modules(model)[0].weight.grad.abs().sum() > 0
    assert load_balancing_loss([], 2, 8).item() == 0.0
