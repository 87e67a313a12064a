"""The objective family of gspo.objectives.family, Dr. GRPO's aggregation and REINFORCE++.

Every reference below is written from the papers' formulas with plain Python loops over rows
and tokens in float64, independent of the vectorised implementation.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

from gspo.config import ConfigError, ObjectiveConfig, load_config
from gspo.objectives import (
    ADVANTAGES,
    OBJECTIVES,
    Objective,
    bind_objective,
    grpo_advantages,
    grpo_loss,
    gspo_loss,
    loss_options,
    objective_from_config,
)

F64 = torch.float64
FAMILY = ("sapo", "luspo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov", "gpg")
EPS = {"eps_low": 0.2, "eps_high": 0.28}


def _batch(seed=0, lengths=(6, 3, 0, 5, 1), T=6, spread=0.3):
    """float64 batch; row 2 is empty; padding holds garbage (it must change nothing)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 2 - 0.05
    lp = old + spread * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).to(F64)
    pad = mask == 0
    return lp.masked_fill(pad, 7.0), old.masked_fill(pad, -9.0), adv, mask


def _opts(name, **extra):
    takes = loss_options(name)
    return {k: v for k, v in {**EPS, **extra}.items() if k in takes}


def _tokens(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t] > 0]


# --------------------------------------------------------------------------- references


def _ref_rows(lp, old, adv, mask, per_token, reduce="sequence"):
    """Σ over valid rows of a per-row term from ``per_token(i, t) -> float`` (plain floats)."""
    rows, weights = [], []
    for i in range(lp.shape[0]):
        ts = _tokens(mask, i)
        if not ts:
            continue
        vals = [per_token(i, t) for t in ts]
        rows.append(sum(vals) / len(ts))
        weights.append(len(ts) if reduce == "token" else 1.0)
    return sum(r * w for r, w in zip(rows, weights)) / sum(weights)


def ref_sapo(lp, old, adv, mask, tau_pos=1.0, tau_neg=1.05):
    """arXiv:2511.20347: per token −(4/τ) σ(τ (r − 1)) Â, 1/G Σ_i 1/|y_i| Σ_t."""
    def term(i, t):
        r = math.exp(lp[i, t] - old[i, t])
        tau = tau_pos if adv[i] > 0 else tau_neg
        return -(4.0 / tau) / (1.0 + math.exp(-tau * (r - 1.0))) * float(adv[i])
    return _ref_rows(lp, old, adv, mask, term)


def _seq_ratio(lp, old, mask, i):
    ts = _tokens(mask, i)
    return math.exp(sum(float(lp[i, t] - old[i, t]) for t in ts) / len(ts))


def ref_luspo(lp, old, adv, mask, eps_low, eps_high):
    """arXiv:2602.05261: (1/G) Σ_i |y_i| · −min(s_i Â_i, clip(s_i) Â_i)."""
    total, n = 0.0, 0
    for i in range(lp.shape[0]):
        ts = _tokens(mask, i)
        if not ts:
            continue
        s, a = _seq_ratio(lp, old, mask, i), float(adv[i])
        total += len(ts) * -min(s * a, min(max(s, 1 - eps_low), 1 + eps_high) * a)
        n += 1
    return total / n


def _dppo_ref(lp, old, adv, mask, keep, cap=20.0):
    def term(i, t):
        if not keep(i, t):
            return 0.0
        return -min(math.exp(lp[i, t] - old[i, t]), cap) * float(adv[i])
    return _ref_rows(lp, old, adv, mask, term)


def ref_dppo_tv(lp, old, adv, mask, d_low=0.15, d_high=0.15):
    """arXiv:2602.04879: keep iff π − π_old ≤ δ_high (Â > 0) / ≥ −δ_low (Â ≤ 0)."""
    def keep(i, t):
        d = math.exp(lp[i, t]) - math.exp(old[i, t])
        return d <= d_high if adv[i] > 0 else d >= -d_low
    return _dppo_ref(lp, old, adv, mask, keep)


def _bkl(q, p):
    out = 0.0
    for a, b in ((q, p), (1 - q, 1 - p)):
        if a > 0:
            out += a * math.log(a / b) if b > 0 else math.inf
    return out


def ref_dppo_kl(lp, old, adv, mask, d_low=0.05, d_high=0.05):
    def keep(i, t):
        q, p = math.exp(old[i, t]), math.exp(lp[i, t])
        div = _bkl(q, p)
        return (div <= d_high or p <= q) if adv[i] > 0 else (div <= d_low or p >= q)
    return _dppo_ref(lp, old, adv, mask, keep)


def ref_gpg(lp, old, adv, mask):
    """arXiv:2504.02546: −Σ_i Σ_t Â_i logπ / Σ_i |y_i|."""
    return _ref_rows(lp, old, adv, mask, lambda i, t: -float(adv[i] * lp[i, t]), reduce="token")


def ref_kl_cov(lp, old, adv, mask, ratio=2e-4, coef=1.0):
    """arXiv:2505.22617 KL-Cov: −w Â plus coef |log w| on the top-k covariance tokens."""
    cells = [(i, t) for i in range(lp.shape[0]) for t in _tokens(mask, i)]
    a_bar = sum(float(adv[i]) for i, _ in cells) / len(cells)
    l_bar = sum(float(lp[i, t]) for i, t in cells) / len(cells)
    cov = {(i, t): (float(adv[i]) - a_bar) * (float(lp[i, t]) - l_bar) for i, t in cells}
    k = max(int(ratio * len(cells)), 1)
    top = set(sorted(cells, key=lambda c: -cov[c])[:k])

    def term(i, t):
        lr = float(lp[i, t] - old[i, t])
        return -math.exp(lr) * float(adv[i]) + (coef * abs(lr) if (i, t) in top else 0.0)
    return _ref_rows(lp, old, adv, mask, term)


def ref_clip_cov_value(lp, old, adv, mask, eps_low, eps_high):
    """Clip-Cov detaches gradients only: its value is the clipped GRPO value."""
    def term(i, t):
        w, a = math.exp(lp[i, t] - old[i, t]), float(adv[i])
        return -min(w * a, min(max(w, 1 - eps_low), 1 + eps_high) * a)
    return _ref_rows(lp, old, adv, mask, term)


REFERENCES = {
    "sapo": lambda lp, old, adv, m: ref_sapo(lp, old, adv, m),
    "luspo": lambda lp, old, adv, m: ref_luspo(lp, old, adv, m, **EPS),
    "dppo_tv": ref_dppo_tv,
    "dppo_kl": ref_dppo_kl,
    "clip_cov": lambda lp, old, adv, m: ref_clip_cov_value(lp, old, adv, m, **EPS),
    "kl_cov": ref_kl_cov,
    "gpg": ref_gpg,
}


@pytest.mark.parametrize("name", FAMILY)
@pytest.mark.parametrize("spread", [0.05, 0.3, 1.0])
def test_loss_matches_the_float64_reference(name, spread):
    lp, old, adv, mask = _batch(seed=3, spread=spread)
    loss, stats = OBJECTIVES[name](lp, old, adv, mask, **_opts(name))
    assert loss.dtype == F64
    assert loss.item() == pytest.approx(REFERENCES[name](lp, old, adv, mask), rel=1e-9, abs=1e-12)
    for key, value in stats.items():
        assert value.dtype == torch.float32 and not value.requires_grad, key
        assert torch.isfinite(value), key


def test_every_family_member_is_registered():
    assert set(FAMILY) <= set(OBJECTIVES)
    assert "reinforce_pp_baseline" in ADVANTAGES


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("name", sorted(set(FAMILY) - {"clip_cov", "kl_cov"}))
def test_gradcheck(name):
    lp, old, adv, mask = _batch(seed=5, lengths=(4, 2, 0, 3), T=4, spread=0.2)
    lp = lp.masked_fill(mask == 0, 0.0).requires_grad_(True)
    fn = OBJECTIVES[name]
    assert torch.autograd.gradcheck(lambda x: fn(x, old, adv, mask, **_opts(name))[0], (lp,))


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_gradcheck_of_the_cov_losses_away_from_selection_boundaries(name):
    # A finite difference can flip which token the covariance rule selects; check with a
    # ratio that selects nothing (clip_cov: bounds no token reaches) or a fixed top token.
    lp, old, adv, mask = _batch(seed=5, lengths=(4, 2, 0, 3), T=4, spread=0.2)
    lp = lp.masked_fill(mask == 0, 0.0).requires_grad_(True)
    extra = {"clip_cov_lb": 50.0, "clip_cov_ub": 60.0} if name == "clip_cov" else {}
    fn = OBJECTIVES[name]
    assert torch.autograd.gradcheck(
        lambda x: fn(x, old, adv, mask, **_opts(name, **extra))[0], (lp,), eps=1e-7)


def test_clip_cov_detaches_exactly_the_selected_tokens():
    lp, old, adv, mask = _batch(seed=8, lengths=(6, 6, 6, 6), T=6, spread=0.05)
    lp.requires_grad_(True)
    wide = {"clip_cov_lb": -1e9, "clip_cov_ub": 1e9, "clip_cov_ratio": 0.25}  # 6 of 24 tokens
    loss, stats = OBJECTIVES["clip_cov"](lp, old, adv, mask, **EPS, **wide)
    (g,) = torch.autograd.grad(loss, lp)
    (g_grpo,) = torch.autograd.grad(grpo_loss(lp, old, adv, mask, **EPS)[0], lp)
    zeroed = (g == 0) & (g_grpo != 0)
    assert int(zeroed.sum()) == 6
    assert stats["objective/cov_detached_frac_tokens"].item() == pytest.approx(0.25)
    torch.testing.assert_close(g[~zeroed], g_grpo[~zeroed])
    again, _ = OBJECTIVES["clip_cov"](lp, old, adv, mask, **EPS, **wide)  # deterministic
    (g2,) = torch.autograd.grad(again, lp)
    assert torch.equal(g, g2)


def test_kl_cov_penalises_the_largest_covariance_tokens():
    lp, old, adv, mask = _batch(seed=9, lengths=(6, 6, 6, 6), T=6)
    loss, stats = OBJECTIVES["kl_cov"](lp, old, adv, mask, kl_cov_ratio=0.25)
    assert loss.item() == pytest.approx(ref_kl_cov(lp, old, adv, mask, ratio=0.25), rel=1e-9)
    assert stats["objective/kl_cov_frac_tokens"].item() == pytest.approx(0.25)


# --------------------------------------------------------------------------- empty rows


@pytest.mark.parametrize("name", FAMILY)
def test_empty_rows_change_nothing_and_an_all_empty_batch_is_zero(name):
    lp, old, adv, mask = _batch(seed=11)
    keep = mask.sum(-1) > 0
    full, _ = OBJECTIVES[name](lp, old, adv, mask, **_opts(name))
    cut, _ = OBJECTIVES[name](lp[keep], old[keep], adv[keep], mask[keep], **_opts(name))
    torch.testing.assert_close(full, cut)
    x = lp.clone().requires_grad_(True)
    zero, stats = OBJECTIVES[name](x, old, adv, torch.zeros_like(mask), **_opts(name))
    (g,) = torch.autograd.grad(zero, x)
    assert zero.item() == 0.0 and torch.count_nonzero(g) == 0
    assert all(v.item() == 0.0 for v in stats.values())


@pytest.mark.parametrize("name", FAMILY)
def test_padding_is_ignored(name):
    lp, old, adv, mask = _batch(seed=12)
    a, _ = OBJECTIVES[name](lp, old, adv, mask, **_opts(name))
    pad = mask == 0
    b, _ = OBJECTIVES[name](lp.masked_fill(pad, -3.0), old.masked_fill(pad, float("nan")), adv,
                            mask, **_opts(name))
    torch.testing.assert_close(a, b)


# --------------------------------------------------------------------------- reductions


def test_sapo_gradient_at_small_tau_is_the_unclipped_is_gradient():
    lp, old, adv, mask = _batch(seed=13, spread=0.5)
    x = lp.clone().requires_grad_(True)
    (g_sapo,) = torch.autograd.grad(
        OBJECTIVES["sapo"](x, old, adv, mask, tau_pos=1e-6, tau_neg=1e-6)[0], x)
    unclipped = grpo_loss(x, old, adv, mask, eps_low=1.0, eps_high=1e12)[0]
    (g_is,) = torch.autograd.grad(unclipped, x)
    torch.testing.assert_close(g_sapo, g_is, rtol=1e-6, atol=1e-9)


def test_sapo_on_policy_is_the_plain_policy_gradient_for_any_tau():
    lp, _, adv, mask = _batch(seed=14)
    x = lp.clone().requires_grad_(True)
    for tau in (0.1, 1.0, 30.0):
        (g,) = torch.autograd.grad(
            OBJECTIVES["sapo"](x, lp.detach(), adv, mask, tau_pos=tau, tau_neg=tau)[0], x)
        (g_pg,) = torch.autograd.grad(grpo_loss(x, lp.detach(), adv, mask, **EPS)[0], x)
        torch.testing.assert_close(g, g_pg)


def test_sapo_gate_decays_off_policy_and_faster_for_negative_advantages():
    old = torch.full((2, 1), -1.0, dtype=F64)
    mask = torch.ones(2, 1, dtype=F64)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    for shift in (0.4, -0.4):  # same ratio on both rows, advantages of opposite sign
        x = (old + shift).requires_grad_(True)
        (g,) = torch.autograd.grad(OBJECTIVES["sapo"](x, old, adv, mask)[0], x)
        r = math.exp(shift)
        weight = g.abs().squeeze(-1) / (r / 2)  # |∂/∂logp| = g_it · r · |Â| / G
        assert weight[0] < 1 and weight[1] < weight[0]  # τ_neg = 1.05 > τ_pos = 1.0
        (g_hard,) = torch.autograd.grad(
            OBJECTIVES["sapo"](x, old, adv, mask, tau_pos=100.0, tau_neg=100.0)[0], x)
        assert g_hard.abs().max() < 1e-6  # τ → ∞: off-policy tokens stop learning


def test_luspo_at_equal_lengths_is_length_times_gspo():
    lp, old, adv, mask = _batch(seed=15, lengths=(5, 5, 5, 5), T=5)
    x = lp.clone().requires_grad_(True)
    luspo = OBJECTIVES["luspo"](x, old, adv, mask, **EPS)[0]
    gspo = gspo_loss(x, old, adv, mask, **EPS)[0]
    torch.testing.assert_close(luspo, 5 * gspo)
    (g1,) = torch.autograd.grad(luspo, x)
    (g2,) = torch.autograd.grad(5 * gspo, x)
    torch.testing.assert_close(g1, g2)


def test_luspo_weights_a_row_by_its_length_once_not_squared():
    # Row 0 repeats row 1's per-token log-ratios twice: same s_i, twice the length.
    old = torch.tensor([[-1.0, -1.2, -1.0, -1.2], [-1.0, -1.2, 0.0, 0.0]], dtype=F64)
    lp = old + torch.tensor([[0.1, -0.05, 0.1, -0.05], [0.1, -0.05, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]], dtype=F64)
    adv = torch.tensor([1.0, 1.0], dtype=F64)
    rows = [OBJECTIVES["luspo"](lp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1],
                                **EPS)[0] for i in range(2)]
    torch.testing.assert_close(rows[0], 2 * rows[1])  # |y| weighting; |y|^2 would give 4x
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = gspo_loss(lp, old, adv, mask, **EPS, aggregation="token")[0]
    torch.testing.assert_close(OBJECTIVES["luspo"](lp, old, adv, mask, **EPS)[0], 3 * tok)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo_in_the_trust_region_is_the_is_policy_gradient(name):
    lp, old, adv, mask = _batch(seed=16, spread=1e-3)
    x = lp.clone().requires_grad_(True)
    loss, stats = OBJECTIVES[name](x, old, adv, mask)
    ref = grpo_loss(x, old, adv, mask, eps_low=1.0, eps_high=1e12)[0]
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(*(torch.autograd.grad(v, x)[0] for v in (loss, ref)))
    assert stats["objective/clip_frac_tokens"].item() == 0.0


def _one_token(name, logp, logp_old, a):
    x = torch.tensor([[logp]], dtype=F64, requires_grad=True)
    loss, stats = OBJECTIVES[name](x, torch.tensor([[logp_old]], dtype=F64),
                                   torch.tensor([a], dtype=F64), torch.ones(1, 1, dtype=F64))
    (g,) = torch.autograd.grad(loss, x)
    return g.item(), stats


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo_masks_only_moves_past_the_region_in_the_advantage_direction(name):
    up, down = (math.log(0.9), math.log(0.3)), (math.log(0.3), math.log(0.9))  # (π, π_old)
    g, s = _one_token(name, *up, 1.0)  # Â > 0 and π rose by 0.6: masked (high side)
    assert g == 0.0 and s["objective/clip_frac_tokens_high"].item() == 1.0
    g, _ = _one_token(name, *down, 1.0)  # Â > 0 and π fell: keeps its gradient
    assert g != 0.0
    g, s = _one_token(name, *down, -1.0)  # Â < 0 and π fell by 0.6: masked (low side)
    assert g == 0.0 and s["objective/clip_frac_tokens_low"].item() == 1.0
    g, _ = _one_token(name, *up, -1.0)  # Â < 0 and π rose: keeps its gradient
    assert g != 0.0


def test_dppo_masks_a_low_probability_token_by_divergence_not_by_ratio():
    # 1e-5 -> 1e-3 is a ratio of 100 (GRPO clips it) but a negligible divergence.
    g, _ = _one_token("dppo_tv", math.log(1e-3), math.log(1e-5), 1.0)
    assert g == pytest.approx(-min(100.0, 20.0))  # kept, with the truncated weight cap 20
    x = torch.tensor([[math.log(1e-3)]], dtype=F64, requires_grad=True)
    old = torch.tensor([[math.log(1e-5)]], dtype=F64)
    one = torch.ones(1, 1, dtype=F64)
    (g_grpo,) = torch.autograd.grad(grpo_loss(x, old, one[0], one, **EPS)[0], x)
    assert g_grpo.item() == 0.0  # GRPO's ratio clip stops this token


@pytest.mark.parametrize("spread", [0.3, 1.0])
@pytest.mark.parametrize(("name", "d_low", "d_high"), [
    ("dppo_tv", 0.02, 0.4), ("dppo_tv", 0.4, 0.02),
    ("dppo_kl", 0.002, 0.3), ("dppo_kl", 0.3, 0.002),
])
def test_dppo_asymmetric_deltas_bind_on_their_own_side(name, d_low, d_high, spread):
    """δ_low bounds moves against a negative advantage, δ_high those with a positive one:
    with δ_low ≠ δ_high the loss still matches the float64 reference."""
    lp, old, adv, mask = _batch(seed=5, spread=spread)
    prefix = name.split("_")[1]  # tv / kl
    loss, _ = OBJECTIVES[name](lp, old, adv, mask, **{f"{prefix}_delta_low": d_low,
                                                      f"{prefix}_delta_high": d_high})
    ref = {"dppo_tv": ref_dppo_tv, "dppo_kl": ref_dppo_kl}[name]
    expected = ref(lp, old, adv, mask, d_low=d_low, d_high=d_high)
    assert loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_dppo_kl_divergence_is_kl_of_the_old_policy_to_the_new():
    """D = KL(Bern(π_old) ‖ Bern(π)), not the reverse: at π_old = 0.5, π = 0.8 the two
    directions are 0.2231 and 0.1927, on either side of δ_high = 0.2."""
    from gspo.objectives.family import binary_kl

    q, p = 0.5, 0.8
    forward = q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))
    log_q, log_p = (torch.tensor([math.log(x)], dtype=F64) for x in (q, p))
    value = binary_kl(log_q, log_p)
    assert value.item() == pytest.approx(forward, rel=1e-12)
    x = torch.tensor([[math.log(p)]], dtype=F64, requires_grad=True)
    loss, stats = OBJECTIVES["dppo_kl"](x, torch.tensor([[math.log(q)]], dtype=F64),
                                        torch.ones(1, dtype=F64), torch.ones(1, 1, dtype=F64),
                                        kl_delta_high=0.2)
    (g,) = torch.autograd.grad(loss, x)
    assert g.item() == 0.0 and stats["objective/clip_frac_tokens_high"].item() == 1.0


def test_gpg_gradient_is_the_token_mean_policy_gradient():
    lp, old, adv, mask = _batch(seed=17)
    x = lp.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(OBJECTIVES["gpg"](x, old, adv, mask)[0], x)
    expected = torch.where(mask > 0, -adv[:, None] / mask.sum(), 0.0)
    torch.testing.assert_close(g, expected)


# --------------------------------------------------------------------------- Dr. GRPO


def test_dr_grpo_aggregation_is_the_token_sum_over_a_constant():
    lp, old, adv, mask = _batch(seed=18)
    loss, _ = grpo_loss(lp, old, adv, mask, **EPS, aggregation="constant", norm_constant=8.0)

    def term(i, t):
        w, a = math.exp(lp[i, t] - old[i, t]), float(adv[i])
        return -min(w * a, min(max(w, 0.8), 1.28) * a)
    valid = [i for i in range(len(adv)) if _tokens(mask, i)]
    ref = sum(sum(term(i, t) for t in _tokens(mask, i)) / 8.0 for i in valid) / len(valid)
    assert loss.item() == pytest.approx(ref, rel=1e-12)
    w = Objective("grpo", {**EPS, "aggregation": "constant", "norm_constant": 8.0}).row_weights(
        mask)
    assert w.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]


def test_token_aggregation_of_token_losses_weights_rows_by_length():
    lp, old, adv, mask = _batch(seed=19)
    for name in ("grpo", "sapo", "dppo_tv"):
        objective = Objective(name, {**_opts(name), "aggregation": "token"})
        loss, _ = objective.loss(lp, old, adv, mask)
        rows = torch.stack([objective.loss(lp[i:i + 1], old[i:i + 1], adv[i:i + 1],
                                           mask[i:i + 1])[0] for i in range(len(adv))])
        w = objective.row_weights(mask).to(F64)
        assert w.tolist() == mask.sum(-1).tolist()
        torch.testing.assert_close((w * rows).sum() / w.sum(), loss)


def test_dr_grpo_config_binds_and_needs_its_constant():
    cfg = load_config(None, ["objective.name=grpo", "objective.aggregation=constant",
                             "objective.norm_constant=24", "objective.scale_rewards=none"])
    assert objective_from_config(cfg.objective).options["norm_constant"] == 24.0
    with pytest.raises(ConfigError, match="norm_constant > 0"):
        load_config(None, ["objective.name=grpo", "objective.aggregation=constant"])
    with pytest.raises(ConfigError, match="only used with"):
        load_config(None, ["objective.norm_constant=8"])
    with pytest.raises(ValueError, match="norm_constant > 0"):
        grpo_loss(*_batch()[:4], **EPS, aggregation="constant")


def test_the_default_grpo_path_is_unchanged():
    lp, old, adv, mask = _batch(seed=20)
    a = grpo_loss(lp, old, adv, mask, **EPS)
    b = grpo_loss(lp, old, adv, mask, **EPS, aggregation="sequence", norm_constant=0.0)
    assert torch.equal(a[0], b[0])


# --------------------------------------------------------------------------- config binding

DEFAULTS = dataclasses.asdict(ObjectiveConfig())


@pytest.mark.parametrize(("name", "field", "value"), [
    ("sapo", "eps_low", 0.2), ("gpg", "aggregation", "token"), ("gspo", "tau_pos", 0.5),
    ("dppo_tv", "kl_delta_low", 0.1), ("dppo_kl", "tv_delta_high", 0.1),
    ("kl_cov", "clip_cov_ratio", 1e-3), ("grpo", "ratio_cap", 5.0)])
def test_an_option_of_another_loss_is_a_config_error(name, field, value):
    values = {**DEFAULTS, "name": name, field: value}
    with pytest.raises(ConfigError, match=f"objective.{field}=.*does not take"):
        bind_objective(name, values, DEFAULTS)


@pytest.mark.parametrize("name", FAMILY)
def test_every_family_loss_binds_from_the_default_config(name):
    values = {**DEFAULTS, "name": name}
    objective = bind_objective(name, values, DEFAULTS)
    lp, old, adv, mask = _batch(seed=21)
    _, stats = objective.loss(lp, old, adv, mask)
    assert set(stats) <= set(objective.stat_kinds)


def test_paper_defaults():
    o = ObjectiveConfig()
    assert (o.tau_pos, o.tau_neg) == (1.0, 1.05)
    assert (o.tv_delta_low, o.tv_delta_high, o.kl_delta_low, o.kl_delta_high) == (
        0.15, 0.15, 0.05, 0.05)
    assert (o.clip_cov_ratio, o.clip_cov_lb, o.clip_cov_ub) == (2e-4, 1.0, 5.0)


# --------------------------------------------------------------------------- REINFORCE++


def ref_reinforce_pp(rewards, k, eps=1e-6):
    r = [float(x) for x in rewards]
    groups = [r[j:j + k] for j in range(0, len(r), k)]
    centred = [x - sum(g) / len(g) for g in groups for x in g]
    mu = sum(centred) / len(centred)
    sd = math.sqrt(sum((c - mu) ** 2 for c in centred) / len(centred))
    signal = [max(g) > min(g) for g in groups for _ in g]
    return [(c - mu) / (sd + eps) if s else 0.0 for c, s in zip(centred, signal)]


def test_reinforce_pp_baseline_matches_the_reference():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 2.0, 0.0, 1.0, 1.0],
                           dtype=F64)
    adv = ADVANTAGES["reinforce_pp_baseline"](rewards, 4)
    torch.testing.assert_close(adv, torch.tensor(ref_reinforce_pp(rewards, 4), dtype=F64))
    assert adv[4:8].tolist() == [0.0] * 4  # a group without signal gets exactly 0
    assert adv.dtype == F64 and not adv.requires_grad
    # not grpo's batch scaling: that divides by the std of the raw rewards
    assert not torch.allclose(adv, grpo_advantages(rewards, 4, scale="batch"))


def test_reinforce_pp_baseline_other_scales_and_nan():
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0, float("nan"), 2.0])
    fn = ADVANTAGES["reinforce_pp_baseline"]
    torch.testing.assert_close(fn(rewards, 3, scale="group"),
                               grpo_advantages(rewards, 3, scale="group"))
    torch.testing.assert_close(fn(rewards, 3, scale="none"),
                               grpo_advantages(rewards, 3, scale="none"))
    adv = fn(rewards, 3)
    assert adv[4].item() == 0.0 and torch.isfinite(adv).all()
    with pytest.raises(ValueError, match="scale"):
        fn(rewards, 3, scale="nope")


def test_reinforce_pp_baseline_is_invariant_to_reward_shift_and_scale():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 0.0], dtype=F64)
    fn = ADVANTAGES["reinforce_pp_baseline"]
    torch.testing.assert_close(fn(rewards, 3, eps=0.0), fn(3 * rewards + 5, 3, eps=0.0))


# --------------------------------------------------------------------------- end to end


def _char_codes(prompts, completions, **_):
    """A reward that differs within almost every group, so every loss sees signal."""
    return [float(sum(map(ord, c)) % 97) for c in completions]


@pytest.mark.parametrize("overrides", [
    ["objective.name=sapo"], ["objective.name=luspo"], ["objective.name=dppo_tv"],
    ["objective.name=dppo_kl"], ["objective.name=gpg"], ["objective.name=kl_cov"],
    ["objective.name=clip_cov", "objective.eps_low=0.2", "objective.eps_high=0.28"],
    ["objective.name=grpo", "objective.aggregation=constant", "objective.norm_constant=6",
     "objective.scale_rewards=none", "objective.eps_low=0.2", "objective.eps_high=0.28"],
    ["objective.name=gspo", "objective.advantage=reinforce_pp_baseline",
     "objective.scale_rewards=batch"],
], ids=lambda o: "-".join(x.split("=")[1] for x in o[:2]))
def test_one_training_step_on_a_tiny_model(tmp_path, overrides):
    import json

    from gspo.trainer import Trainer

    cfg = load_config(None, [
        "model=tiny:llama", f"output_dir={tmp_path}", "run_name=smoke", "progress=false",
        "steps=1", "eval_before=false", "task.eval_size=2", "rollout.max_new_tokens=6",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.temperature=1.0",
        "objective.num_minibatches=2", "tensorboard=false", *overrides])
    trainer = Trainer(cfg, reward_fns=[_char_codes]).setup()
    trainer.train()
    rows = [json.loads(x) for x in open(trainer.run_dir / "metrics.jsonl")]
    step = next(r for r in rows if "objective/loss" in r)
    assert math.isfinite(step["objective/loss"]) and step["train/grad_norm"] > 0
