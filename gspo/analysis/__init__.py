"""Analysis of finished runs: ``gspo compare`` (run arms over seeds, report them) and plots.

    spec.py          the comparison file: arms, seeds, overrides (no model code)
    compare.py       run every (arm, seed) and the first-update routing probe
    report.py        per-arm statistics over seeds, the markdown report
    report_plots.py  the report's PNGs (mean over seeds, min..max band)
    plot.py          ``gspo plot``: one line per run, one figure per panel group

Nothing is imported here, so reading a comparison file (``gspo validate``) stays light.
"""
