"""`gspo plot`: two fake runs -> one valid PNG per panel group that has data."""

from __future__ import annotations

import json

import pytest

from gspo.analysis.plot import plot_runs
from gspo.cli import main
from gspo.trainer.metrics import read_metrics

pytest.importorskip("matplotlib")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Five of the eight panel groups (each figure costs ~0.5 s of CPU): the reward group with a
# per-function panel, evaluation markers, the ratio band, an all-null metric, one a run lacks.
KEYS = ("reward/mean", "reward/unscorable_frac", "reward/numeric_match", "eval/accuracy",
        "objective/seq_ratio_min", "objective/seq_ratio_max", "objective/seq_ratio_mean",
        "objective/approx_kl", "moe/routing_change")


def fake_run(folder, shift: float, keys: tuple[str, ...] = ()) -> object:
    """metrics.jsonl with one metric per panel group (one subplot per figure keeps it fast)."""
    folder.mkdir(parents=True)
    rows: list[dict] = [{"step": 0, "eval/accuracy": 0.1 + shift}]
    for step in range(1, 9):
        row = {
            "step": step, "reward/mean": 0.1 * step + shift, "reward/unscorable_frac": 0.0,
            "reward/numeric_match": 0.1 * step, "objective/clip_frac_seqs": 0.01 * step,
            "objective/seq_ratio_min": 1 - 1e-4 * step, "objective/seq_ratio_max": 1 + 2e-4 * step,
            "objective/seq_ratio_mean": 1.0, "rollout/response_len_mean": 10 + step,
            "train/entropy": 1.5 - 0.1 * step, "moe/routing_change": 0.05,
            "objective/approx_kl": None,  # a non-finite value is logged as null
        }
        rows.append(row)
    rows.append({"step": 8, "eval/accuracy": 0.5 + shift})
    rows = [{k: v for k, v in r.items() if not keys or k in keys or k == "step"} for r in rows]
    rows = [r for r in rows if len(r) > 1]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "rew'  # torn last line
    (folder / "metrics.jsonl").write_text(text)
    return folder


def test_two_runs_give_valid_pngs(tmp_path):
    a = fake_run(tmp_path / "gspo", 0.0, keys=KEYS)
    b = fake_run(tmp_path / "grpo", 0.05, keys=KEYS[:-1])  # a dense run: no routing metric
    assert len(read_metrics(a)) == 10
    paths = plot_runs([a, b], tmp_path / "plots")
    assert [p.stem for p in paths] == ["reward", "eval", "seq_ratio", "divergence", "routing"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1024, p
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert width >= 400 and height >= 300, (p, width, height)


def test_cli_plot(tmp_path, capsys):
    run = fake_run(tmp_path / "only", 0.0, keys=("reward/mean", "train/entropy"))
    assert main(["plot", str(run)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed and all(p.startswith(str(run / "plots")) for p in printed)
    assert [p.rsplit("/", 1)[1] for p in printed] == ["reward.png", "entropy.png"]
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_volatility_panel_has_one_subplot_per_layer_in_layer_order(tmp_path):
    from gspo.analysis.plot import PANELS, _expand

    rows = [{"step": 1, "moe/expert_change_after_update": 0.1,
             **{f"moe/expert_change_layer{i}_after_update": 0.01 * i for i in (0, 2, 10)},
             "moe/expert_change_layer3": 0.5}]  # not an after-update key: not in this panel
    specs = dict((stem, panels) for stem, _, panels in PANELS)["routing_volatility"]
    keys = [k for k, _, _ in _expand(specs, {"run": rows})]
    assert keys == ["moe/expert_change_after_update", "moe/expert_change_layer0_after_update",
                    "moe/expert_change_layer2_after_update",
                    "moe/expert_change_layer10_after_update"]
    run = tmp_path / "moe"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert [p.stem for p in plot_runs([run], tmp_path / "plots")] == ["routing_volatility"]


def test_band_keeps_steps_when_seeds_sampled_different_counts(tmp_path) -> None:
    """With dynamic sampling the seeds draw different numbers of responses; the band still has
    a point at every step all seeds logged (x: their mean count), not only at step 0."""
    import json

    import yaml

    from gspo.analysis.report_plots import band

    runs = {}
    for seed, extra in ((0, 0), (1, 16)):
        d = tmp_path / f"s{seed}"
        d.mkdir()
        (d / "config.yaml").write_text(yaml.safe_dump(
            {"rollout": {"prompts_per_step": 2, "group_size": 8}}))
        rows = [{"step": 0, "eval/accuracy": 0.25}]
        rows += [{"step": s, "reward/mean": 0.5, "dynamic/responses_sampled": 16 + extra}
                 for s in (1, 2)]
        rows += [{"step": 2, "eval/accuracy": 0.5 + 0.25 * seed}]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs[seed] = d
    xs, mean, lo, hi = band(runs, "eval/accuracy", {})
    assert xs == [0.0, 48.0]  # (32 + 64) / 2 responses by step 2
    assert mean == [0.25, 0.625] and lo == [0.25, 0.5] and hi == [0.25, 0.75]


def test_runs_with_the_same_folder_name_get_labels_that_tell_them_apart(tmp_path):
    from gspo.analysis.plot import _run_labels
    from gspo.config import ConfigError

    a = fake_run(tmp_path / "x" / "runs" / "r", 0.0, keys=("reward/mean",))
    b = fake_run(tmp_path / "y" / "runs" / "r", 0.1, keys=("reward/mean",))
    assert _run_labels([a, b]) == ["x/runs/r", "y/runs/r"]  # "runs/r" twice dropped a run
    assert _run_labels([a, tmp_path / "z"]) == ["r", "z"]
    with pytest.raises(ConfigError, match="given twice"):
        _run_labels([a, tmp_path / "x" / "runs" / ".." / "runs" / "r"])


def test_a_figure_the_runs_have_no_data_for_is_not_left_from_an_earlier_call(tmp_path):
    moe = fake_run(tmp_path / "moe", 0.0, keys=("reward/mean", "moe/routing_change"))
    dense = fake_run(tmp_path / "dense", 0.0, keys=("reward/mean",))
    out = tmp_path / "plots"
    assert [p.name for p in plot_runs([moe], out)] == ["reward.png", "routing.png"]
    (out / "mine.png").write_bytes(b"not ours")
    assert [p.name for p in plot_runs([dense], out)] == ["reward.png"]
    assert sorted(p.name for p in out.iterdir()) == ["mine.png", "reward.png"]


def test_a_damaged_metrics_file_is_an_error_naming_the_line(tmp_path):
    from gspo.data import DataError

    run = tmp_path / "run"
    run.mkdir()
    rows = [json.dumps({"step": s, "reward/mean": 0.1}) for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("\n".join([rows[0], "garbage", rows[1], rows[2]]) + "\n")
    with pytest.raises(DataError, match="line 2 is not a metrics row"):
        read_metrics(run)  # it used to drop the line (and whatever step it held) silently
    (run / "metrics.jsonl").write_text("\n".join([*rows, '{"step": 4, "rew']))
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]  # a torn last line: a kill
    (run / "metrics.jsonl").write_bytes(b'{"step": 1}\n\xff\xfe\n')
    with pytest.raises(DataError, match="not UTF-8"):
        read_metrics(run)


def test_the_compare_reward_figure_draws_reward_per_sampled_response(tmp_path) -> None:
    """The report's reward figure is titled "Mean reward per sampled response": under dynamic
    sampling that is ``dynamic/sampled_reward_mean`` (also the dropped groups' responses), not
    ``reward/mean`` (only the groups kept, those with reward variance), which it used to draw."""
    import yaml

    from gspo.analysis.report_plots import FIGURES, band

    stem, _, panels = FIGURES[0]
    key, title = panels[0][:2]
    assert (stem, title) == ("reward", "Mean reward per sampled response")
    runs = {}
    for seed, sampled in ((0, 0.2), (1, 0.4)):
        d = tmp_path / f"s{seed}"
        d.mkdir()
        (d / "config.yaml").write_text(yaml.safe_dump(
            {"rollout": {"prompts_per_step": 2, "group_size": 8}}))
        rows = [{"step": 1, "reward/mean": 0.5, "dynamic/sampled_reward_mean": sampled,
                 "dynamic/responses_sampled": 32},
                {"step": 2, "reward/mean": 0.75}]  # every group kept: no dynamic/* logged
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs[seed] = d
    xs, mean, lo, hi = band(runs, key, {})
    assert xs == [32.0, 48.0]
    assert mean == pytest.approx([0.3, 0.75]) and lo == [0.2, 0.75] and hi == [0.4, 0.75]


def test_a_compare_figure_the_runs_have_no_data_for_is_not_left_from_an_earlier_report(
        tmp_path) -> None:
    """``gspo compare``'s report folder: a figure an earlier report drew (staleness, per-layer
    routing) that these runs have no data for is removed, not left beside results.md as if it
    were theirs; other files stay."""
    import yaml

    from gspo.analysis.report_plots import plot_compare

    def run(name: str, extra: dict) -> object:
        d = tmp_path / name
        d.mkdir()
        (d / "config.yaml").write_text(yaml.safe_dump(
            {"rollout": {"prompts_per_step": 2, "group_size": 4}}))
        rows = [{"step": s, "reward/mean": 0.5, **extra} for s in (1, 2)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return d

    summary = {"arms": {"a": {"label": "A"}}, "seeds": [0]}
    out = tmp_path / "report"
    out.mkdir()
    (out / "mine.png").write_bytes(b"not ours")
    moe_async = {"a": {0: run("async", {"async/staleness_mean": 1.0,
                                        "moe/routing_change_layer0": 0.1})}}
    drawn = plot_compare(summary, moe_async, out)
    assert sorted(p.name for p in drawn) == ["reward.png", "routing.png", "staleness.png"]
    drawn = plot_compare(summary, {"a": {0: run("sync", {})}}, out)
    assert [p.name for p in drawn] == ["reward.png"]
    assert sorted(p.name for p in out.iterdir()) == ["mine.png", "reward.png"]
