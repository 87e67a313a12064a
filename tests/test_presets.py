"""Presets by name from any directory (issue 18, item 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gspo import presets
from gspo.analysis.spec import load_spec
from gspo.cli import main
from gspo.config import ConfigError, load_config, resolve_path

ROOT = Path(__file__).resolve().parents[1]


def test_the_presets_live_in_the_package_and_configs_points_there():
    assert {"tiny_cpu", "grpo_baseline", "moe/compare", "moe/tiny_moe"} <= set(presets.names())
    assert presets.FOLDER == ROOT / "gspo" / "presets"
    assert (ROOT / "configs").resolve() == presets.FOLDER  # in-repo paths keep working
    assert (ROOT / "configs" / "moe" / "compare.yaml").is_file()


@pytest.mark.parametrize("name", ["tiny_cpu", "tiny_cpu.yaml", "configs/tiny_cpu.yaml",
                                  "moe/compare", "moe/tiny_moe.yml"])
def test_names_resolve_to_the_packaged_file(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nowhere near a clone
    found = Path(resolve_path(name))
    assert found.parent in (presets.FOLDER, presets.FOLDER / "moe") and found.is_file()


def test_a_real_file_wins_over_a_preset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny_cpu.yaml").write_text("steps: 3\n")
    assert resolve_path("tiny_cpu.yaml") == Path("tiny_cpu.yaml")
    assert load_config("tiny_cpu.yaml").steps == 3 and load_config("tiny_cpu").steps == 10


def test_an_unknown_name_lists_the_presets(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"not found: tiny_gpu .*presets: .*tiny_cpu"):
        resolve_path("tiny_gpu")
    assert main(["train", "tiny_gpu", "steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "moe/compare" in err and "gspo presets" in err


def test_python_api_takes_names_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config("tiny_cpu", ["seed=3"]).model == "tiny:llama"
    spec = load_spec("moe/compare", quick=True)  # its `base:` is found beside the preset
    assert spec.base == presets.FOLDER / "moe" / "tiny_moe.yaml" and spec.arms


def test_every_preset_has_a_one_line_summary(capsys):
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(presets.preset_files())
    for line in lines:
        name, _, text = line.partition("  ")
        assert name in presets.names() and text.strip() and text.strip() != "(no description)"
        assert len(text.strip()) <= presets.SUMMARY_CHARS


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_presets_help(flag, capsys):
    """``gspo presets --help`` prints its usage and exits 0, as every other command's does."""
    assert main(["presets", flag]) == 0
    assert capsys.readouterr().out.startswith("usage: gspo presets")


def test_cli_from_another_directory(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def gspo(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gspo", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)

    out = gspo("validate", "tiny_cpu", "steps=2")
    assert out.returncode == 0 and "tiny_cpu.yaml: ok" in out.stdout, out.stderr
    out = gspo("validate", "moe/compare")  # a comparison file, its base found beside it
    assert out.returncode == 0, out.stderr
    out = gspo("presets")
    assert out.returncode == 0 and "tiny_cpu" in out.stdout
