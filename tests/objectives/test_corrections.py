"""Behaviour corrections: float64 references written from the papers, gradients, edge rows,
binding rules, and weight 1 leaves every objective unchanged."""

import dataclasses
import math

import pytest
import torch

from gspo.config import ConfigError, CorrectionConfig, load_config
from gspo.objectives import CORRECTIONS, OBJECTIVES, Objective, objective_from_config
from gspo.objectives.corrections import LOSS_LEVELS, BoundCorrection, bind_correction
from gspo.objectives.spec import loss_options

OPTS = {"tis": {"cap": 2.0}, "mis": {"cap": 2.0}, "icepop": {"low": 0.5, "high": 5.0},
        "offpolicy_mask": {"delta": 0.01}}
EPS = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.27),
       "cispo": (0.2, 0.27), "gmpo": (0.4, 0.4)}


def _batch(seed=0, b=5, t=7, scale=0.8):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, t, generator=g) > 0.25).double()
    mask[0] = 0.0  # an empty row
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    rollout = old + scale * torch.randn(b, t, generator=g, dtype=torch.float64)
    logp = old + 0.05 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    return old, rollout, logp, adv, mask


def _ref_rho(old, rollout, mask, level):
    """ρ from plain Python loops: token π_old/π_rollout or the per-row geometric mean."""
    b, t = len(mask), len(mask[0])
    if level == "token":
        return [[math.exp(old[i][j] - rollout[i][j]) for j in range(t)] for i in range(b)]
    out = []
    for i in range(b):
        idx = [j for j in range(t) if mask[i][j] > 0]
        out.append(math.exp(sum(old[i][j] - rollout[i][j] for j in idx) / len(idx))
                   if idx else 1.0)
    return out


def _ref_weight(name, rho, opts):
    if name == "tis":
        return min(rho, opts["cap"])
    if name == "mis":
        return rho if rho <= opts["cap"] else 0.0
    return rho if opts["low"] <= rho <= opts["high"] else 0.0  # icepop


@pytest.mark.parametrize("name", ["tis", "mis", "icepop"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_ratio_corrections_match_float64_reference(name, level):
    old, rollout, logp, adv, mask = _batch(seed=1, scale=0.8 if level == "token" else 2.5)
    w, stats = CORRECTIONS[name](old, rollout, logp, adv, mask, level=level, **OPTS[name])
    rho = _ref_rho(old.tolist(), rollout.tolist(), mask.tolist(), level)
    for i in range(mask.shape[0]):
        if level == "sequence":
            want = _ref_weight(name, rho[i], OPTS[name]) if mask[i].any() else 0.0
            assert w[i].item() == pytest.approx(want, rel=1e-12)
            continue
        for j in range(mask.shape[1]):
            want = _ref_weight(name, rho[i][j], OPTS[name]) if mask[i, j] > 0 else 0.0
            assert w[i, j].item() == pytest.approx(want, rel=1e-12)
    assert 0.0 < float(stats["correction/beyond_frac_tokens"]) < 1.0  # some ρ cross C


def test_offpolicy_mask_matches_deepseek_v32_rule():
    old, rollout, logp, adv, mask = _batch(seed=2, scale=0.3)
    w, stats = CORRECTIONS["offpolicy_mask"](old, rollout, logp, adv, mask, level="sequence",
                                             delta=0.01)
    for i in range(mask.shape[0]):
        idx = [j for j in range(mask.shape[1]) if mask[i, j] > 0]
        if not idx:
            assert w[i] == 0.0
            continue
        kl = sum(float(rollout[i, j] - logp[i, j]) for j in idx) / len(idx)
        assert w[i].item() == (0.0 if adv[i] < 0 and kl > 0.01 else 1.0)
    assert float(stats["correction/beyond_frac_seqs"]) == pytest.approx(
        float((w[1:] == 0).double().mean()))


@pytest.mark.parametrize("name", sorted(OPTS))
def test_weights_are_detached_and_edge_rows_are_zero(name):
    old, rollout, logp, adv, mask = _batch(seed=3)
    logp.requires_grad_(True)
    level = CORRECTIONS[name].levels[-1]
    w, _ = CORRECTIONS[name](old, rollout, logp, adv, mask, level=level, **OPTS[name])
    assert not w.requires_grad
    assert (w.reshape(w.shape[0], -1)[0] == 0).all()  # the empty row
    empty = torch.zeros_like(mask)
    w0, s0 = CORRECTIONS[name](old, rollout, logp, adv, empty, level=level, **OPTS[name])
    assert (w0 == 0).all() and all(torch.isfinite(v) and v == 0 for v in s0.values())


def _loss_and_grad(objective, logp, old, adv, mask, rollout=None):
    x = logp.clone().requires_grad_(True)
    loss, stats = objective.loss(x, old, adv, mask, rollout_logprobs=rollout)
    loss.backward()
    return loss.detach(), x.grad, stats


@pytest.mark.parametrize("objective", sorted(LOSS_LEVELS))
@pytest.mark.parametrize("name", sorted(OPTS))
def test_weight_one_leaves_every_objective_unchanged(objective, name):
    """π_rollout = π_old (and π_θ = π_rollout for offpolicy_mask): every weight is 1, so the
    corrected loss has the plain loss's value and gradient exactly."""
    old, _, logp, adv, mask = _batch(seed=4)
    lo, hi = EPS.get(objective, (0.2, 0.27))
    takes = loss_options(objective)
    plain = Objective(objective, {k: v for k, v in (("eps_low", lo), ("eps_high", hi))
                                  if k in takes})
    level = "sequence" if name == "offpolicy_mask" else LOSS_LEVELS[objective]
    corr = dataclasses.replace(plain, correction=BoundCorrection(name, level, objective,
                                                                 OPTS[name]))
    rollout = logp.detach().clone() if name == "offpolicy_mask" else old
    a, ga, _ = _loss_and_grad(plain, logp, old, adv, mask)
    b, gb, stats = _loss_and_grad(corr, logp, old, adv, mask, rollout)
    assert torch.equal(a, b) and torch.equal(ga, gb)
    assert float(stats["correction/beyond_frac_tokens"]) == 0.0


def test_token_correction_on_gspo_runs_the_token_form_and_weight_one_agrees():
    old, _, logp, adv, mask = _batch(seed=5)
    plain = Objective("gspo", {"eps_low": 3e-4, "eps_high": 4e-4})
    corr = dataclasses.replace(plain, correction=BoundCorrection("tis", "token", "gspo_token",
                                                                 {"cap": 2.0}))
    a, ga, _ = _loss_and_grad(plain, logp, old, adv, mask)
    b, gb, _ = _loss_and_grad(corr, logp, old, adv, mask, old)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("objective", sorted(LOSS_LEVELS))
def test_corrected_loss_equals_weighted_terms_and_gradchecks(objective):
    """With real mismatch the corrected loss is the loss with Â·w (w from the float64
    reference), and its gradient passes gradcheck (the weights are constants)."""
    old, rollout, logp, adv, mask = _batch(seed=6, scale=0.5)
    lo, hi = EPS.get(objective, (0.2, 0.27))
    takes = loss_options(objective)
    eps = {k: v for k, v in (("eps_low", lo), ("eps_high", hi)) if k in takes}
    level = LOSS_LEVELS[objective]
    corr = Objective(objective, eps, BoundCorrection("tis", level, objective, {"cap": 1.5}))
    rho = _ref_rho(old.tolist(), rollout.tolist(), mask.tolist(), level)
    w = torch.tensor(rho, dtype=torch.float64).clamp(max=1.5)
    w_adv = adv * w if level == "sequence" else adv[:, None] * w
    x, y = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    got, _ = corr.loss(x, old, adv, mask, rollout_logprobs=rollout)
    want, _ = OBJECTIVES[objective](y, old, w_adv, mask, **eps)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    got.backward()
    want.backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-12)
    # cispo, gspo_token: their values hold stop-gradient terms; clip_cov, kl_cov: a finite-
    # difference step can change which tokens they select (their own tests gradcheck them)
    if objective not in ("cispo", "gspo_token", "clip_cov", "kl_cov"):
        z = logp.clone().requires_grad_(True)
        assert torch.autograd.gradcheck(
            lambda v: corr.loss(v, old, adv, mask, rollout_logprobs=rollout)[0], (z,))


def test_all_masked_batch_gives_a_zero_connected_loss():
    old, rollout, logp, adv, mask = _batch(seed=7)
    corr = Objective("gspo", {"eps_low": 3e-4, "eps_high": 4e-4},
                     BoundCorrection("mis", "sequence", "gspo", {"cap": 1.0 + 1e-9}))
    rollout = old - 1.0  # ρ = e > C everywhere: every sequence masked
    x = logp.clone().requires_grad_(True)
    loss, stats = corr.loss(x, old, adv, mask, rollout_logprobs=rollout)
    loss.backward()
    assert loss.item() == 0.0 and (x.grad == 0).all()
    assert float(stats["correction/beyond_frac_seqs"]) == 1.0


def test_correction_needs_rollout_logprobs():
    old, _, logp, adv, mask = _batch()
    corr = Objective("grpo", {"eps_low": 0.2, "eps_high": 0.27},
                     BoundCorrection("tis", "token", "grpo", {"cap": 2.0}))
    with pytest.raises(ValueError, match="rollout_logprobs"):
        corr.loss(logp, old, adv, mask)


def _bind(*overrides):
    return objective_from_config(load_config(None, list(overrides)).objective)


def test_binding_rules():
    assert _bind().correction is None
    c = _bind("objective.old_logprobs=decoupled", "objective.correction.name=tis")
    assert (c.correction.level, c.correction.via) == ("sequence", "gspo")  # GSPO's own level
    c = _bind("objective.name=grpo", "objective.eps_low=0.2", "objective.eps_high=0.27",
              "objective.old_logprobs=decoupled", "objective.correction.name=icepop")
    assert c.correction.level == "token"
    with pytest.warns(UserWarning, match="token-level correction"):
        c = _bind("objective.old_logprobs=decoupled", "objective.correction.name=tis",
                  "objective.correction.level=token")
    assert c.correction.via == "gspo_token"
    assert "correction/beyond_frac_seqs" in c.stat_kinds


@pytest.mark.parametrize("overrides, match", [
    (["objective.correction.cap=3"], "name=none"),
    (["objective.old_logprobs=decoupled"], "set objective.correction.name"),
    (["objective.correction.name=tis"], "old_logprobs=decoupled"),
    (["objective.old_logprobs=rollout", "objective.correction.name=mis"], "makes equal"),
    (["objective.old_logprobs=decoupled", "objective.correction.name=icepop",
      "objective.correction.cap=3"], "does not take"),
    (["objective.old_logprobs=decoupled", "objective.correction.name=offpolicy_mask",
      "objective.correction.level=token"], "sequence level"),
    (["objective.name=gmpo", "objective.old_logprobs=decoupled",
      "objective.correction.name=tis", "objective.correction.level=token"], "no token form"),
    (["objective.old_logprobs=decoupled", "objective.correction.name=tis",
      "objective.correction.cap=0.5"], "must be >= 1"),
    (["objective.old_logprobs=decoupled", "objective.correction.name=nope"], "choose one of"),
])
def test_binding_errors_are_one_line(overrides, match):
    with pytest.raises((ConfigError, KeyError)) as e:
        _bind(*overrides)
    assert match in str(e.value) and "\n" not in str(e.value)


def test_offpolicy_mask_works_with_rollout_logprobs_as_pi_old():
    c = _bind("objective.old_logprobs=rollout", "objective.correction.name=offpolicy_mask")
    assert c.correction.name == "offpolicy_mask"


def test_bind_correction_none_is_none():
    d = dataclasses.asdict(CorrectionConfig())
    assert bind_correction(d, d, objective="gspo", objective_options={},
                           old_logprobs="recompute") is None
