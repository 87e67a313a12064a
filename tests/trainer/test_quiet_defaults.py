"""Quiet defaults: no line about TensorBoard unless the user asked for it (issue 18, item 7)."""

from __future__ import annotations

import sys

import pytest

from gspo.config import load_config
from gspo.trainer.metrics import MetricsLogger


@pytest.fixture
def no_tensorboard(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``from torch.utils.tensorboard import SummaryWriter`` fail as if not installed."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)


def test_default_is_auto_and_bools_still_parse() -> None:
    assert load_config().tensorboard == "auto"
    assert load_config(None, ["tensorboard=true"]).tensorboard == "on"
    assert load_config(None, ["tensorboard=false"]).tensorboard == "off"


def test_auto_without_tensorboard_is_silent(tmp_path, no_tensorboard, capsys) -> None:
    logger = MetricsLogger(tmp_path, load_config().tensorboard)
    logger.log(1, {"reward/mean": 0.5})
    logger.close()
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
    assert logger.tb is None and (tmp_path / "metrics.jsonl").is_file()


@pytest.mark.parametrize("asked", ["on", True])
def test_asked_for_tensorboard_without_it_says_so(tmp_path, no_tensorboard, capsys,
                                                  asked) -> None:
    MetricsLogger(tmp_path, asked).close()
    assert "tensorboard is not installed" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_installed_tensorboard_still_writes(tmp_path, mode) -> None:
    pytest.importorskip("torch.utils.tensorboard")
    logger = MetricsLogger(tmp_path, mode)
    logger.log(1, {"reward/mean": 0.5})
    logger.close()
    assert any((tmp_path / "tensorboard").iterdir())


@pytest.mark.parametrize("mode", ["off", False])
def test_off_writes_nothing(tmp_path, mode) -> None:
    logger = MetricsLogger(tmp_path, mode)
    logger.close()
    assert logger.tb is None and not (tmp_path / "tensorboard").exists()
