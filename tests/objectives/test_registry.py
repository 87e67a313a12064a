"""Tests for gspo.objectives.registry."""

from __future__ import annotations

import pytest

from gspo.objectives import ADVANTAGES, OBJECTIVES, Registry, UnknownNameError


def _fresh() -> Registry:
    reg = Registry("objective")
    for name in ("c", "a", "b"):
        reg.register(name)(lambda *args, _n=name: _n)
    return reg


def test_register_returns_function_and_lookup_works():
    reg = Registry("objective")

    @reg.register("mine")
    def fn():
        return 1

    assert fn() == 1
    assert reg["mine"] is fn and reg.get("mine") is fn


def test_duplicate_registration_raises():
    reg = _fresh()
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(lambda: None)
    with pytest.raises(ValueError):
        reg.register("")(lambda: None)


def test_unknown_name_lists_choices():
    reg = _fresh()
    msg = "unknown objective 'x'; choose one of: a, b, c"
    with pytest.raises(KeyError) as info:
        reg["x"]
    assert str(info.value) == msg
    with pytest.raises(ValueError, match="choose one of: a, b, c"):
        reg.get("x")
    assert isinstance(info.value, UnknownNameError)
    assert reg.get("x", None) is None


def test_mapping_protocol():
    reg = _fresh()
    assert "a" in reg and "x" not in reg
    assert list(reg) == ["a", "b", "c"] == reg.names()
    assert len(reg) == 3
    assert dict(reg.items())["b"]() == "b"


def test_global_registries():
    assert {"gspo", "gspo_token", "grpo"} <= set(OBJECTIVES)
    assert {"grpo", "rloo"} <= set(ADVANTAGES)
    with pytest.raises(KeyError, match="unknown advantage estimator 'nope'"):
        ADVANTAGES["nope"]
