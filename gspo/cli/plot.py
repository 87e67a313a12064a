"""``gspo plot RUN_DIR [RUN_DIR ...] [--out DIR]``: argument parsing; the figures are drawn by
:func:`gspo.analysis.plot.plot_runs`."""

from __future__ import annotations

import argparse
from pathlib import Path

from gspo.analysis.plot import plot_runs


def cmd_plot(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gspo plot",
                                description="PNG figures comparing runs from their metrics.jsonl")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders to compare")
    p.add_argument("--out", default="", help="output folder (default: RUN_DIR/plots for one "
                   "run, ./plots for several)")
    ns = p.parse_args(argv)
    out = ns.out or (str(Path(ns.runs[0]) / "plots") if len(ns.runs) == 1 else "plots")
    paths = plot_runs(ns.runs, out)
    if not paths:
        print("nothing to plot: the runs logged no known metric")
        return 1
    for path in paths:
        print(path)
    return 0
