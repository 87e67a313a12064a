"""Write a ``gspo compare`` report from finished runs spread over several runs folders.

``gspo compare`` runs every (arm, seed) of a comparison file in one process. To use both cores
of a 2-core machine, the arms can run as two ``gspo compare --arms ... --runs DIR`` processes
side by side (one thread each); this script then reads both folders and writes the one report
(results.md, summary.json, PNGs) that ``gspo compare`` would have written:

    python scripts/compare_report.py mismatch/compare results/mismatch_compare \\
        runs/mismatch_gspo runs/mismatch_grpo --wall-min 44
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gspo.analysis.report import read_done, summarize, write_report
from gspo.analysis.spec import load_spec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec", help="comparison file or preset name")
    p.add_argument("out", help="folder for results.md, summary.json and the PNGs")
    p.add_argument("runs", nargs="+", help="runs folders holding the finished runs")
    p.add_argument("--wall-min", type=float, default=0.0,
                   help="wall time of the whole comparison, minutes (stated in the report)")
    p.add_argument("--partial", action="store_true",
                   help="report the finished runs even when some (arm, seed) has none; every "
                        "arm still needs one, and the missing runs are named in the report")
    p.add_argument("--probes", metavar="DIR",
                   help="folder holding the routing probes (probe_s<seed>/compare.json)")
    args = p.parse_args(argv)
    spec = load_spec(args.spec)
    runs: dict[str, dict[int, Path]] = {}
    for arm in spec.arms:
        for seed in spec.seeds:
            found = [Path(d) / f"{arm.name}_s{seed}" for d in args.runs
                     if read_done(Path(d) / f"{arm.name}_s{seed}") is not None]
            if found:
                runs.setdefault(arm.name, {})[seed] = found[0]
    missing = [f"{a.name}_s{s}" for a in spec.arms for s in spec.seeds
               if s not in runs.get(a.name, {})]
    if missing and not (args.partial and all(runs.get(a.name) for a in spec.arms)):
        print(f"compare_report: no finished run for {', '.join(missing)}", file=sys.stderr)
        return 2
    probes: dict[int, dict] = {}
    for seed in spec.seeds if args.probes else []:
        done = read_done(Path(args.probes) / f"probe_s{seed}")
        if done is not None:
            probes[seed] = done
    summary = summarize(spec, runs, probes)
    summary["total_wall_s"] = args.wall_min * 60
    summary["command"] = (f"gspo compare {args.spec}, run as {len(args.runs)} processes "
                          f"(--arms/--seeds subsets, at most one per core at a time), report "
                          f"by scripts/compare_report.py"
                          if len(args.runs) > 1 else
                          f"gspo compare {args.spec}, report rewritten by "
                          f"scripts/compare_report.py")
    if missing:
        summary["command"] += f"; runs missing (not finished): {', '.join(missing)}"
    write_report(summary, runs, Path(args.out))
    print(f"wrote {args.out}/results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
