"""Tests for gspo.objectives.policy_losses (GSPO, GSPO-token, GRPO, CISPO, GMPO)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from gspo.objectives import (
    OBJECTIVES,
    STAT_KEYS,
    cispo_loss,
    gmpo_loss,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
)

F64 = torch.float64
CORE = ("gspo", "gspo_token", "grpo")
ALL = ("gspo", "gspo_token", "grpo", "cispo", "gmpo")


def _batch(seed: int = 0, scale: float = 0.05, B: int = 4, T: int = 6):
    """Random float64 batch; row 1 is shorter, all rows valid."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.1
    lp = old + scale * torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.ones(B, T, dtype=F64)
    mask[1, 3:] = 0
    mask[2, 5:] = 0
    adv = torch.tensor([1.0, -0.7, 0.4, -1.3], dtype=F64)[:B]
    return lp, old, adv, mask


def _assert_off_boundary(lp, old, mask, eps_low, eps_high, margin=1e-3):
    """No token ratio and no sequence ratio sits within `margin` of a clip boundary."""
    d = (lp - old) * mask
    seq = d.sum(-1) / mask.sum(-1)
    bounds = (math.log(1 - eps_low), math.log(1 + eps_high), -eps_low, eps_high)  # + gmpo's
    for x in (d[mask > 0], seq):
        for bound in bounds:
            assert (x - bound).abs().min() > margin


def _grad(fn, lp, old, adv, mask, **kw):
    lp = lp.detach().clone().requires_grad_(True)
    loss, stats = fn(lp, old, adv, mask, **kw)
    (g,) = torch.autograd.grad(loss, lp)
    return loss.detach(), g, stats


# --------------------------------------------------------------------------- gradcheck


# cispo is excluded: its stop-gradient IS weight makes the gradient differ from d(value)
@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo", "gmpo"])
@pytest.mark.parametrize("scale,eps", [(0.05, 0.2), (0.3, 0.05)])
def test_gradcheck(name, scale, eps):
    lp, old, adv, mask = _batch(seed=1, scale=scale)
    _assert_off_boundary(lp, old, mask, eps, eps)
    fn = OBJECTIVES[name]
    lp = lp.clone().requires_grad_(True)
    ref = old + 0.1

    def f(x):
        return fn(x, old, adv, mask, eps_low=eps, eps_high=eps, beta=0.1, ref_logprobs=ref)[0]

    assert torch.autograd.gradcheck(f, (lp,))


def test_gradcheck_case_really_clips():
    lp, old, adv, mask = _batch(seed=1, scale=0.3)
    _, stats = gspo_loss(lp, old, adv, mask, eps_low=0.05, eps_high=0.05)
    assert 0 < stats["objective/clip_frac_seqs"] < 1
    _, stats = grpo_loss(lp, old, adv, mask, eps_low=0.05, eps_high=0.05)
    assert 0 < stats["objective/clip_frac_tokens"] < 1


# --------------------------------------------------------------------------- on-policy


@pytest.mark.parametrize("name", ALL)
def test_on_policy_gradient_is_plain_policy_gradient(name):
    _, old, adv, mask = _batch()
    mask = torch.cat([mask, torch.zeros(1, mask.shape[1], dtype=F64)])  # + empty row
    old = torch.cat([old, old[:1]])
    adv = torch.cat([adv, torch.tensor([5.0], dtype=F64)])
    _, g, _ = _grad(OBJECTIVES[name], old, old, adv, mask, eps_low=0.2, eps_high=0.2)
    n_valid = 4
    expected = -adv[:, None] / mask.sum(-1).clamp(min=1)[:, None] / n_valid * mask
    torch.testing.assert_close(g, expected)


def test_on_policy_gspo_and_grpo_same_gradient():
    _, old, adv, mask = _batch(seed=3)
    _, g1, _ = _grad(gspo_loss, old, old, adv, mask, eps_low=0.2, eps_high=0.28)
    _, g2, _ = _grad(grpo_loss, old, old, adv, mask, eps_low=0.2, eps_high=0.28)
    torch.testing.assert_close(g1, g2)


# --------------------------------------------------------------------------- GSPO-token


@pytest.mark.parametrize("scale,eps", [(0.0, 0.2), (0.05, 0.2), (0.3, 0.05)])
def test_gspo_token_equals_gspo_with_sequence_advantages(scale, eps):
    lp, old, adv, mask = _batch(seed=2, scale=scale)
    kw = dict(eps_low=eps, eps_high=eps)
    l1, g1, s1 = _grad(gspo_loss, lp, old, adv, mask, **kw)
    l2, g2, s2 = _grad(gspo_token_loss, lp, old, adv, mask, **kw)
    l3, g3, _ = _grad(gspo_token_loss, lp, old, adv[:, None].expand_as(mask), mask, **kw)
    torch.testing.assert_close(l1, l2)
    torch.testing.assert_close(l1, l3)
    torch.testing.assert_close(g1, g2)
    torch.testing.assert_close(g1, g3)
    for k in ("objective/clip_frac_seqs", "objective/clip_frac_tokens_high"):
        torch.testing.assert_close(s1[k], s2[k])
    if scale == 0.3:
        assert s1["objective/clip_frac_seqs"] > 0


# --------------------------------------------------------------------------- clipping


def _two_rows(log_s: list[float], adv: list[float]):
    """Rows of length 3 with constant per-token log-ratio log_s[i]."""
    old = torch.tensor([[-1.0, -2.0, -0.5]] * len(log_s), dtype=F64)
    lp = old + torch.tensor(log_s, dtype=F64)[:, None]
    return lp, old, torch.tensor(adv, dtype=F64), torch.ones_like(old)


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_clipping_zeroes_gradient_only_on_the_correct_side(name):
    # eps_low=0.2, eps_high=0.3: bounds 0.8, 1.3; log(1.5)=0.405, log(0.6)=-0.51
    hi, lo = math.log(1.5), math.log(0.6)
    lp, old, adv, mask = _two_rows([hi, lo, lo, hi], [1.0, 1.0, -1.0, -1.0])
    _, g, stats = _grad(OBJECTIVES[name], lp, old, adv, mask, eps_low=0.2, eps_high=0.3)
    assert torch.all(g[0] == 0)  # Â>0, s>1+eps_high: clipped
    assert torch.all(g[1] != 0)  # Â>0, s<1-eps_low: not clipped
    assert torch.all(g[2] == 0)  # Â<0, s<1-eps_low: clipped
    assert torch.all(g[3] != 0)  # Â<0, s>1+eps_high: not clipped
    assert stats["objective/clip_frac_seqs_high"] == 0.25
    assert stats["objective/clip_frac_seqs_low"] == 0.25
    assert stats["objective/clip_frac_tokens"] == 0.5


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_signal_fractions_leave_zero_advantage_rows_out(name):
    """A row with Â = 0 is never clipped but counts in the plain fractions; the ``*_signal``
    fractions count only rows with Â ≠ 0 (and their tokens)."""
    hi, lo = math.log(1.5), math.log(0.6)
    lp, old, adv, mask = _two_rows([hi, lo, hi, hi], [1.0, 1.0, 0.0, 0.0])
    mask[1, 2] = 0.0  # row 1 (with signal, not clipped) has 2 tokens: 5 signal tokens
    _, _, stats = _grad(OBJECTIVES[name], lp, old, adv, mask, eps_low=0.2, eps_high=0.3)
    assert stats["objective/clip_frac_seqs"] == 0.25  # 1 of 4 rows
    assert stats["objective/clip_frac_seqs_signal"] == 0.5  # 1 of the 2 rows with signal
    torch.testing.assert_close(stats["objective/clip_frac_tokens"], torch.tensor(3 / 11))
    torch.testing.assert_close(stats["objective/clip_frac_tokens_signal"], torch.tensor(3 / 5))
    _, _, none = _grad(OBJECTIVES[name], lp, old, torch.zeros_like(adv), mask, eps_low=0.2,
                       eps_high=0.3)  # no row with signal: 0, as for a batch without rows
    assert none["objective/clip_frac_seqs_signal"] == 0.0
    assert none["objective/clip_frac_tokens_signal"] == 0.0


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_signal_fractions_count_rows_with_a_negative_advantage(name):
    """Â ≠ 0, not Â > 0, is what makes a row carry signal: a clipped row with Â < 0 counts."""
    lo = math.log(0.6)
    lp, old, adv, mask = _two_rows([lo, lo, lo], [-1.0, 1.0, 0.0])
    _, _, stats = _grad(OBJECTIVES[name], lp, old, adv, mask, eps_low=0.2, eps_high=0.3)
    # row 0 (Â<0, ratio 0.6 < 0.8) is clipped-low; row 1 (Â>0) is not; row 2 has no signal
    assert stats["objective/clip_frac_seqs_signal"] == 0.5
    assert stats["objective/clip_frac_tokens_signal"] == 0.5
    assert stats["objective/clip_frac_seqs_low"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("name", ALL)
def test_old_logprobs_get_no_gradient(name):
    """π_old is stop-gradient even when the caller's tensor requires grad."""
    lp, old, adv, mask = _batch(scale=0.3)
    lp = lp.clone().requires_grad_(True)
    old = old.clone().requires_grad_(True)
    loss, _ = OBJECTIVES[name](lp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    loss.backward()
    assert lp.grad is not None and lp.grad.abs().sum() > 0
    assert old.grad is None


def test_grpo_clipping_is_per_token():
    hi, lo, mid = math.log(1.5), math.log(0.6), 0.05
    old = torch.zeros(2, 3, dtype=F64) - 1.0
    lp = old + torch.tensor([[hi, lo, mid], [hi, lo, mid]], dtype=F64)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    _, g, stats = _grad(grpo_loss, lp, old, adv, torch.ones_like(old), eps_low=0.2, eps_high=0.3)
    assert g[0, 0] == 0 and g[0, 1] != 0 and g[0, 2] != 0
    assert g[1, 0] != 0 and g[1, 1] == 0 and g[1, 2] != 0
    torch.testing.assert_close(stats["objective/clip_frac_tokens_high"], torch.tensor(1 / 6))
    torch.testing.assert_close(stats["objective/clip_frac_tokens_low"], torch.tensor(1 / 6))
    assert stats["objective/clip_frac_seqs"] == 1.0


def test_gmpo_clips_in_log_space_per_token():
    old = torch.zeros(1, 3, dtype=F64) - 1.0
    lp = old + torch.tensor([[0.5, -0.5, 0.1]], dtype=F64)
    _, g, stats = _grad(
        gmpo_loss,
        lp,
        old,
        torch.tensor([1.0], dtype=F64),
        torch.ones_like(old),
        eps_low=0.4,
        eps_high=0.4,
    )
    assert g[0, 0] == 0 and g[0, 1] != 0 and g[0, 2] != 0
    torch.testing.assert_close(stats["objective/clip_frac_tokens_high"], torch.tensor(1 / 3))


def test_cispo_keeps_gradient_of_clipped_tokens_with_capped_weight():
    old = torch.zeros(1, 2, dtype=F64) - 1.0
    lp = old + torch.tensor([[math.log(2.0), 0.0]], dtype=F64)
    _, g, stats = _grad(
        cispo_loss,
        lp,
        old,
        torch.tensor([1.0], dtype=F64),
        torch.ones_like(old),
        eps_low=0.2,
        eps_high=0.3,
    )
    # -(sg[clip(w)] * A) / |y| / n_rows: weights 1.3 (capped from 2.0) and 1.0
    torch.testing.assert_close(g, torch.tensor([[-1.3 / 2, -1.0 / 2]], dtype=F64))
    assert stats["objective/clip_frac_tokens_high"] == 0.5


# --------------------------------------------------------------------------- masking


@pytest.mark.parametrize("name", ALL)
def test_empty_row_changes_nothing(name):
    lp, old, adv, mask = _batch(seed=4, scale=0.2)
    kw = dict(eps_low=0.1, eps_high=0.1)
    l1, g1, _ = _grad(OBJECTIVES[name], lp, old, adv, mask, **kw)
    lp2 = torch.cat([lp, torch.full((1, lp.shape[1]), 1e6, dtype=F64)])
    old2 = torch.cat([old, torch.full((1, lp.shape[1]), -1e6, dtype=F64)])
    mask2 = torch.cat([mask, torch.zeros(1, lp.shape[1], dtype=F64)])
    adv2 = torch.cat([adv, torch.tensor([float("nan")], dtype=F64)])
    l2, g2, _ = _grad(OBJECTIVES[name], lp2, old2, adv2, mask2, **kw)
    torch.testing.assert_close(l1, l2)
    torch.testing.assert_close(g1, g2[:-1])
    assert torch.all(g2[-1] == 0)


@pytest.mark.parametrize("name", ALL)
def test_empty_row_changes_no_stat(name):
    """Stats are means / extremes over valid rows and response tokens: a row without response
    tokens (its padding holding garbage) changes none of them, ``seq_ratio_min``/``_max``
    included (all valid rows have s_i > 1 here, the empty row's padding would give 1)."""
    lp, old, adv, mask = _batch(seed=4, scale=0.2)
    lp = old + (lp - old).abs() + 0.01  # every token ratio, hence every s_i, above 1
    kw = dict(eps_low=0.1, eps_high=0.1)
    _, s1 = OBJECTIVES[name](lp, old, adv, mask, **kw)
    pad = lambda x, v: torch.cat([x, torch.full((1, x.shape[1]), v, dtype=F64)])  # noqa: E731
    _, s2 = OBJECTIVES[name](pad(lp, 0.0), pad(old, 0.0), torch.cat([adv, adv[:1]]),
                             pad(mask, 0.0), **kw)
    assert float(s1["objective/seq_ratio_min"]) > 1
    for key in s1:
        torch.testing.assert_close(s2[key], s1[key], msg=key)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("garbage", [1e4, -1e9, float("inf"), float("nan")])
def test_padding_garbage_changes_nothing(name, garbage):
    lp, old, adv, mask = _batch(seed=5, scale=0.2)
    kw = dict(eps_low=0.1, eps_high=0.1, beta=0.05, ref_logprobs=old - 0.1)
    l1, g1, s1 = _grad(OBJECTIVES[name], lp, old, adv, mask, **kw)
    pad = mask == 0
    lp2, old2 = lp.masked_fill(pad, garbage), old.masked_fill(pad, -garbage)
    kw["ref_logprobs"] = kw["ref_logprobs"].masked_fill(pad, garbage)
    l2, g2, s2 = _grad(OBJECTIVES[name], lp2, old2, adv, mask, **kw)
    torch.testing.assert_close(l1, l2)
    torch.testing.assert_close(g1, g2)
    assert torch.all(g2[pad] == 0)
    for k in s1:
        torch.testing.assert_close(s1[k], s2[k])


@pytest.mark.parametrize("name", ALL)
def test_no_valid_rows_gives_connected_zero(name):
    lp = torch.randn(2, 3, dtype=F64, requires_grad=True)
    loss, stats = OBJECTIVES[name](
        lp, lp.detach() + 1, torch.ones(2, dtype=F64), torch.zeros(2, 3), eps_low=0.2, eps_high=0.2
    )
    assert loss.requires_grad and loss == 0
    loss.backward()
    assert torch.all(lp.grad == 0)
    assert all(v == 0 for v in stats.values())


# --------------------------------------------------------------------------- values


def _hand_example():
    """Row 0: |y|=2, token log-ratios (0.1, 0.3), Â=1.  Row 1: |y|=3, (-0.1, -0.2, 0), Â=-0.5.

    Row 2 is empty. eps_low = eps_high = 0.2.
    """
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5], [-1.0, -1.0, -1.0]], dtype=F64)
    d = torch.tensor([[0.1, 0.3, 7.0], [-0.1, -0.2, 0.0], [3.0, 3.0, 3.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=F64)
    adv = torch.tensor([1.0, -0.5, 9.0], dtype=F64)
    return old + d, old, adv, mask


def test_gspo_hand_computed_value_and_stats():
    lp, old, adv, mask = _hand_example()
    loss, stats = gspo_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    # s_0 = exp(0.2) = 1.2214 > 1.2 and Â>0  -> term_0 = -1.2 * 1 = -1.2
    # s_1 = exp(-0.1) = 0.904837418 in range -> term_1 = -(-0.5 * 0.904837418) = 0.452418709
    # loss = (-1.2 + 0.452418709) / 2
    assert loss.item() == pytest.approx(-0.3737906454910101, abs=1e-12)
    expected = {
        "objective/clip_frac_seqs": 0.5,
        "objective/clip_frac_seqs_high": 0.5,
        "objective/clip_frac_seqs_low": 0.0,
        "objective/clip_frac_tokens": 0.4,  # the 2 tokens of row 0 out of 5
        "objective/clip_frac_tokens_high": 0.4,
        "objective/clip_frac_tokens_low": 0.0,
        "objective/seq_ratio_mean": (1.2214027581601699 + 0.9048374180359595) / 2,
        "objective/seq_ratio_min": 0.9048374180359595,
        "objective/seq_ratio_max": 1.2214027581601699,
        "objective/seq_ratio_std": (1.2214027581601699 - 0.9048374180359595) / 2,
        "objective/token_log_ratio_abs_max": 0.3,
        "objective/adv_mean": 0.25,
        "objective/policy_loss": -0.3737906454910101,
    }
    for k, v in expected.items():
        assert stats[k].item() == pytest.approx(v, abs=1e-6), k
    # k3(old||new) per token: (e^x - 1) - x for x in 0.1, 0.3, -0.1, -0.2, 0
    k3 = [
        0.005170918075647624,
        0.04985880757600318,
        0.004837418035959572,
        0.018730753077981858,
        0.0,
    ]
    assert stats["objective/approx_kl"].item() == pytest.approx(sum(k3) / 5, abs=1e-6)


def test_grpo_hand_computed_value():
    lp, old, adv, mask = _hand_example()
    loss, stats = grpo_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    # row 0 (Â=1): w = e^0.1 = 1.105170918 (in range), e^0.3 = 1.349858808 -> clipped to 1.2
    #   term_0 = -(1.105170918 + 1.2) / 2 = -1.152585459
    # row 1 (Â=-0.5): w = 0.904837418, 0.818730753, 1.0 all in range
    #   term_1 = 0.5 * (0.904837418 + 0.818730753 + 1.0) / 3 = 0.453928029
    assert loss.item() == pytest.approx((-1.152585459037824 + 0.4539280285189902) / 2, abs=1e-12)
    assert stats["objective/clip_frac_tokens_high"].item() == pytest.approx(0.2)
    assert stats["objective/clip_frac_seqs_high"].item() == pytest.approx(0.5)


def test_gspo_token_aggregation_is_length_weighted_and_warns():
    lp, old, adv, mask = _hand_example()
    with pytest.warns(UserWarning, match="length-weighted"):
        loss, _ = gspo_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.2, aggregation="token")
    # (2 * -1.2 + 3 * 0.452418709) / 5
    assert loss.item() == pytest.approx(-0.20854877458921212, abs=1e-12)


def test_default_gspo_does_not_warn():
    lp, old, adv, mask = _hand_example()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gspo_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.2)
        gspo_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.2, aggregation="sequence")


@pytest.mark.parametrize("eps", [0.2, 0.05])
def test_constant_token_log_ratio_grpo_equals_gspo(eps):
    # rows of lengths 3, 2, 1 with constant log-ratio per row, so w_it = s_i
    old = torch.full((3, 3), -1.0, dtype=F64)
    lp = old + torch.tensor([0.15, -0.12, 0.03], dtype=F64)[:, None]
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=F64)
    adv = torch.tensor([0.8, -1.1, 0.3], dtype=F64)
    kw = dict(eps_low=eps, eps_high=eps)
    l1, _ = gspo_loss(lp, old, adv, mask, **kw)
    l2, _ = grpo_loss(lp, old, adv, mask, **kw)
    torch.testing.assert_close(l1, l2)


# --------------------------------------------------------------------------- arguments


def test_unknown_aggregation_raises():
    lp, old, adv, mask = _hand_example()
    with pytest.raises(ValueError, match="aggregation"):
        gspo_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.2, aggregation="tokens")


@pytest.mark.parametrize("name", ALL)
def test_unknown_option_raises_type_error(name):
    lp, old, adv, mask = _hand_example()
    with pytest.raises(TypeError, match="clip_eps"):
        OBJECTIVES[name](lp, old, adv, mask, eps_low=0.2, eps_high=0.2, clip_eps=0.1)


def test_bad_shapes_raise():
    lp, old, adv, mask = _hand_example()
    with pytest.raises(ValueError):
        gspo_loss(lp, old, adv[:, None].expand_as(mask), mask, eps_low=0.2, eps_high=0.2)
    with pytest.raises(ValueError):
        grpo_loss(lp, old[:2], adv, mask, eps_low=0.2, eps_high=0.2)
    with pytest.raises(ValueError):
        grpo_loss(lp, old, adv[:2], mask, eps_low=0.2, eps_high=0.2)


# --------------------------------------------------------------------------- KL


@pytest.mark.parametrize("name", CORE)
def test_kl_requires_ref(name):
    lp, old, adv, mask = _hand_example()
    with pytest.raises(ValueError, match="ref_logprobs"):
        OBJECTIVES[name](lp, old, adv, mask, eps_low=0.2, eps_high=0.2, beta=0.1)


@pytest.mark.parametrize("name", CORE)
def test_kl_zero_when_ref_equals_policy(name):
    lp, old, adv, mask = _batch(seed=6, scale=0.1)
    kw = dict(eps_low=0.2, eps_high=0.2)
    l0, g0, _ = _grad(OBJECTIVES[name], lp, old, adv, mask, **kw)
    l1, g1, s1 = _grad(OBJECTIVES[name], lp, old, adv, mask, beta=0.5, ref_logprobs=lp, **kw)
    torch.testing.assert_close(l0, l1)
    torch.testing.assert_close(g0, g1)
    assert s1["objective/kl_ref"] == 0


@pytest.mark.parametrize("name", CORE)
def test_kl_gradient_pulls_towards_reference(name):
    old = torch.full((2, 2), -1.0, dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=F64)
    ref = old - torch.tensor([[0.5, -0.5], [0.2, 0.0]], dtype=F64)  # ref - lp at θ = θ_old
    adv = torch.zeros(2, dtype=F64)  # no policy gradient
    beta = 0.1
    _, g, stats = _grad(
        OBJECTIVES[name],
        old,
        old,
        adv,
        mask,
        eps_low=0.2,
        eps_high=0.2,
        beta=beta,
        ref_logprobs=ref,
    )
    # d/dlp [exp(ref-lp) - (ref-lp) - 1] = 1 - exp(ref-lp); / |y_i| / n_rows
    d = ref - old
    expected = beta * (1 - torch.exp(d)) / torch.tensor([[2.0], [1.0]], dtype=F64) / 2 * mask
    torch.testing.assert_close(g, expected)
    assert g[0, 0] > 0 and g[0, 1] < 0  # lp above ref is pushed down, below ref up
    # kl_ref = mean over rows of token-mean k3
    k3 = lambda x: math.exp(x) - x - 1  # noqa: E731
    kl = ((k3(-0.5) + k3(0.5)) / 2 + k3(-0.2)) / 2
    assert stats["objective/kl_ref"].item() == pytest.approx(kl, abs=1e-6)


# --------------------------------------------------------------------------- stats


@pytest.mark.parametrize("name", ALL)
def test_stats_detached_float32_scalars(name):
    lp, old, adv, mask = _batch(seed=7, scale=0.2)
    lp = lp.float().requires_grad_(True)
    _, stats = OBJECTIVES[name](
        lp,
        old.float(),
        adv.float(),
        mask,
        eps_low=0.2,
        eps_high=0.2,
        beta=0.1,
        ref_logprobs=old.float(),
    )
    assert set(STAT_KEYS) | {"objective/kl_ref"} == set(stats)
    for k, v in stats.items():
        assert not v.requires_grad and v.dtype == torch.float32 and v.dim() == 0, k
        assert torch.isfinite(v), k


@pytest.mark.parametrize("name", CORE)
def test_bf16_inputs_computed_in_float32(name):
    lp, old, adv, mask = _batch(seed=8, scale=0.05)
    lp16 = lp.to(torch.bfloat16).requires_grad_(True)
    loss, _ = OBJECTIVES[name](lp16, old.to(torch.bfloat16), adv, mask, eps_low=0.2, eps_high=0.2)
    assert loss.dtype == torch.float32
    loss.backward()
    assert lp16.grad is not None and lp16.grad.dtype == torch.bfloat16
    ref, _ = OBJECTIVES[name](
        lp16.detach().double(),
        old.to(torch.bfloat16).double(),
        adv,
        mask,
        eps_low=0.2,
        eps_high=0.2,
    )
    assert loss.item() == pytest.approx(ref.item(), abs=1e-5)
