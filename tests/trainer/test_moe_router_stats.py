"""Router-state and expert-change stats of the MoE hooks on hand-computed cases."""

from __future__ import annotations

import math

import pytest
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


def test_step_load_imbalance_is_the_mean_over_minibatches_like_router_entropy():
    """The step's moe/load_imbalance combines its minibatches as router_entropy does (a mean),
    in one process and through the torchrun reduction; it was declared a "max" stat, so the
    step logged its worst minibatch (4.0 where the minibatches measured 2.0 and 4.0)."""
    from gspo.config import MoEConfig
    from gspo.models.tiny import build_tiny
    from gspo.trainer.metrics import mean_stats, reduce_stats
    from gspo.trainer.moe_hooks import MoEHooks

    hooks = MoEHooks(build_tiny("qwen3_moe")[0], MoEConfig())
    stats = [{"moe/load_imbalance": torch.tensor(v), "moe/router_entropy": torch.tensor(e)}
             for v, e in ((2.0, 0.9), (4.0, 0.7))]
    counts = [{"rows": 4.0, "tokens": 10.0, "signal_rows": 4.0, "signal_tokens": 10.0,
               "weight": 4.0}, {"rows": 4.0, "tokens": 30.0, "signal_rows": 4.0,
                                "signal_tokens": 30.0, "weight": 4.0}]
    got = mean_stats(stats, hooks.stat_kinds, counts)
    assert got["moe/router_entropy"] == pytest.approx(0.8)
    assert got["moe/load_imbalance"] == pytest.approx(3.0)
    # torchrun: every rank holds the same global value of a minibatch; it comes back unchanged
    reduced = reduce_stats(stats, counts, lambda t, _op: t, hooks.stat_kinds)
    assert [float(s["moe/load_imbalance"]) for s in reduced] == pytest.approx([2.0, 4.0])
