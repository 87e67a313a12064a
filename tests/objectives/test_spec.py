"""Tests for gspo.objectives.spec: objectives bound from config, row weights, stat kinds."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from gspo.config import ConfigError, ObjectiveConfig
from gspo.objectives import (
    OBJECTIVES,
    STAT_KEYS,
    STAT_KIND_NAMES,
    STAT_KINDS,
    TRAINER_FIELDS,
    Objective,
    UnknownNameError,
    bind_objective,
    gspo_loss,
    loss_options,
    objective_from_config,
)
from gspo.objectives.spec import _option_defaults

F64 = torch.float64
EPS = dict(eps_low=0.2, eps_high=0.28)
DEFAULTS = dataclasses.asdict(ObjectiveConfig())


def _batch(seed: int = 0, B: int = 5, T: int = 7):
    """Random float64 batch with lengths 7, 4, 0 (empty), 2, 6 and a reference policy."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.1
    lp = old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    ref = old + 0.2 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64)
    lengths = torch.tensor([7, 4, 0, 2, 6])[:B]
    mask = (torch.arange(T)[None] < lengths[:, None]).to(F64)
    return lp, old, adv, mask, ref


def _takes(name, options):
    """``options`` less the ones loss ``name`` does not take (losses without a ratio clip take
    no eps_low/eps_high)."""
    return {k: v for k, v in options.items() if k in loss_options(name)}


def _bind(**fields):
    values = dataclasses.asdict(ObjectiveConfig(**fields))
    return bind_objective(values["name"], values, DEFAULTS)


# --------------------------------------------------------------------------- binding


def test_option_a_loss_does_not_take_is_a_config_error_naming_field_and_loss():
    with pytest.raises(ConfigError) as info:
        _bind(name="cispo", aggregation="token")
    assert str(info.value) == ("objective.aggregation='token': objective 'cispo' does not take "
                               "this option (its options: beta, eps_high, eps_low)")


def test_constant_aggregation_on_gspo_says_gspo_has_none():
    """aggregation=constant with its norm_constant on gspo: the error says gspo has no such
    aggregation (it blamed norm_constant, after the config had asked for it)."""
    with pytest.raises(ConfigError) as info:
        _bind(name="gspo", aggregation="constant", norm_constant=24.0)
    assert str(info.value).startswith("objective.aggregation=constant: objective 'gspo' has no "
                                      "constant aggregation")
    assert _bind(name="grpo", aggregation="constant", norm_constant=24.0).options[
        "norm_constant"] == 24.0


def test_default_valued_fields_the_loss_does_not_take_are_not_passed():
    objective = _bind(name="cispo", eps_low=0.1, beta=0.02, epochs=3, num_minibatches=2)
    assert objective.name == "cispo"
    assert objective.options == {"eps_low": 0.1, "eps_high": 4e-4, "beta": 0.02}


def test_gspo_takes_aggregation():
    assert _bind(name="gspo").options == {"eps_low": 3e-4, "eps_high": 4e-4, "beta": 0.0,
                                          "aggregation": "sequence"}
    assert _bind(name="gspo", aggregation="token").options["aggregation"] == "token"


@pytest.mark.parametrize("fields, message", [
    ({"name": "sapo", "tau_pos": -1.0}, "objective.tau_pos must be a finite number > 0"),
    ({"name": "dppo_tv", "tv_delta_low": -1.0}, "objective.tv_delta_low must be"),
    ({"name": "dppo_kl", "kl_delta_high": 0.0}, "objective.kl_delta_high must be"),
    ({"name": "dppo_kl", "ratio_cap": float("inf")}, "objective.ratio_cap must be"),
    ({"name": "clip_cov", "clip_cov_lb": 6.0, "clip_cov_ub": 5.0},
     "objective.clip_cov_lb must be < clip_cov_ub"),
    ({"name": "clip_cov", "clip_cov_ratio": 2.0}, "objective.clip_cov_ratio must be a share"),
    ({"name": "kl_cov", "kl_cov_ratio": 2.0}, "objective.kl_cov_ratio must be a share"),
    ({"name": "kl_cov", "kl_cov_coef": -1.0}, "objective.kl_cov_coef must be"),
])
def test_a_value_the_loss_refuses_is_a_config_error_at_bind_time(fields, message):
    """Each loss's own option check (``OPTION_CHECKS``) runs when the objective is bound, so
    `gspo validate` and setup refuse the value, naming the field, before the first update."""
    with pytest.raises(ConfigError, match=f"^{message}.*\\(objective '{fields['name']}'\\)$"):
        _bind(**fields)
    bound = _bind(name=fields["name"])  # the defaults pass; the loss runs the same check
    options = {**bound.options, **{k: v for k, v in fields.items() if k != "name"}}
    lp, old, adv, mask, _ = _batch()
    with pytest.raises(ValueError, match=message.removeprefix("objective.")):
        OBJECTIVES[fields["name"]](lp, old, adv, mask, **options)


def test_an_unknown_advantage_estimator_is_a_config_error_at_bind_time():
    with pytest.raises(ConfigError, match=r"objective\.advantage: unknown estimator 'nope'"):
        objective_from_config(ObjectiveConfig(advantage="nope"))


def test_unknown_objective_name():
    with pytest.raises(UnknownNameError, match="unknown objective 'nope'"):
        bind_objective("nope", DEFAULTS, DEFAULTS)
    with pytest.raises(UnknownNameError):
        Objective("nope", {})


def test_every_config_field_is_a_trainer_field_or_an_option():
    options = {o for name in OBJECTIVES for o in loss_options(name)}
    fields = {f.name for f in dataclasses.fields(ObjectiveConfig)}
    assert set(TRAINER_FIELDS) <= fields
    assert fields - set(TRAINER_FIELDS) <= options
    assert not options & set(TRAINER_FIELDS)


def test_loss_options_are_the_keyword_only_parameters():
    assert loss_options("gspo") == ("aggregation", "beta", "eps_high", "eps_low")
    for name in OBJECTIVES:  # eps_low/eps_high: only the losses with a ratio clip
        assert "beta" in loss_options(name)
        assert "ref_logprobs" not in loss_options(name)


def test_a_loss_swallowing_kwargs_is_rejected():
    def loose(logprobs, old_logprobs, advantages, mask, *, eps_low, **options):
        raise AssertionError

    with pytest.raises(TypeError, match="keyword-only"):
        _option_defaults("loose", loose)


def test_objective_rejects_unknown_and_missing_options():
    with pytest.raises(TypeError, match="clip_eps"):
        Objective("grpo", {**EPS, "clip_eps": 0.1})
    with pytest.raises(TypeError, match="eps_high"):
        Objective("grpo", {"eps_low": 0.2})
    assert Objective("gspo", EPS).options == {**EPS, "beta": 0.0, "aggregation": "sequence"}


# --------------------------------------------------------------------------- loss


def _token_ratio_mean(lp, old, mask):
    """Mean over response tokens of exp(logp - old), written out."""
    on = mask > 0
    return torch.exp((lp - old)[on]).mean()


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_loss_is_the_registered_function_plus_token_ratio_mean(name):
    lp, old, adv, mask, ref = _batch(seed=1)
    options = _takes(name, {**EPS, "beta": 0.05})
    loss, stats = Objective(name, options).loss(lp, old, adv, mask, ref_logprobs=ref)
    raw_loss, raw_stats = OBJECTIVES[name](lp, old, adv, mask, ref_logprobs=ref, **options)
    assert torch.equal(loss, raw_loss)
    assert set(stats) == set(raw_stats) | {"objective/token_ratio_mean"}
    for key, value in raw_stats.items():
        assert torch.equal(stats[key], value), key
    ratio = stats["objective/token_ratio_mean"]
    assert ratio.dtype == torch.float32 and not ratio.requires_grad
    assert ratio.item() == pytest.approx(_token_ratio_mean(lp, old, mask).item(), rel=1e-6)


def test_options_reach_the_loss():
    lp, old, adv, mask, _ = _batch(seed=2)
    seq, _ = _bind(name="gspo", **EPS).loss(lp, old, adv, mask)
    with pytest.warns(UserWarning, match="length-weighted"):
        tok, _ = _bind(name="gspo", aggregation="token", **EPS).loss(lp, old, adv, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected, _ = gspo_loss(lp, old, adv, mask, **EPS, aggregation="token")
    assert torch.equal(tok, expected)
    assert not torch.allclose(seq, tok)
    narrow, _ = _bind(name="gspo", eps_low=0.01, eps_high=0.01).loss(lp, old, adv, mask)
    assert torch.equal(narrow, gspo_loss(lp, old, adv, mask, eps_low=0.01, eps_high=0.01)[0])


# --------------------------------------------------------------------------- row weights


@pytest.mark.parametrize("name", sorted(set(OBJECTIVES) - {"gpg"}))  # gpg: a token mean
def test_row_weights_are_one_per_valid_row(name):
    _, _, _, mask, _ = _batch()
    w = Objective(name, _takes(name, EPS)).row_weights(mask)
    assert w.dtype == torch.float32
    assert w.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]


def test_gspo_token_aggregation_weights_rows_by_length():
    _, _, _, mask, _ = _batch()
    w = Objective("gspo", {**EPS, "aggregation": "token"}).row_weights(mask)
    assert w.dtype == torch.float32
    assert w.tolist() == [7.0, 4.0, 0.0, 2.0, 6.0]


@pytest.mark.parametrize("aggregation", ["sequence", "token"])
def test_row_weights_are_the_weights_of_the_loss_mean(aggregation):
    """Σ_i w_i term_i / Σ_i w_i with the declared w_i and single-row losses gives the loss."""
    lp, old, adv, mask, _ = _batch(seed=3)
    objective = Objective("gspo", {**EPS, "aggregation": aggregation})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, _ = objective.loss(lp, old, adv, mask)
        rows = torch.stack([objective.loss(lp[i:i + 1], old[i:i + 1], adv[i:i + 1],
                                           mask[i:i + 1])[0] for i in range(len(adv))])
    w = objective.row_weights(mask).to(F64)
    torch.testing.assert_close((w * rows).sum() / w.sum(), loss)


# --------------------------------------------------------------------------- stat kinds


def _stat_variants(name):
    """(options, ref, advantages shape) combinations covering every optional stat."""
    yield {**EPS}, False, "rows"
    yield {**EPS, "beta": 0.1}, True, "rows"
    yield {**EPS}, True, "rows"  # kl_ref is logged with beta = 0 too
    if "aggregation" in loss_options(name):
        yield {**EPS, "beta": 0.1, "aggregation": "token"}, True, "rows"
    if name not in ("gspo", "gmpo", "luspo"):  # the losses that take [B, T] advantages
        yield {**EPS, "beta": 0.1}, True, "tokens"


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_every_stat_has_a_declared_kind(name):
    lp, old, adv, mask, ref = _batch(seed=4)
    seen = set()
    for options, with_ref, adv_shape in _stat_variants(name):
        objective = Objective(name, _takes(name, options))
        a = adv[:, None].expand_as(mask) if adv_shape == "tokens" else adv
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, stats = objective.loss(lp, old, a, mask, ref_logprobs=ref if with_ref else None)
        assert set(stats) <= set(objective.stat_kinds), set(stats) - set(objective.stat_kinds)
        seen |= set(stats)
    assert {"objective/kl_ref", "objective/token_ratio_mean"} <= seen


def test_stat_kinds_are_well_formed():
    assert set(STAT_KEYS) | {"objective/kl_ref", "objective/token_ratio_mean"} == set(STAT_KINDS)
    assert set(STAT_KINDS.values()) <= set(STAT_KIND_NAMES)
    for key, kind in STAT_KINDS.items():
        if key.endswith("_std"):  # pooled with its mean: same rows / tokens
            assert kind == "std" and STAT_KINDS[key[: -len("_std")] + "_mean"] in (
                "rows", "tokens"), key
        if key.endswith(("_min", "_max")):
            assert kind == key[-3:], key
