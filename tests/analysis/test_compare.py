"""``gspo compare``: the comparison file's validation, and a quick run end to end."""

import json
from pathlib import Path

import pytest
import yaml

from gspo.analysis.compare import run_compare
from gspo.analysis.spec import is_compare_file, load_spec
from gspo.cli import main
from gspo.config import ConfigError
from gspo.models.moe import expert_change

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "configs" / "moe" / "compare.yaml"
PNG = b"\x89PNG\r\n\x1a\n"


def write(tmp_path: Path, data) -> Path:
    p = tmp_path / "arms.yaml"
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def good(**changes):
    spec = {"seeds": [0], "arms": {"a": {"label": "A", "overrides": ["objective.name=grpo"]}}}
    spec.update(changes)
    return spec


def test_shipped_comparison_loads_with_the_paper_arms():
    assert is_compare_file(SPEC) and not is_compare_file(ROOT / "configs" / "moe" /
                                                         "tiny_moe.yaml")
    spec = load_spec(SPEC)
    assert [a.name for a in spec.arms][:4] == ["gspo", "grpo_r2", "grpo", "gspo_token"]
    assert len(spec.seeds) >= 3
    cfgs = {a.name: spec.config(a, 0, "runs") for a in spec.arms}
    assert all(c.objective.num_minibatches == 4 for c in cfgs.values())
    assert cfgs["grpo_r2"].moe.routing_replay == "r2" and cfgs["grpo"].moe.routing_replay == "off"
    assert (cfgs["gspo"].objective.eps_low, cfgs["gspo"].objective.eps_high) == (3e-4, 4e-4)
    assert (cfgs["grpo"].objective.eps_low, cfgs["grpo"].objective.eps_high) == (0.2, 0.27)
    quick = load_spec(SPEC, quick=True)
    assert quick.seeds == [0, 1] and quick.config(quick.arms[0], 0, "r").steps == 2


@pytest.mark.parametrize("data, match", [
    ("arms: [unclosed", "not valid YAML"),
    ("- a\n- b\n", "expected a mapping"),
    (good(seed=[0]), "unknown key 'seed'"),
    ({"arms": {"a": {}}}, "missing 'seeds'"),
    (good(seeds=[]), "seeds: expected a non-empty list"),
    (good(seeds=[1, 1]), "seeds: expected a non-empty list of distinct"),
    (good(arms={}), "arms: expected a non-empty mapping"),
    (good(arms={"a b": {}}), "arm name 'a b'"),
    # its runs would be the routing probes' folders (probe_s<seed>): it failed after a run
    (good(arms={"probe": {}}), "arm name 'probe' is taken"),
    (good(arms={"a": {"overides": []}}), "arms.a: unknown key 'overides'"),
    (good(arms={"a": {"overrides": "objective.name=grpo"}}), "expected a list of key=value"),
    (good(arms={"a": {"overrides": ["objective.name"]}}), "'objective.name' is not key=value"),
    (good(arms={"a": {"overrides": ["objective.eps=1"]}}), "arm 'a': unknown config key"),
    (good(arms={"a": {"overrides": ["objective.eps\nx=1"]}}), "arm 'a': unknown config key"),
    (good(base="missing.yaml"), "base: file not found"),
    (good(quick={"steps": 2}), "quick: unknown key 'steps'"),
])
def test_bad_comparison_file_is_a_one_line_config_error(tmp_path, capsys, data, match):
    path = write(tmp_path, data)
    with pytest.raises(ConfigError, match=match) as err:
        load_spec(path)
    assert len(str(err.value).splitlines()) == 1
    runs = tmp_path / "runs"
    assert main(["compare", str(path), "--runs", str(runs), "--out", str(tmp_path / "o")]) == 2
    _, errs = capsys.readouterr()
    assert len(errs.splitlines()) == 1 and errs.startswith("gspo compare: error: "), errs
    assert not runs.exists()


def test_unknown_arm_or_bad_seeds_on_the_command_line(tmp_path, capsys):
    assert main(["compare", str(SPEC), "--arms", "gspo,nope", "--runs", str(tmp_path)]) == 2
    assert "no arm 'nope'" in capsys.readouterr().err
    assert main(["compare", str(SPEC), "--seeds", "0,x", "--runs", str(tmp_path)]) == 2
    assert "--seeds" in capsys.readouterr().err
    assert main(["validate", str(SPEC)]) == 0


def test_expert_change_counts_replaced_experts():
    import torch

    old = [torch.tensor([[0, 1], [2, 3], [4, 5]])]
    new = [torch.tensor([[1, 0], [2, 7], [6, 7]])]  # same set; one replaced; both replaced
    assert torch.allclose(expert_change(old, new, torch.ones(3)), torch.tensor([0.5]))
    assert torch.allclose(expert_change(old, new, torch.tensor([1.0, 1.0, 0.0])),
                          torch.tensor([0.25]))


def _quick(tmp_path, *extra):
    runs, out = tmp_path / "runs", tmp_path / "out"
    code = main(["compare", str(SPEC), "--quick", "--runs", str(runs), "--out", str(out), *extra])
    assert code == 0
    return runs, out


@pytest.mark.slow
def test_quick_comparison_runs_every_arm_and_writes_table_and_plots(tmp_path, capsys):
    runs, out = _quick(tmp_path)
    spec = load_spec(SPEC, quick=True)
    table = (out / "results.md").read_text()
    for arm in spec.arms:
        assert arm.label in table
        for seed in spec.seeds:
            assert (runs / f"{arm.name}_s{seed}" / "compare.json").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["arms"]) == {a.name for a in spec.arms}
    stats = summary["arms"]["grpo_r2"]["stats"]
    assert stats["final_reward"]["n"] == 2 and stats["routing_change"]["n"] == 2
    assert set(summary["probe"]) >= {"token_change", "expert_change"}
    pngs = {p.name for p in out.glob("*.png")}
    assert pngs >= {"reward.png", "accuracy.png", "clipping.png", "routing.png", "seq_ratio.png"}
    for name in pngs:
        assert (out / name).read_bytes()[:8] == PNG
        assert f"]({name})" in table
    # a second call reuses every finished run
    capsys.readouterr()
    _quick(tmp_path)
    assert capsys.readouterr().out.count("reusing") == len(spec.arms) * len(spec.seeds)


def test_quick_comparison_of_one_arm_and_seed(tmp_path):
    runs, out = _quick(tmp_path, "--arms", "grpo_r2", "--seeds", "0")
    assert (out / "results.md").is_file() and (out / "reward.png").read_bytes()[:8] == PNG
    # the probe's lock file stays: deleting it could let a waiting process lock a new file
    assert sorted(p.name for p in runs.iterdir()) == ["grpo_r2_s0", "probe_s0", "probe_s0.lock"]
    # the same run folder with another config is not silently reused
    with pytest.raises(ConfigError, match="another config"):
        spec = load_spec(SPEC, quick=True, arms=["grpo_r2"], seeds=[0])
        run_compare(spec, runs, out, ["optim.lr=0.5"], log=lambda s: None)


def test_compare_default_folders_follow_the_file_name() -> None:
    """Each comparison file gets its own runs/ and results/ folder by default, so running
    dense/variants does not overwrite moe/compare's results."""
    from gspo.cli.compare import default_name

    assert default_name("moe/compare") == "moe_compare"
    assert default_name("configs/dense/variants.yaml") == "dense_variants"
    assert default_name("gspo/presets/async/compare.yaml") == "async_compare"
    assert default_name("mine.yaml") == "mine"


def test_a_subset_of_arms_or_seeds_does_not_overwrite_the_report_in_results() -> None:
    from gspo.cli.compare import default_folders

    assert default_folders("moe/compare", quick=False, subset=False) == (
        "runs/moe_compare", "results/moe_compare")
    assert default_folders("moe/compare", quick=True, subset=False) == (
        "runs/moe_compare_quick", "results/moe_compare_quick")
    assert default_folders("moe/compare", quick=False, subset=True) == (
        "runs/moe_compare", "runs/moe_compare/report")
    assert default_folders("moe/compare", quick=False, subset=True, runs="runs/a") == (
        "runs/a", "runs/a/report")
    assert default_folders("moe/compare", quick=False, subset=True, out="x") == (
        "runs/moe_compare", "x")


def test_reward_per_second_counts_scored_responses_over_step_time(tmp_path):
    from gspo.analysis.report import _reward_per_second

    (tmp_path / "config.yaml").write_text("rollout: {prompts_per_step: 2, group_size: 4}\n")
    rows = [{"reward/mean": 0.5, "time/rollout_s": 1.0, "time/update_s": 1.0,
             "time/rollout_engine_s": 5.0,  # the engine's overlapping time is not counted,
             "time/publish_send_s": 3.0},  # nor the weights' broadcast to an engine elsewhere
            {"reward/mean": 1.0, "dynamic/sampled_reward_mean": 0.25,
             "dynamic/groups_sampled": 4.0, "time/update_s": 2.0}]
    # (0.5 * 2 * 4 + 0.25 * 4 * 4) / (2 + 2)
    assert _reward_per_second(tmp_path, rows) == 2.0


def test_the_routing_probe_of_an_async_arm_samples_in_process(tmp_path):
    """The probe (one update from the initial policy) runs without the arm's engine process."""
    from gspo.analysis.compare import run_probe

    spec = load_spec("async/moe_compare", quick=True, arms=["gspo_k4"])
    res = run_probe(spec, 0, tmp_path, [], log=lambda s: None)
    assert 0.0 <= res["expert_change"] <= 1.0 and "token_change" in res
    assert (tmp_path / "probe_s0" / "compare.json").is_file()


def test_the_probe_of_an_arm_with_pipeline_only_options_is_a_valid_sync_config(tmp_path):
    """Options only the async pipeline uses (thread lending, engines per trainer, an engine
    address) leave the probe with it: its config is synchronous and valid (an arm with thread
    lending or two engines used to fail here with "used only with rollout.async_steps > 0")."""
    from gspo.analysis.compare import probe_config

    spec = load_spec("async/lend_check", quick=True)
    cfg = probe_config(spec, 0, tmp_path, ["rollout.async_engines=2"])
    r = cfg.rollout
    assert (r.async_steps, r.async_engines, r.async_address, r.async_lend_threads) == (
        0, 1, "", False)
    assert cfg.run_name == "probe_s0" and cfg.steps == 0


def test_subsets_of_arms_share_one_probe_per_seed(tmp_path):
    """`--arms` subsets run as separate processes into one runs folder: the probe runs with the
    file's first arm whichever subset runs it, so a later subset reuses it (it used to refuse it
    as "another config"), and a subset whose probe is in progress elsewhere waits on its lock."""
    import fcntl
    import threading

    from gspo.analysis.compare import run_probe

    first = load_spec(SPEC, quick=True).arms[0].name
    a, b = (load_spec(SPEC, quick=True, arms=[arm]) for arm in ("grpo", "grpo_r2"))
    assert a.probe_arm.name == b.probe_arm.name == first != "grpo"

    logs: list[str] = []
    with open(tmp_path / "probe_s0.lock", "w") as held:  # another process's probe in progress
        fcntl.flock(held, fcntl.LOCK_EX)
        worker = threading.Thread(target=lambda: logs.append(
            json.dumps(run_probe(a, 0, tmp_path, [], log=logs.append))))
        worker.start()
        worker.join(timeout=1.0)
        assert worker.is_alive() and not (tmp_path / "probe_s0").exists()
    worker.join()
    res_a = json.loads(logs[-1])
    assert any(x.startswith("probe seed 0:") for x in logs)
    saved = yaml.safe_load((tmp_path / "probe_s0" / "config.yaml").read_text())
    assert saved["run_name"] == "probe_s0" and 0.0 <= res_a["expert_change"] <= 1.0

    later: list[str] = []
    assert run_probe(b, 0, tmp_path, [], log=later.append) == res_a  # reused, not rerun
    assert later == []


def _learning(run: Path) -> list[dict]:
    """A run's metrics without its timings (which differ from run to run)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


def test_jobs_runs_side_by_side_as_one_at_a_time(tmp_path, capsys):
    """`--jobs 2` trains each run in its own process: the same metrics as one at a time (one
    thread each), each run's output in a log beside its folder, and the report over all."""
    arms = ["--arms", "grpo,grpo_r2", "--seeds", "0", "num_threads=1"]
    serial = tmp_path / "serial"
    assert main(["compare", str(SPEC), "--quick", "--runs", str(serial / "runs"), "--out",
                 str(serial / "out"), *arms]) == 0
    capsys.readouterr()
    runs, out = _quick(tmp_path, *arms, "--jobs", "2")
    printed = capsys.readouterr().out
    for name in ("grpo_s0", "grpo_r2_s0"):
        assert _learning(runs / name) == _learning(serial / "runs" / name)
        assert f"{name}: started (log {runs / name}.log)" in printed
        assert f"{name}: " in (runs / f"{name}.log").read_text()  # run_one's closing line
    assert "reusing" not in printed
    assert (out / "results.md").is_file()


def test_jobs_needs_num_threads_per_run(tmp_path):
    spec = load_spec(SPEC, quick=True, arms=["grpo"])
    with pytest.raises(ConfigError, match="num_threads"):
        run_compare(spec, tmp_path / "runs", tmp_path / "out", ["num_threads=0"], jobs=2,
                    log=lambda s: None)
    with pytest.raises(ConfigError, match="--jobs"):
        run_compare(spec, tmp_path / "runs", tmp_path / "out", jobs=0, log=lambda s: None)


def test_a_failed_run_of_jobs_is_named_with_its_log_and_the_others_finish(tmp_path, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "grpo_s0").write_text("in the way")  # the run cannot make its folder
    code = main(["compare", str(SPEC), "--quick", "--arms", "grpo,grpo_r2", "--seeds", "0",
                 "--runs", str(runs), "--out", str(tmp_path / "out"), "--jobs", "2",
                 "num_threads=1"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1
    assert f"1 of 2 runs failed: grpo_s0 (exit code 1; log {runs}/grpo_s0.log)" in err
    assert "Error" in (runs / "grpo_s0.log").read_text()  # the child's traceback
    assert (runs / "grpo_r2_s0" / "compare.json").is_file()
    assert not (tmp_path / "out").exists()


def test_reward_per_second_counts_nothing_for_a_step_without_a_scored_response(tmp_path):
    """Dynamic sampling logs ``dynamic/sampled_reward_mean`` as null on a step where no
    response could be scored (``reward.max_unscorable_frac=1``; its NaN mean): that step
    collected no reward but took its time (the report crashed with a TypeError on None)."""
    from gspo.analysis.report import _reward_per_second

    (tmp_path / "config.yaml").write_text("rollout: {prompts_per_step: 2, group_size: 4}\n")
    rows = [{"reward/mean": 1.0, "dynamic/sampled_reward_mean": 0.25,
             "dynamic/groups_sampled": 4.0, "time/update_s": 2.0},
            {"reward/mean": 0.0, "reward/unscorable_frac": 1.0,
             "dynamic/sampled_reward_mean": None, "dynamic/groups_sampled": 6.0,
             "time/update_s": 2.0}]
    assert _reward_per_second(tmp_path, rows) == 0.25 * 4 * 4 / 4
