"""``gspo compare`` with things in the way: run folders it did not start, torn files, seeds
without a value, overrides it would replace, a missing or broken quick section, SIGTERM, an
``--out`` it cannot write. The runs are fakes (a trainer that writes a hand-made metrics.jsonl):
only the comparison's own bookkeeping is under test."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import yaml

from gspo.analysis import compare
from gspo.analysis.report import (
    _cell,
    _per_seed_table,
    _stats,
    markdown_table,
    summarize,
    write_report,
)
from gspo.analysis.spec import Arm, load_spec
from gspo.cli import main
from gspo.config import ConfigError, TrainConfig, to_dict

TINY = ["model=tiny:llama", "steps=1", "rollout.max_new_tokens=3", "task.eval_size=2",
        "num_threads=1"]


class FakeTrainer:
    """Stands in for :class:`gspo.trainer.Trainer`: makes the run folder as the trainer does
    (refusing one that holds a run), writes one step of metrics, returns an evaluation."""

    started: ClassVar[list[str]] = []

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.hooks = SimpleNamespace(active=False)  # a dense policy: the probe measures nothing

    def setup(self) -> FakeTrainer:
        self.run_dir = Path(self.cfg.output_dir) / self.cfg.run_name
        if (self.run_dir / "metrics.jsonl").exists():
            raise FileExistsError(f"run folder {self.run_dir} already holds a run")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(self.cfg)))
        FakeTrainer.started.append(self.cfg.run_name)
        return self

    def train(self) -> dict[str, Any]:
        row = {"step": 1, "reward/mean": 0.5, "time/rollout_s": 1.0}
        (self.run_dir / "metrics.jsonl").write_text(json.dumps(row) + "\n")
        return {"before": {"accuracy": 0.5, "n": 2.0}, "after": {"accuracy": 1.0, "n": 2.0}}

    def cleanup(self) -> None:
        pass


@pytest.fixture
def fake_runs(monkeypatch):
    FakeTrainer.started = []
    monkeypatch.setattr(compare, "Trainer", FakeTrainer)
    monkeypatch.setattr("gspo.analysis.report.plot_compare", lambda summary, runs, out: [])
    return FakeTrainer.started


def spec_file(tmp_path: Path, text: str | None = None, **changes: Any) -> Path:
    data: dict[str, Any] = {"seeds": [0], "overrides": TINY,
                            "arms": {"a": {"overrides": ["objective.name=grpo"]},
                                     "b": {"overrides": ["objective.name=gspo"]}}}
    data.update(changes)
    p = tmp_path / "arms.yaml"
    p.write_text(text if text is not None else yaml.safe_dump(data))
    return p


def compare_cli(tmp_path: Path, spec: Path, *extra: str, out: Path | None = None) -> int:
    return main(["compare", str(spec), "--runs", str(tmp_path / "runs"), "--out",
                 str(out or tmp_path / "out"), *extra])


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("gspo compare: error: "), err
    return err



def test_the_probe_of_a_dense_policy_releases_its_trainer(tmp_path, monkeypatch, fake_runs):
    """The routing probe of a dense policy measures nothing; its trainer (engine, reward
    processes, TensorBoard writer) is closed before the arms' runs, as every run's is (it was
    never closed: its TensorBoard writer's thread ran on, its engine stayed open)."""
    closed: list[str] = []
    monkeypatch.setattr(FakeTrainer, "cleanup", lambda self: closed.append(self.cfg.run_name))
    assert compare_cli(tmp_path, spec_file(tmp_path)) == 0
    assert fake_runs[0] == "probe_s0" and "probe_s0" in closed
    assert sorted(closed) == sorted(fake_runs)

# ----------------------------------------------------------------- A: folders compare did not start


def test_a_run_folder_compare_did_not_start_is_refused_and_kept(tmp_path, capsys, fake_runs):
    """A finished `gspo train` run where an arm's run goes (another config, checkpoints, no
    compare.json) used to be deleted silently; now nothing runs and nothing is deleted."""
    theirs = tmp_path / "runs" / "b_s0"
    (theirs / "checkpoints" / "step_000001").mkdir(parents=True)
    (theirs / "checkpoints" / "step_000001" / "model.safetensors").write_bytes(b"weights")
    (theirs / "config.yaml").write_text(yaml.safe_dump({"seed": 7, "steps": 100}))
    (theirs / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.9}\n')
    before = sorted(p.relative_to(theirs) for p in theirs.rglob("*"))

    assert compare_cli(tmp_path, spec_file(tmp_path)) == 2
    err = one_error_line(capsys)
    assert f"{theirs} holds files that gspo compare did not start" in err
    assert sorted(p.relative_to(theirs) for p in theirs.rglob("*")) == before
    assert fake_runs == []  # refused before the first run (a_s0 comes before b_s0)


def test_an_unfinished_run_compare_started_is_deleted_with_a_line_and_rerun(
        tmp_path, capsys, fake_runs):
    """B too: a torn compare.json (a run killed while writing it) made the rerun crash with a
    JSONDecodeError; it is an unfinished run, deleted (saying so) and run again."""
    spec = spec_file(tmp_path)
    assert compare_cli(tmp_path, spec) == 0
    run = tmp_path / "runs" / "a_s0"
    assert (run / compare.STARTED).is_file()  # marked before its run started
    (run / "compare.json").write_text('{"arm": "a", "wal')
    (run / "left_over").write_text("")
    capsys.readouterr()
    fake_runs.clear()

    assert compare_cli(tmp_path, spec) == 0
    out = capsys.readouterr().out
    assert f"a_s0: deleting the unfinished run that gspo compare started in {run}" in out
    assert "b_s0: finished earlier, reusing" in out
    assert fake_runs == ["a_s0"]
    assert json.loads((run / "compare.json").read_text())["arm"] == "a"
    assert not (run / "left_over").exists()


def test_an_empty_folder_is_used(tmp_path, fake_runs):
    spec = load_spec(spec_file(tmp_path), arms=["a"])
    (tmp_path / "runs" / "a_s0").mkdir(parents=True)
    compare.run_compare(spec, tmp_path / "runs", tmp_path / "out", log=lambda s: None)
    assert fake_runs == ["probe_s0", "a_s0"]


# ------------------------------------------------------------------ B: compare.json written whole


def test_compare_json_is_never_half_written(tmp_path, monkeypatch, fake_runs):
    """Killed while compare.json is written, the run has none (not half of one): the rerun
    runs it again."""
    spec = load_spec(spec_file(tmp_path), arms=["a"])
    real_replace = os.replace

    def killed(src, dst):
        if Path(dst).name == "compare.json" and Path(dst).parent.name == "a_s0":
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        compare.run_compare(spec, tmp_path / "runs", tmp_path / "out", log=lambda s: None)
    run = tmp_path / "runs" / "a_s0"
    assert not (run / "compare.json").exists()
    assert sorted(p.name for p in run.iterdir()) == [compare.STARTED, "config.yaml",
                                                     "metrics.jsonl"]  # no temporary file
    monkeypatch.setattr(os, "replace", real_replace)
    lines: list[str] = []
    compare.run_compare(spec, tmp_path / "runs", tmp_path / "out", log=lines.append)
    assert any(line.startswith("a_s0: deleting the unfinished run") for line in lines)
    assert json.loads((run / "compare.json").read_text())["wall_s"] >= 0


# --------------------------------------------------------- C: how many seeds a cell averages over


def _fake_run(folder: Path, rows: list[dict], done: dict) -> None:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("rollout: {prompts_per_step: 2, group_size: 4}\n")
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "compare.json").write_text(json.dumps(done))


def test_a_cell_says_how_many_seeds_have_a_value(tmp_path):
    """Three seeds; the clipped-token fraction logged by one of them, the sequence-ratio std by
    two: the table used to print "0.200 ± 0.000" under "mean ± sd over seeds"."""
    runs = {}
    for seed, reward in enumerate([0.4, 0.5, 0.6]):
        row: dict[str, Any] = {"step": 1, "reward/mean": reward, "time/rollout_s": 1.0}
        if seed == 0:
            row["objective/clip_frac_tokens"] = 0.2
        if seed < 2:
            row["objective/seq_ratio_std"] = [1.0, 3.0][seed]
        runs[seed] = tmp_path / f"a_s{seed}"
        _fake_run(runs[seed], [row], {"wall_s": 10.0, "before": {"accuracy": 0.5},
                                      "after": {"accuracy": 0.75} if seed == 2 else None})
    spec = SimpleNamespace(path=tmp_path / "x.yaml", seeds=[0, 1, 2],
                           arms=[Arm("a", "A", [])])
    summary = summarize(spec, {"a": runs}, {})
    summary["arms"]["a"]["label"] = "A|B"  # one cell: the pipe escaped
    assert markdown_table(summary).splitlines()[-1].startswith("| A\\|B | ")
    assert "| A\\|B | 0 |" in _per_seed_table(summary)
    summary["arms"]["a"]["label"] = "A"
    stats = summary["arms"]["a"]["stats"]
    assert (stats["clip_frac_tokens"]["n"], stats["clip_frac_tokens"]["of"]) == (1, 3)
    assert math.isnan(stats["clip_frac_tokens"]["sd"])  # one value: no sd (it was 0.0)
    row = markdown_table(summary).splitlines()[-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    head = [c.strip() for c in markdown_table(summary).splitlines()[0].strip("|").split("|")]
    by_title = dict(zip(head, cells, strict=True))
    assert by_title["final reward"] == "0.500 ± 0.100"  # every seed: no count
    assert by_title["clipped-token fraction"] == "0.200 ± — (n=1/3)"
    assert by_title["sequence-ratio std"] == "2.000 ± 1.414 (n=2/3)"
    assert by_title["held-out accuracy after"] == "0.750 ± — (n=1/3)"
    assert by_title["wall time / run (s)"] == "10 ± 0"
    assert _cell(_stats([0.005, math.nan])) == "5.0e-03 ± — (n=1/2)"
    assert _cell(_stats([0.5])) == "0.500 ± —"  # one seed in all: no sd, no count
    # summary.json is strict JSON: null, not a bare NaN, where a figure is missing
    summary.update(total_wall_s=30.0, machine={"cpus": 2, "load_average": 1.0}, probe={},
                   base_config="steps: 1\n")
    write_report(summary, {"a": runs}, tmp_path / "out")

    def refuse(constant: str) -> None:
        raise ValueError(f"summary.json holds {constant}")

    saved = json.loads((tmp_path / "out" / "summary.json").read_text(), parse_constant=refuse)
    assert saved["arms"]["a"]["stats"]["clip_frac_tokens"]["sd"] is None
    assert saved["arms"]["a"]["stats"]["final_reward"]["mean"] == pytest.approx(0.5)


# ------------------------------------------------------- D: overrides compare would replace; dups


@pytest.mark.parametrize("changes, match", [
    ({"overrides": [*TINY, "seed=3"]}, r"overrides: 'seed=3': gspo compare sets seed"),
    ({"arms": {"a": {"overrides": ["output_dir=elsewhere"]}}},
     r"arms\.a\.overrides: 'output_dir=elsewhere': gspo compare sets output_dir"),
    ({"quick": {"overrides": ["run_name=x"]}},
     r"quick\.overrides: 'run_name=x': gspo compare sets run_name"),
    ({"overrides": [*TINY, "resume=runs/x"]},
     r"overrides: 'resume=runs/x': gspo compare starts each run afresh"),
])
def test_an_override_of_what_compare_sets_per_run_is_an_error(tmp_path, capsys, changes, match):
    path = spec_file(tmp_path, **changes)
    with pytest.raises(ConfigError, match=match):
        load_spec(path)
    assert compare_cli(tmp_path, path) == 2
    one_error_line(capsys)
    assert not (tmp_path / "runs").exists()


def test_a_seed_on_the_command_line_is_an_error(tmp_path, capsys):
    path = spec_file(tmp_path)
    assert compare_cli(tmp_path, path, "seed=5") == 2
    assert "command line: 'seed=5': gspo compare sets seed" in one_error_line(capsys)
    spec = load_spec(path)
    with pytest.raises(ConfigError, match="'run_name=r'"):  # the Python API (validate) too
        spec.config(spec.arms[0], 0, tmp_path, ["run_name=r"])
    assert not (tmp_path / "runs").exists()


def test_an_arm_defined_twice_is_an_error_naming_it(tmp_path, capsys):
    text = (f"seeds: [0]\noverrides: {json.dumps(TINY)}\narms:\n"
            "  a: {overrides: [objective.name=grpo]}\n"
            "  b: {overrides: [objective.name=gspo]}\n"
            "  a: {overrides: [objective.name=gspo_token]}\n")
    path = spec_file(tmp_path, text)
    with pytest.raises(ConfigError, match=r"'arms.a' is given twice \(lines 4 and 6\)"):
        load_spec(path)
    assert compare_cli(tmp_path, path) == 2
    one_error_line(capsys)
    twice = spec_file(tmp_path, "seeds: [0]\nseeds: [1]\narms: {a: {}}\n")
    with pytest.raises(ConfigError, match="'seeds' is given twice"):
        load_spec(twice)


# ------------------------------------------------------------------------ E: the quick section


def test_quick_without_a_quick_section_is_an_error(tmp_path, capsys):
    path = spec_file(tmp_path)
    with pytest.raises(ConfigError, match=r"--quick: .* has no quick settings"):
        load_spec(path, quick=True)
    assert compare_cli(tmp_path, path, "--quick") == 2
    one_error_line(capsys)
    assert not (tmp_path / "runs").exists()
    with pytest.raises(ConfigError, match="no quick settings"):
        load_spec(spec_file(tmp_path, quick={}), quick=True)


@pytest.mark.parametrize("quick, match", [
    ({"seeds": "oops"}, "quick.seeds: expected a non-empty list"),
    ({"overrides": ["bogus_key=1"]}, "with the quick settings: arm 'a': unknown config key"),
    ({"overrides": "steps=2"}, "quick.overrides: expected a list"),
    ([], "quick: expected a mapping"),
])
def test_the_quick_section_is_checked_without_quick(tmp_path, quick, match):
    path = spec_file(tmp_path, quick=quick)
    with pytest.raises(ConfigError, match=match):
        load_spec(path)


def test_the_quick_settings_apply_with_quick_only(tmp_path):
    path = spec_file(tmp_path, seeds=[0, 1, 2], quick={"seeds": [4], "overrides": ["steps=2"]})
    full, fast = load_spec(path), load_spec(path, quick=True)
    assert full.seeds == [0, 1, 2] and full.config(full.arms[0], 0, "r").steps == 1
    assert fast.seeds == [4] and fast.config(fast.arms[0], 4, "r").steps == 2
    assert load_spec(path, quick=True, seeds=[1]).seeds == [1]


# ---------------------------------------------------------------- F: SIGTERM reaches the runs


HARNESS = """
import sys
from pathlib import Path

from gspo.analysis import compare
from gspo.config import load_config

folder, fake_python = Path(sys.argv[1]), sys.argv[2]
sys.executable = fake_python  # each run's process: a stand-in that only sleeps
cfg = load_config(None, [f"output_dir={folder}", "run_name=r", "num_threads=1"])
compare.run_side_by_side([(cfg, {})], jobs=1, log=lambda s: print(s, flush=True), poll_s=0.05)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_to_the_parent_of_jobs_terminates_its_runs(tmp_path):
    pid_file = tmp_path / "run.pid"
    fake = tmp_path / "fake_python"
    fake.write_text(f"#!/bin/sh\necho $$ > {pid_file}.tmp\nmv {pid_file}.tmp {pid_file}\n"
                    "exec sleep 60\n")
    fake.chmod(0o755)
    (tmp_path / "harness.py").write_text(HARNESS)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    parent = subprocess.Popen([sys.executable, str(tmp_path / "harness.py"), str(tmp_path),
                               str(fake)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    child = None
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists():
            assert parent.poll() is None, parent.communicate()[0].decode()
            assert time.monotonic() < deadline, "the run's process did not start"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        parent.send_signal(signal.SIGTERM)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the run outlived the SIGTERMed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


# ------------------------------------------------------------ G: --out checked before any run


def test_an_out_folder_that_cannot_be_made_fails_before_the_first_run(tmp_path, capsys,
                                                                     fake_runs):
    (tmp_path / "a_file").write_text("")
    path = spec_file(tmp_path)
    assert compare_cli(tmp_path, path, out=tmp_path / "a_file" / "out") == 2
    err = one_error_line(capsys)
    assert f"--out {tmp_path}/a_file/out: {tmp_path}/a_file is not a folder" in err
    assert fake_runs == [] and not (tmp_path / "runs").exists()
    assert main(["compare", str(path), "--runs", str(tmp_path / "a_file"), "--out",
                 str(tmp_path / "out")]) == 2
    assert "--runs" in one_error_line(capsys)
    assert fake_runs == [] and not (tmp_path / "out").exists()



@pytest.mark.parametrize("bad, match", [
    ("reward.functions=[numeric_mach]", "unknown reward 'numeric_mach'"),
    ("objective.name=gspo_tokn", "gspo_tokn"),
    ("task.name=arithmetc", "arithmetc"),
    ("model=/nonexistent/model", "/nonexistent/model"),
])
def test_a_typo_in_the_last_arm_fails_before_the_first_run(tmp_path, capsys, fake_runs, bad,
                                                           match):
    """What ``gspo validate`` finds without loading anything (an unknown reward, objective,
    task or model) is found for every arm before any run: it failed when the arm's turn came,
    after the runs of the arms before it (hours of them)."""
    path = spec_file(tmp_path, arms={"a": {"overrides": ["objective.name=grpo"]},
                                     "b": {"overrides": ["objective.name=gspo", bad]}})
    assert compare_cli(tmp_path, path) == 2
    err = one_error_line(capsys)
    assert "arm 'b'" in err and match in err, err
    assert fake_runs == [] and not (tmp_path / "runs").exists()


def test_a_partial_report_counts_each_missing_seed_and_each_seed_start_once(tmp_path):
    """``scripts/compare_report.py --partial``: arm a lacks seed 2. Its cells say n=2/3 (they
    read as over every seed), and the accuracy before training, shared by every arm, is one
    value per seed: it used to be the first three runs' (seeds 0, 1 of a, then seed 0 of b)."""
    from gspo.analysis.report import _start_text

    runs: dict[str, dict[int, Path]] = {"a": {}, "b": {}}
    for arm in ("a", "b"):
        for seed, before in zip((0, 1, 2), (0.25, 0.5, 0.75)):
            if arm == "a" and seed == 2:
                continue
            runs[arm][seed] = tmp_path / f"{arm}_s{seed}"
            _fake_run(runs[arm][seed], [{"step": 1, "reward/mean": 0.1 * seed,
                                         "time/rollout_s": 1.0}],
                      {"wall_s": 60.0, "before": {"accuracy": before}, "after": None})
    spec = SimpleNamespace(path=tmp_path / "x.yaml", seeds=[0, 1, 2],
                           arms=[Arm("a", "A", []), Arm("b", "B", [])])
    summary = summarize(spec, runs, {})
    assert (summary["arms"]["a"]["stats"]["final_reward"]["n"],
            summary["arms"]["a"]["stats"]["final_reward"]["of"]) == (2, 3)
    table = markdown_table(summary).splitlines()
    assert "0.050 ± 0.071 (n=2/3)" in table[2] and "(n=" not in table[3]
    text = _start_text(summary)
    assert "held-out accuracy 0.500 ± 0.250." in text, text  # seeds 0, 1, 2 once each
    assert "mean training reward (`reward/mean`, as the final reward)" in text
