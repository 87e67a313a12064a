"""The one expert-set comparison (gspo.models.moe.metrics) and the three metrics built on it.

``routing_change`` (set changed per token), ``expert_change`` (share of π_old's experts replaced)
and ``merge_rollout_routing``'s mismatch count must agree with each other and, bit for bit, with
the formulas they replaced (sorted-set compare, broadcast ``==``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from gspo.models.moe import expert_change, expert_set_changed, kept_experts, routing_change
from gspo.trainer.moe_hooks import merge_rollout_routing

E = 8  # experts


def _routings(seed: int, n: int, k: int, layers: int = 3) -> tuple[list, list]:
    """π_old and drifted top-k routings: unchanged, reordered and partly replaced rows."""
    g = torch.Generator().manual_seed(seed)
    old, new = [], []
    for _ in range(layers):
        logits = torch.randn(n, E, generator=g)
        noisy = logits + 0.7 * torch.randn(n, E, generator=g)
        shuffle = torch.rand(n, k, generator=g).argsort(-1)  # order inside a row is arbitrary
        old.append(logits.topk(k, -1).indices)
        new.append(noisy.topk(k, -1).indices.gather(-1, shuffle))
    return old, new


def _sorted_changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The sorted-set compare routing_change and merge_rollout_routing used before."""
    return (a.sort(-1).values != b.sort(-1).values).any(-1)


def _expert_change_before(old, new, mask) -> torch.Tensor:
    """gspo.compare.expert_change as it was (broadcast ``==``)."""
    w = mask.reshape(-1).float()
    out = []
    for a, b in zip(old, new, strict=True):
        kept = (a[:, :, None] == b[:, None, :]).any(-1).float().mean(-1)
        out.append(((1 - kept) * w).sum() / w.sum().clamp(min=1))
    return torch.stack(out)


def _routing_change_before(old, new, mask) -> torch.Tensor:
    """routing_change's per-layer fractions as they were computed (sorted compare)."""
    w = mask.reshape(-1).float()
    return torch.stack([(_sorted_changed(a, b).float() * w).sum() / w.sum()
                        for a, b in zip(old, new, strict=True)])


@dataclass
class _Roll:
    routing: list[torch.Tensor]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.prompt_ids)


def test_kept_experts_hand_values() -> None:
    old = torch.tensor([[0, 1], [2, 3], [4, 5]])
    new = torch.tensor([[1, 0], [2, 7], [6, 7]])  # same set reordered; one replaced; both
    assert kept_experts(old, new).tolist() == [[True, True], [True, False], [False, False]]
    assert expert_set_changed(old, new).tolist() == [False, True, True]
    old3 = torch.tensor([[5, 0, 3], [1, 2, 4]])
    new3 = torch.tensor([[3, 5, 0], [4, 6, 1]])
    assert kept_experts(old3, new3).tolist() == [[True, True, True], [True, False, True]]
    assert expert_set_changed(old3, new3).tolist() == [False, True]
    assert kept_experts(old[:0], new[:0]).shape == (0, 2)


def test_expert_change_hand_values() -> None:
    old = [torch.tensor([[0, 1], [2, 3], [4, 5]])]
    new = [torch.tensor([[1, 0], [2, 7], [6, 7]])]
    assert expert_change(old, new, torch.ones(3)).tolist() == [0.5]  # (0 + 1/2 + 1) / 3
    assert expert_change(old, new, torch.tensor([1.0, 1.0, 0.0])).tolist() == [0.25]
    assert expert_change(old, new, torch.zeros(3)).tolist() == [0.0]
    assert routing_change(old, new)["per_layer"].tolist() == pytest.approx([2 / 3])


def test_expert_change_weights_are_weights_whatever_their_sum() -> None:
    """Float mask values are weights (as in routing_change): scaling them changes nothing,
    also when they sum to less than 1 (the sum was clamped to 1, halving this share)."""
    old = [torch.tensor([[0, 1], [2, 3]])]
    new = [torch.tensor([[4, 5], [2, 7]])]  # both replaced; one of two replaced
    want = [(1.0 * 0.2 + 0.5 * 0.05) / 0.25]
    for scale in (1.0, 4.0, 40.0):
        weights = torch.tensor([0.2, 0.05]) * scale
        assert expert_change(old, new, weights).tolist() == pytest.approx(want)
    first, quarter = [old[0][:1]], torch.tensor([0.25])  # one token, every expert replaced
    assert expert_change(first, [new[0][:1]], quarter).tolist() == [1.0]
    assert routing_change(first, [new[0][:1]], quarter)["per_layer"].tolist() == [1.0]


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_are_bit_identical_to_the_formulas_they_replaced(k: int, seed: int) -> None:
    old, new = _routings(seed, 40, k)
    mask = torch.rand(40, generator=torch.Generator().manual_seed(seed)) < 0.6
    for a, b in zip(old, new, strict=True):
        assert torch.equal(expert_set_changed(a, b), _sorted_changed(a, b))
    assert torch.equal(expert_change(old, new, mask), _expert_change_before(old, new, mask))
    assert torch.equal(routing_change(old, new, mask)["per_layer"],
                       _routing_change_before(old, new, mask))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_three_uses_agree_on_random_routings(k: int) -> None:
    old, new = _routings(7, 30, k)
    changed_per_layer = [int(expert_set_changed(a, b).sum()) for a, b in zip(old, new)]
    assert 0 < sum(changed_per_layer) < 30 * len(old)  # the drift is neither none nor total
    res = routing_change(old, new)
    assert [round(float(f) * 30) for f in res["per_layer"]] == changed_per_layer
    # per token: the set changed exactly when at least one of π_old's experts was replaced
    for i in range(30):
        one = torch.zeros(30)
        one[i] = 1
        replaced = expert_change(old, new, one)
        assert torch.equal(replaced > 0, routing_change(old, new, one)["per_layer"] == 1)
        torch.testing.assert_close(replaced * k, (replaced * k).round())  # whole experts of k
    if k == 1:  # one expert: replacing it is changing the set
        assert torch.equal(expert_change(old, new, torch.ones(30)), res["per_layer"])


def test_merge_rollout_routing_counts_what_routing_change_counts() -> None:
    t, k = 8, 2
    prompts, responses = [[1, 2, 3], [1, 2], [1, 2, 3, 4], [1]], [[5, 6], [5, 6, 7], [5], [5, 6]]
    recomputed, rolled = _routings(3, len(prompts) * t, k)
    response = torch.zeros(len(prompts) * t, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        response[i * t + len(p): i * t + len(p) + len(r)] = True
    unseen = torch.zeros_like(response)
    unseen[[4, 11, 20]] = True  # response tokens the rollout never fed (e.g. a row's last)
    rolled = [torch.where(unseen[:, None], torch.full_like(r, -1), r) for r in rolled]
    merged, changed, seen = merge_rollout_routing(_Roll(rolled, prompts, responses), recomputed)
    sel = response & ~unseen
    assert int(seen) == len(recomputed) * int(sel.sum())  # (token, layer) pairs
    reference = sum(int(_sorted_changed(r[sel], o[sel]).sum()) for r, o in zip(rolled, recomputed))
    assert float(changed) == reference > 0
    res = routing_change(recomputed, merged, response)  # unseen rows keep π_old: never changed
    counts = [round(float(f * res["n_tokens"])) for f in res["per_layer"]]
    assert sum(counts) == reference
