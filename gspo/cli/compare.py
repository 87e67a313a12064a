"""``gspo compare [FILE.yaml] [key=value ...] [--quick] [--arms A,B] [--seeds 0,1] [--jobs N]``:
argument parsing; the comparison itself is :func:`gspo.analysis.compare.run_compare`."""

from __future__ import annotations

import argparse
from pathlib import Path

from gspo.analysis.compare import run_compare
from gspo.analysis.spec import check_not_fixed, load_spec
from gspo.config import ConfigError


def default_name(spec: str) -> str:
    """The runs/ and results/ folder name of a comparison file: its folder and stem
    (``configs/dense/variants.yaml`` and the preset ``dense/variants`` -> ``dense_variants``)."""
    path = Path(spec)
    stem = path.name.removesuffix(".yaml").removesuffix(".yml")
    return f"{path.parent.name}_{stem}" if path.parent.name else stem


def default_folders(spec: str, *, quick: bool, subset: bool, runs: str = "",
                    out: str = "") -> tuple[str, str]:
    """The runs folder and the report folder when ``--runs`` / ``--out`` are not given:
    ``runs/<name>[_quick]`` and ``results/<name>[_quick]``. A subset of the arms or seeds
    (``--arms`` / ``--seeds``) reports into ``<runs>/report`` instead: its partial table must
    not overwrite the whole comparison's report in results/ (several subsets side by side are
    merged by ``scripts/compare_report.py``)."""
    name = default_name(spec) + ("_quick" if quick else "")
    runs = runs or f"runs/{name}"
    return runs, out or (f"{runs}/report" if subset else f"results/{name}")


def cmd_compare(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="gspo compare", description="run the arms of a comparison file on the same seeds "
        "and write a results table (results.md) and PNG plots")
    p.add_argument("spec", nargs="?", default="moe/compare",
                   help="comparison file or preset name (default: the preset moe/compare)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="applied to every arm")
    p.add_argument("--quick", action="store_true", help="the file's quick setting (seconds)")
    p.add_argument("--arms", default="", help="comma-separated subset of arms")
    p.add_argument("--seeds", default="", help="comma-separated seeds (replaces the file's)")
    p.add_argument("--runs", default="", help="run folders (default: runs/<name>[_quick], "
                   "<name> from the file's folder and stem: moe/compare -> moe_compare)")
    p.add_argument("--out", default="", help="table and plots (default: results/<name>[_quick]; "
                   "with --arms or --seeds: <runs>/report)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time, each in its own "
                   "process (default 1); every arm must set num_threads, e.g. --jobs 2 "
                   "num_threads=1 on 2 cores")
    ns = p.parse_intermixed_args(argv)
    if "=" in ns.spec:  # only overrides were given
        ns.overrides, ns.spec = [ns.spec, *ns.overrides], p.get_default("spec")
    for item in ns.overrides:
        if "=" not in item:
            raise ConfigError(f"expected key=value after the comparison file, got '{item}'")
    check_not_fixed(ns.overrides, "command line")
    try:
        seeds = [int(s) for s in ns.seeds.split(",")] if ns.seeds else None
    except ValueError:
        raise ConfigError(f"--seeds: expected comma-separated integers, got '{ns.seeds}'") from None
    arms = [a for a in ns.arms.split(",") if a] or None
    spec = load_spec(ns.spec, quick=ns.quick, arms=arms, seeds=seeds)
    runs, out = default_folders(ns.spec, quick=ns.quick, subset=bool(arms or seeds),
                                runs=ns.runs, out=ns.out)
    command = " ".join(["gspo compare", *argv])
    summary = run_compare(spec, runs, out, ns.overrides, command=command, jobs=ns.jobs)
    print(f"results: {out}/results.md ({len(spec.arms)} arms x {len(spec.seeds)} seeds, "
          f"{summary['total_wall_s'] / 60:.1f} min)")
    return 0
