"""Two arms of a comparison, seed by seed: held-out accuracy at every evaluation and reward per
sampled response over step windows, as paired differences.

Run folders are named ``<arm>_s<seed>`` (as ``gspo compare`` names them, or copied into a
``run_metrics`` folder with ``metrics.jsonl.gz``). Only seeds that both arms ran are paired.
A paired difference is the mean over seeds of (A − B), ± its standard error (sample standard
deviation / √n), with the number of seeds on which A is higher and an exact two-sided sign-flip
(paired permutation) p-value: the share of the 2^n ways of flipping the signs of the n
differences whose mean is at least as far from 0 as the one observed. It assumes nothing about
the differences' distribution; with n seeds it cannot go below 2 / 2^n (0.25 at 3 seeds); above
20 seeds it is not computed (nan):

    python scripts/paired_by_seed.py results/moe_deep128_long/run_metrics gspo grpo \\
        --windows 1-100,101-200,201-300
    python scripts/paired_by_seed.py results/moe_upcycled_lr3e-5/run_metrics grpo_r2 grpo \\
        --windows 1-60 --change 1-10:51-60 --seeds 4,5,6 --plot paired.png

``--plot`` draws each measure as one panel: a line per seed from arm B's value to arm A's.
``--control RUNS`` sets each paired difference against the same arms' difference under another
folder (the same seeds in another setting): does the setting change the gap between the arms?
"""

from __future__ import annotations

import argparse
import itertools
import math
import runpy
import statistics
import sys
from pathlib import Path
from typing import Any, NamedTuple

read_metrics = runpy.run_path(str(Path(__file__).with_name("partial_compare_table.py")),
                              run_name="not_main")["read_metrics"]


def arm_seeds(root: Path, arm: str) -> dict[int, Path]:
    """seed -> folder ``<arm>_s<seed>`` under ``root``."""
    out = {}
    for d in root.iterdir():
        name, _, seed = d.name.rpartition("_s")
        if d.is_dir() and name == arm and seed.isdigit():
            out[int(seed)] = d
    return out


def arm_runs(root: Path, arm: str, only: set[int] | None = None
             ) -> dict[int, list[dict[str, Any]]]:
    """seed -> metrics rows of ``<arm>_s<seed>`` under ``root`` (only the seeds in ``only``)."""
    return {s: read_metrics(d) for s, d in arm_seeds(root, arm).items()
            if only is None or s in only}


def evals(rows: list[dict[str, Any]]) -> dict[int, float]:
    return {int(r["step"]): float(r["eval/accuracy"]) for r in rows if "eval/accuracy" in r}


def window_reward(rows: list[dict[str, Any]], lo: int, hi: int) -> float:
    """Mean reward per sampled response over steps ``lo``..``hi``: each step's
    ``dynamic/sampled_reward_mean`` where dynamic sampling logged it (``reward/mean`` is then
    over the groups kept, those with reward variance), else its ``reward/mean``."""
    vals = [r.get("dynamic/sampled_reward_mean", r["reward/mean"]) for r in rows
            if lo <= r["step"] <= hi and "reward/mean" in r]
    return statistics.mean(vals) if vals else float("nan")


def paired(a: list[float], b: list[float]) -> tuple[float, float, int, float]:
    """(mean of a − b, its standard error, how many a > b, sign-flip p-value)."""
    d = [x - y for x, y in zip(a, b)]
    se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
    p = sign_flip_p(d) if len(d) <= 20 else float("nan")  # 2^n patterns: exact up to 20
    return statistics.mean(d), se, sum(x > 0 for x in d), p


def sign_flip_p(d: list[float]) -> float:
    """Exact two-sided sign-flip p-value of the mean of the paired differences ``d``."""
    if len(d) > 20:
        raise ValueError(f"sign_flip_p enumerates 2^n sign patterns; {len(d)} pairs is too many")
    observed = abs(sum(d)) - 1e-12 * (1 + sum(abs(x) for x in d))  # ties count as extreme
    hits = sum(abs(sum(s * x for s, x in zip(signs, d))) >= observed
               for signs in itertools.product((1, -1), repeat=len(d)))
    return hits / 2 ** len(d)


class Quantity(NamedTuple):
    """One measure of every paired seed: ``a[i]`` and ``b[i]`` belong to ``seeds[i]``."""
    label: str
    kind: str  # "held-out" (a share), "reward" or "change" (reward differences)
    a: list[float]
    b: list[float]


def quantities(root: Path, a: str, b: str, windows: list[tuple[int, int]],
               change: tuple[tuple[int, int], tuple[int, int]] | None = None,
               only: set[int] | None = None) -> tuple[list[int], list[Quantity]]:
    """The seeds both arms ran (within ``only``) and each measure on them: held-out accuracy at
    every evaluation all of them share, reward per sampled response over each window, and with
    ``change`` the reward's change from the first window to the second."""
    ra, rb = arm_runs(root, a, only), arm_runs(root, b, only)
    seeds = sorted(set(ra) & set(rb))
    if not seeds:
        raise SystemExit(f"no seed that both {a} and {b} ran under {root}"
                         + (f" among --seeds {sorted(only)}" if only is not None else ""))
    need = max(hi for lo, hi in windows + list(change or ()))
    for arm, runs in ((a, ra), (b, rb)):
        for s in seeds:
            last = max((int(r["step"]) for r in runs[s] if "reward/mean" in r), default=0)
            if last < need:
                raise SystemExit(f"{arm}_s{s} under {root} has sampled reward up to step {last} "
                                 f"only; the windows need step {need} (an unfinished run? "
                                 f"leave its seed out with --seeds)")
    out = []
    ea, eb = ({s: evals(r[s]) for s in seeds} for r in (ra, rb))
    for step in sorted(set.intersection(*(set(ea[s]) & set(eb[s]) for s in seeds))):
        out.append(Quantity(f"held-out at step {step}", "held-out",
                            [ea[s][step] for s in seeds], [eb[s][step] for s in seeds]))
    for lo, hi in windows:
        out.append(Quantity(f"reward per sampled response, steps {lo}–{hi}", "reward",
                            [window_reward(ra[s], lo, hi) for s in seeds],
                            [window_reward(rb[s], lo, hi) for s in seeds]))
    if change:  # the run's trend: does it end above or below where it started?
        (l0, h0), (l1, h1) = change
        ca, cb = ([window_reward(r[s], l1, h1) - window_reward(r[s], l0, h0) for s in seeds]
                  for r in (ra, rb))
        out.append(Quantity(f"reward change, steps {l1}–{h1} minus {l0}–{h0}", "change", ca, cb))
    return seeds, out


def table(a: str, b: str, seeds: list[int], qs: list[Quantity],
          change: tuple[tuple[int, int], tuple[int, int]] | None = None) -> list[str]:
    """The Markdown table of :func:`quantities`, and with a change measure the seeds on which
    each arm ends lower than it starts."""
    lines = [f"Seeds paired: {', '.join(map(str, seeds))} ({len(seeds)}).", "",
             f"| quantity | {a} | {b} | {a} − {b} (± s.e.) | seeds {a} higher | p (sign flip) |",
             "|---|---|---|---|---|---|"]
    for q in qs:
        m, se, n, pv = paired(q.a, q.b)
        if q.kind == "held-out":
            cells = (f"{statistics.mean(q.a):.1%} | {statistics.mean(q.b):.1%} | "
                     f"{100 * m:+.1f} ± {100 * se:.1f} points")
        else:
            sign = "+" if q.kind == "change" else ""
            cells = (f"{statistics.mean(q.a):{sign}.3f} | {statistics.mean(q.b):{sign}.3f} | "
                     f"{m:+.3f} ± {se:.3f}")
        lines.append(f"| {q.label} | {cells} | {n} of {len(seeds)} | {pv:.2f} |")
    if change:  # quantities() puts the change last
        (l0, h0), (l1, h1) = change
        lines.append("")
        for arm, c in ((a, qs[-1].a), (b, qs[-1].b)):
            down = [s for s, x in zip(seeds, c) if x < 0]
            lines.append(f"{arm}: sampled reward in steps {l1}–{h1} below steps {l0}–{h0} on "
                         f"{len(down)} of {len(seeds)} seeds"
                         + (f" ({', '.join(map(str, down))})" if down else "") + ".")
    return lines


def versus_control(a: str, b: str, here: tuple[list[int], list[Quantity]],
                   control: tuple[list[int], list[Quantity]], name: str) -> list[str]:
    """Each measure's A − B here against A − B under a control folder (the same arms in another
    setting), seed by seed on the seeds and measures both have: the difference in differences.
    ``main`` has already refused a control with no seed in common."""
    (sh, qh), (sc, qc) = here, control
    seeds = [s for s in sh if s in sc]
    qc_by = {q.label: q for q in qc}
    lines = [f"A − B here minus A − B under {name}, seeds {', '.join(map(str, seeds))} "
             f"({len(seeds)}).", "",
             f"| quantity | {a} − {b} here | under {name} | difference (± s.e.) | "
             "seeds higher here | p (sign flip) |", "|---|---|---|---|---|---|"]
    for q in qh:
        c = qc_by.get(q.label)
        if c is None:
            continue
        dh = [q.a[sh.index(s)] - q.b[sh.index(s)] for s in seeds]
        dc = [c.a[sc.index(s)] - c.b[sc.index(s)] for s in seeds]
        m, se, n, pv = paired(dh, dc)
        k, u = (100, " points") if q.kind == "held-out" else (1, "")
        f = ".1f" if q.kind == "held-out" else ".3f"
        lines.append(f"| {q.label} | {k * statistics.mean(dh):+{f}} | "
                     f"{k * statistics.mean(dc):+{f}} | {k * m:+{f}} ± {k * se:{f}}{u} | "
                     f"{n} of {len(seeds)} | {pv:.2f} |")
    return lines


def plot(path: Path, a: str, b: str, seeds: list[int], qs: list[Quantity]) -> int:
    """One panel per measure: each seed a line from arm B's value to arm A's (rising where A is
    higher), labelled with its seed, and the mean of each arm in black. A measure equal in both
    arms on every seed (held-out before training) gets no panel. Returns the panel count."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    qs = [q for q in qs if q.a != q.b]
    if not qs:
        raise SystemExit("--plot: every measure is equal in both arms on every seed")
    fig = Figure(figsize=(3.2 * len(qs), 4.2), layout="constrained")
    for ax, q in zip(fig.subplots(1, len(qs), squeeze=False)[0], qs):
        for s, ya, yb in zip(seeds, q.a, q.b):
            ax.plot([0, 1], [yb, ya], "-o", ms=3, lw=1, alpha=0.8,
                    color="tab:blue" if ya > yb else "tab:red")
            ax.annotate(str(s), (1, ya), xytext=(4, 0), textcoords="offset points",
                        va="center", fontsize=7)
        ax.plot([0, 1], [statistics.mean(q.b), statistics.mean(q.a)], "-s", color="black", lw=2)
        if q.kind == "change":
            ax.axhline(0.0, color="grey", lw=0.8, ls="--")
        m, se, n, pv = paired(q.a, q.b)
        scale, unit = (100, " pts") if q.kind == "held-out" else (1, "")
        ax.set_title(f"{q.label}\n{a} − {b}: {scale * m:+.3g} ± {scale * se:.2g}{unit}\n"
                     f"{n} of {len(seeds)} higher, p {pv:.2f}", fontsize=8)
        ax.set_xticks([0, 1], [b, a], fontsize=8)
        ax.set_xlim(-0.3, 1.3)
        ax.tick_params(axis="y", labelsize=8)
    fig.suptitle(f"paired by seed ({len(seeds)} seeds: {', '.join(map(str, seeds))})",
                 fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return len(qs)


def _window(text: str, flag: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    if not (sep and lo.isdigit() and hi.isdigit() and int(lo) <= int(hi)):
        raise SystemExit(f"{flag}: expected LO-HI, got {text!r}")
    return int(lo), int(hi)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", help="folder holding <arm>_s<seed> run folders")
    p.add_argument("a", help="arm A")
    p.add_argument("b", help="arm B")
    p.add_argument("--windows", default="1-100",
                   help="step windows for the reward, e.g. 1-100,101-200 (default 1-100)")
    p.add_argument("--change", default=None, metavar="LO-HI:LO-HI",
                   help="also the change of the reward from the first window to the second, "
                        "e.g. 1-10:51-60, paired, and the seeds on which each arm ends lower")
    p.add_argument("--seeds", default=None,
                   help="pair only these seeds, e.g. 4,5,6 (default: every seed both ran)")
    p.add_argument("--control", default=None, metavar="RUNS",
                   help="also each measure's A − B against A − B of the same arms under this "
                        "folder (another setting of the same seeds), paired by seed")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="also draw every measure, seed by seed, into this PNG")
    args = p.parse_args(argv)
    windows = [_window(w, "--windows") for w in args.windows.split(",")]
    change = None
    if args.change is not None:
        first, sep, second = args.change.partition(":")
        if not sep:
            raise SystemExit(f"--change: expected LO-HI:LO-HI, got {args.change!r}")
        change = (_window(first, "--change"), _window(second, "--change"))
    only = None
    if args.seeds is not None:
        if not all(x.strip().isdigit() for x in args.seeds.split(",")):
            raise SystemExit(f"--seeds: expected seeds like 4,5,6, got {args.seeds!r}")
        only = {int(x) for x in args.seeds.split(",")}
    seeds, qs = quantities(Path(args.runs), args.a, args.b, windows, change, only)
    print("\n".join(table(args.a, args.b, seeds, qs, change)))
    if args.control is not None:
        ctl_root = Path(args.control)  # only the seeds paired above: others may be unfinished
        common = set(seeds) & set(arm_seeds(ctl_root, args.a)) & set(arm_seeds(ctl_root, args.b))
        if not common:
            raise SystemExit(f"--control {ctl_root}: no seed in common with the runs {seeds}")
        ctl = quantities(ctl_root, args.a, args.b, windows, change, common)
        print("\n" + "\n".join(versus_control(args.a, args.b, (seeds, qs), ctl, args.control)))
    if args.plot is not None:
        plot(Path(args.plot), args.a, args.b, seeds, qs)
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
