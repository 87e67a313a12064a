"""Router-state and expert-change stats of the MoE hooks on hand-computed cases."""

from __future__ import annotations

import math

import torch

from gspo.trainer.moe_hooks import router_state_stats, routing_change_stats


def test_uniform_router_balanced_load():
    logits = [torch.zeros(4, 4)]
    chosen = [torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])]
    s = router_state_stats(logits, chosen, torch.ones(4))
    assert math.isclose(float(s["moe/router_entropy"]), 1.0, rel_tol=1e-6)
    assert math.isclose(float(s["moe/load_imbalance"]), 1.0, rel_tol=1e-6)


def test_collapsed_router_and_masked_tokens():
    logits = [torch.tensor([[50.0, 50.0, -50.0, -50.0]] * 3)]
    chosen = [torch.tensor([[0, 1], [0, 1], [2, 3]])]
    s = router_state_stats(logits, chosen, torch.tensor([1.0, 1.0, 0.0]))  # last token masked
    # entropy of (1/2, 1/2, 0, 0) is log 2, normalised by log 4
    assert math.isclose(float(s["moe/router_entropy"]), 0.5, rel_tol=1e-4)
    assert math.isclose(float(s["moe/load_imbalance"]), 4 / 2, rel_tol=1e-6)  # E/k


def test_expert_change_counts_replaced_experts():
    old = [torch.tensor([[0, 1], [2, 3]])]
    new = [torch.tensor([[1, 0], [2, 0]])]  # row 0: same set, row 1: one of two replaced
    s = routing_change_stats(old, new, torch.ones(2))
    assert math.isclose(float(s["moe/routing_change"]), 0.5)
    assert math.isclose(float(s["moe/expert_change"]), 0.25)
    assert math.isclose(float(s["moe/expert_change_layer0"]), 0.25)
