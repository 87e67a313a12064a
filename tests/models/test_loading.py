"""Model names: ``<source>:<rest>`` goes through the MODEL_SOURCES registry; loading a model
never imports the layers above it (the trainer registers ``sft:``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import gspo.models.loading as loading
from gspo.models.loading import ModelError, resolve_model
from gspo.registry import Registry


@pytest.fixture
def sources(monkeypatch, tmp_path):
    fresh = Registry("model source")
    fresh.register("zz")(lambda rest: tmp_path / rest)
    monkeypatch.setattr(loading, "MODEL_SOURCES", fresh)
    return fresh


def test_registered_source_gets_the_rest_of_the_name(sources, tmp_path):
    assert resolve_model("zz:a:b") == tmp_path / "a:b"
    assert resolve_model("tiny:llama") == "tiny:llama"


def test_unknown_source_is_a_one_line_error_naming_the_known_ones(sources):
    with pytest.raises(ModelError) as err:
        resolve_model("sfx:tiny_moe")
    msg = str(err.value)
    assert "'sfx:'" in msg and "known: tiny, zz" in msg and len(msg.splitlines()) == 1


def test_a_folder_with_a_colon_is_still_a_folder(sources, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run:1").mkdir()
    (tmp_path / "run:1" / "config.json").write_text("{}")
    assert resolve_model("run:1") == Path("run:1")


def test_loading_a_model_imports_no_higher_layer():
    code = ("import sys, gspo.models; print(sorted(m for m in sys.modules if m.startswith("
            "('gspo.rollout', 'gspo.trainer', 'gspo.analysis', 'gspo.cli'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out
