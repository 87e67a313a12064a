"""scripts/paired_by_seed.py: two arms' evaluations and sampled reward, paired by seed."""

from __future__ import annotations

import gzip
import json
import math
import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "paired_by_seed.py"


def _run(folder: Path, acc: list[float], reward: float, late: float | None = None) -> None:
    """A run's metrics: evaluations every 10 steps; reward ``reward`` over steps 1–20, or
    ``late`` instead over steps 11–20."""
    folder.mkdir(parents=True)
    rows = [{"step": 10 * i, "eval/accuracy": a} for i, a in enumerate(acc)]
    rows += [{"step": s, "reward/mean": late if late is not None and s > 10 else reward}
             for s in range(1, 21)]
    (folder / "metrics.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))


def test_pairs_only_seeds_both_arms_ran(tmp_path, capsys):
    for seed, (a, b) in enumerate([(0.6, 0.5), (0.7, 0.4), (0.5, 0.6)]):
        _run(tmp_path / f"x_s{seed}", [0.5, 0.5, a], reward=0.4 + 0.1 * seed)
        _run(tmp_path / f"y_s{seed}", [0.5, 0.5, b], reward=0.4)
    _run(tmp_path / "x_s7", [0.5, 0.5, 0.9], reward=1.0)  # no partner: left out
    main = runpy.run_path(str(SCRIPT), run_name="not_main")["main"]
    main([str(tmp_path), "x", "y", "--windows", "1-10,11-20"])
    out = capsys.readouterr().out
    assert "Seeds paired: 0, 1, 2 (3)." in out
    row = next(x for x in out.splitlines() if x.startswith("| held-out at step 20 "))
    # differences +10, +30, −10 points: mean +10, s.d. 20, s.e. 20/√3 = 11.5; of the 8 sign
    # patterns, 6 give |sum| ≥ 30 (±50 and the four ±30s): p = 0.75
    assert "| 60.0% | 50.0% | +10.0 ± 11.5 points | 2 of 3 | 0.75 |" in row
    row = next(x for x in out.splitlines() if "steps 11–20" in x)
    # differences 0, 0.1, 0.2: |±0.1 ± 0.2| ≥ 0.3 for 4 of the 8 patterns
    assert "| 0.500 | 0.400 | +0.100 ± 0.058 | 2 of 3 | 0.50 |" in row
    main([str(tmp_path), "x", "y", "--windows", "1-20", "--change", "1-10:11-20",
          "--seeds", "1,2,7"])
    out = capsys.readouterr().out
    assert "Seeds paired: 1, 2 (2)." in out
    # every run's reward is flat, so each arm's change is 0 and ends lower on no seed
    row = next(x for x in out.splitlines() if x.startswith("| reward change"))
    assert "steps 11–20 minus 1–10 | +0.000 | +0.000 | +0.000 ± 0.000 | 0 of 2 | 1.00 |" in row
    assert "x: sampled reward in steps 11–20 below steps 1–10 on 0 of 2 seeds." in out
    with pytest.raises(SystemExit, match="--change"):
        main([str(tmp_path), "x", "y", "--change", "1-10"])
    with pytest.raises(SystemExit, match="among --seeds"):
        main([str(tmp_path), "x", "y", "--seeds", "9"])
    with pytest.raises(SystemExit, match="--windows"):
        main([str(tmp_path), "x", "y", "--windows", "20-10"])
    with pytest.raises(SystemExit, match="no seed that both x and z ran"):
        main([str(tmp_path), "x", "z"])
    # a window past a run's last step (an unfinished run) is an error naming the run
    with pytest.raises(SystemExit, match=r"x_s0 under .* up to step 20 only; the windows need "
                                         r"step 30"):
        main([str(tmp_path), "x", "y", "--windows", "1-30"])
    with pytest.raises(SystemExit, match="need step 40"):
        main([str(tmp_path), "x", "y", "--windows", "1-20", "--change", "1-10:31-40"])


def test_sign_flip_p_is_exact():
    sign_flip_p = runpy.run_path(str(SCRIPT), run_name="not_main")["sign_flip_p"]
    assert sign_flip_p([1.0] * 5) == 2 / 32  # all five one way: only all-plus and all-minus
    assert sign_flip_p([1.0, -1.0]) == 1.0
    assert sign_flip_p([0.3, 0.1, 0.2, 0.4]) == 2 / 16
    assert sign_flip_p([3.0, 1.0, 1.0, 1.0]) == 2 / 16  # no other pattern reaches |sum| 6
    # observed sum 2: every pattern but the C(4, 2) = 6 with sum 0 is as extreme
    assert sign_flip_p([1.0, 1.0, -1.0, 1.0]) == 10 / 16
    with pytest.raises(ValueError, match="too many"):
        sign_flip_p([1.0] * 21)
    paired = runpy.run_path(str(SCRIPT), run_name="not_main")["paired"]
    assert paired([1.0] * 21, [0.0] * 21)[:3] == (1.0, 0.0, 21)  # p left out (nan), no error
    assert math.isnan(paired([1.0] * 21, [0.0] * 21)[3])


def test_change_counts_the_runs_that_end_below_their_start(tmp_path, capsys):
    for seed, (early, late) in enumerate([(0.4, 0.2), (0.3, 0.1), (0.5, 0.6)]):
        _run(tmp_path / f"x_s{seed}", [0.5], reward=early, late=late)
        _run(tmp_path / f"y_s{seed}", [0.5], reward=early, late=early + 0.1)
    main = runpy.run_path(str(SCRIPT), run_name="not_main")["main"]
    main([str(tmp_path), "y", "x", "--windows", "1-20", "--change", "1-10:11-20"])
    out = capsys.readouterr().out
    row = next(x for x in out.splitlines() if x.startswith("| reward change"))
    # changes: y +0.1 each; x −0.2, −0.2, +0.1; y − x: +0.3, +0.3, 0.0 -> mean +0.2, s.e. 0.1
    assert "| +0.100 | -0.100 | +0.200 ± 0.100 | 2 of 3 | 0.50 |" in row
    assert "y: sampled reward in steps 11–20 below steps 1–10 on 0 of 3 seeds." in out
    assert "x: sampled reward in steps 11–20 below steps 1–10 on 2 of 3 seeds (0, 1)." in out


def test_plot_draws_one_panel_per_measure_that_differs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    for seed, (early, late) in enumerate([(0.4, 0.2), (0.3, 0.1)]):
        _run(tmp_path / f"x_s{seed}", [0.5, 0.6], reward=early, late=late)
        _run(tmp_path / f"y_s{seed}", [0.5, 0.4], reward=early, late=early)
    ns = runpy.run_path(str(SCRIPT), run_name="not_main")
    png = tmp_path / "out" / "paired.png"
    ns["main"]([str(tmp_path), "x", "y", "--windows", "1-20", "--change", "1-10:11-20",
                "--plot", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {png}" in capsys.readouterr().out
    seeds, qs = ns["quantities"](tmp_path, "x", "y", [(1, 20)], ((1, 10), (11, 20)))
    assert seeds == [0, 1]
    # held-out at steps 0 and 10, the window, the change; step 0 is equal in both arms
    assert [q.label for q in qs][:2] == ["held-out at step 0", "held-out at step 10"]
    assert ns["plot"](tmp_path / "p2.png", "x", "y", seeds, qs) == len(qs) - 1
    with pytest.raises(SystemExit, match="equal in both arms"):
        ns["plot"](tmp_path / "p3.png", "x", "y", seeds, qs[:1])


def test_control_sets_each_gap_against_the_same_arms_elsewhere(tmp_path, capsys):
    here, ctl = tmp_path / "here", tmp_path / "ctl"
    for seed, (gap_here, gap_ctl) in enumerate([(0.3, 0.1), (0.2, 0.2), (0.4, 0.0)]):
        _run(here / f"x_s{seed}", [0.5], reward=0.2 + gap_here)
        _run(here / f"y_s{seed}", [0.5], reward=0.2)
        _run(ctl / f"x_s{seed}", [0.5], reward=0.3 + gap_ctl)
        _run(ctl / f"y_s{seed}", [0.5], reward=0.3)
    _run(ctl / "x_s5", [0.5], reward=0.9)  # no seed 5 here: left out, though unfinished
    (ctl / "y_s5").mkdir()
    (ctl / "y_s5" / "metrics.jsonl.gz").write_bytes(
        gzip.compress(b'{"step": 1, "reward/mean": 0.1}\n'))
    main = runpy.run_path(str(SCRIPT), run_name="not_main")["main"]
    main([str(here), "x", "y", "--windows", "1-20", "--control", str(ctl)])
    out = capsys.readouterr().out
    assert f"A − B here minus A − B under {ctl}, seeds 0, 1, 2 (3)." in out
    control_table = out.split("A − B here minus")[1]
    row = next(x for x in control_table.splitlines() if x.startswith("| reward per sampled"))
    # gaps here 0.3, 0.2, 0.4 against 0.1, 0.2, 0.0: differences 0.2, 0, 0.4 -> mean 0.2,
    # s.d. 0.2, s.e. 0.115; 2 of 3 higher; |sum| ≥ 0.6 for 4 of the 8 sign patterns
    assert "steps 1–20 | +0.300 | +0.100 | +0.200 ± 0.115 | 2 of 3 | 0.50 |" in row
    (tmp_path / "other").mkdir()
    _run(tmp_path / "other" / "x_s9", [0.5], reward=0.5)
    _run(tmp_path / "other" / "y_s9", [0.5], reward=0.5)
    with pytest.raises(SystemExit, match=r"--control .*: no seed in common"):
        main([str(here), "x", "y", "--windows", "1-20", "--control", str(tmp_path / "other")])


def test_reward_windows_are_per_sampled_response_under_dynamic_sampling(tmp_path, capsys):
    """With dynamic sampling ``reward/mean`` is over the groups kept (those with reward
    variance); the windows are "reward per sampled response": ``dynamic/sampled_reward_mean``.
    Arm x samples dynamically (kept groups 0.5, every sampled response 0.1), arm y does not
    (0.3): the table used to say x is 0.2 above y."""
    for seed in range(2):
        for arm, row in (("x", {"reward/mean": 0.5, "dynamic/sampled_reward_mean": 0.1}),
                         ("y", {"reward/mean": 0.3})):
            folder = tmp_path / f"{arm}_s{seed}"
            folder.mkdir()
            (folder / "metrics.jsonl").write_text(
                "".join(json.dumps({"step": s, **row}) + "\n" for s in range(1, 11)))
    main = runpy.run_path(str(SCRIPT), run_name="not_main")["main"]
    main([str(tmp_path), "x", "y", "--windows", "1-10"])
    row = next(x for x in capsys.readouterr().out.splitlines() if "steps 1–10" in x)
    assert "| 0.100 | 0.300 | -0.200 ± 0.000 | 0 of 2 |" in row, row
