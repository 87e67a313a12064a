"""Compare two runs' metrics.jsonl step by step: which values are equal, and how far the rest are.

    python scripts/diff_runs.py runs/before runs/after [--key reward/mean]

Timing keys (time/*, perf/*) are skipped: they measure the machine, not the run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows(run: str) -> list[dict]:
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--key", default="reward/mean", help="a key printed for every step")
    a = p.parse_args()
    before, after = rows(a.before), rows(a.after)
    print(f"| step | {a.key} before | after | values equal "
          "| max relative difference (values > 1e-4) |")
    print("|---|---|---|---|---|")
    for x, y in zip(before, after):
        keys = [k for k in x if not k.startswith(("time/", "perf/")) and k != "step"]
        equal = sum(x[k] == y.get(k) for k in keys)
        # relative to the value, for values above 1e-4 (below, e.g. the ~1e-6 sampler-vs-trainer
        # log-prob gap, a relative difference is rounding noise of a noise floor)
        rel = max((abs(x[k] - y[k]) / abs(x[k]) for k in keys
                   if isinstance(x[k], float) and isinstance(y.get(k), float)
                   and abs(x[k]) > 1e-4), default=0.0)
        print(f"| {x['step']} | {x.get(a.key, '')} | {y.get(a.key, '')} | {equal}/{len(keys)} "
              f"| {rel:.1e} |")


if __name__ == "__main__":
    main()
