"""What ``reward.isolate=process`` costs per batch against ``thread`` (and no timeout at all).

One ``RewardScorer`` per mode scores the same batches with ``numeric_match``: ``inline``
(``reward.timeout_s=0``: the caller's thread), ``thread`` (the default: a thread per call, 60 s
timeout) and ``process`` (one long-lived child: pickling the batch both ways plus the socket
round trip; the parent polls every ``POLL_S`` only while it waits, so the answer is read as
soon as it arrives). Modes alternate batch by batch; the table gives wall-clock medians and
90th percentiles per batch, and the one-off cost of starting the child (its first batch).

    python -m benchmarks.bench_reward_isolation            # writes results/reward_isolation.*
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import fmt, machine, median, write_result
from gspo.rewards import RewardScorer

MODES = ("inline", "thread", "process")


def scorer(mode: str) -> RewardScorer:
    s = RewardScorer.from_specs(["numeric_match"])
    s.timeout_s = 0.0 if mode == "inline" else 60.0
    if mode == "process":
        s.isolate(["numeric_match"], memory_mb=4096)
    return s


def batch(n: int) -> tuple[list[str], list[str], dict[str, list]]:
    prompts = [f"What is {i}+{i + 7}? Answer with a number." for i in range(n)]
    completions = [f"The sum of {i} and {i + 7} is {2 * i + 7 + (i % 3 == 0)}." for i in range(n)]
    return prompts, completions, {"answer": [str(2 * i + 7) for i in range(n)]}


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1] if len(xs) >= 10 else max(xs)


def run(sizes: list[int], reps: int) -> dict[str, Any]:
    scorers = {m: scorer(m) for m in MODES}
    try:
        start = time.perf_counter()
        scorers["process"](*batch(4))  # the child starts on its first batch
        startup_s = time.perf_counter() - start
        rows: dict[str, dict[str, list[float]]] = {}
        for n in sizes:
            prompts, completions, columns = batch(n)
            times: dict[str, list[float]] = {m: [] for m in MODES}
            expected = scorers["inline"](prompts, completions, columns)[0]
            for r in range(reps):
                for m in MODES if r % 2 == 0 else MODES[::-1]:
                    t0 = time.perf_counter()
                    total, _ = scorers[m](prompts, completions, columns)
                    times[m].append(time.perf_counter() - t0)
                    assert total == expected, m  # the same scores in every mode
            rows[str(n)] = times
    finally:
        for s in scorers.values():
            s.close()
    return {"startup_s": startup_s, "times_s": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="16,64,256", help="responses per batch")
    p.add_argument("--reps", type=int, default=200, help="batches per mode and size")
    p.add_argument("--out", default="", help="results folder (default: benchmarks/results)")
    ns = p.parse_args(argv)
    sizes = [int(x) for x in ns.sizes.split(",")]
    data = {"settings": vars(ns), "machine": machine(), **run(sizes, ns.reps)}
    summary = {}
    md = ["| responses per batch | inline median (ms) | thread median / p90 (ms) | "
          "process median / p90 (ms) | process − thread (ms) |", "|---|---|---|---|---|"]
    for n, times in data["times_s"].items():
        med = {m: median(times[m]) * 1e3 for m in MODES}
        q = {m: p90(times[m]) * 1e3 for m in MODES}
        summary[n] = {"median_ms": med, "p90_ms": q,
                      "process_minus_thread_ms": med["process"] - med["thread"]}
        md.append(f"| {n} | {fmt(med['inline'], 3)} | {fmt(med['thread'], 3)} / "
                  f"{fmt(q['thread'], 3)} | {fmt(med['process'], 3)} / {fmt(q['process'], 3)} "
                  f"| {fmt(med['process'] - med['thread'], 3)} |")
    md.append("")
    md.append(f"Starting the child (its first batch): {data['startup_s'] * 1e3:.0f} ms, once "
              "per reward function per run (and again after a kill).")
    data["summary"] = summary
    header = (f"# reward.isolate: cost per batch (numeric_match, {ns.reps} batches per mode "
              f"and size, modes interleaved)\n\n`python -m benchmarks.bench_reward_isolation "
              f"{' '.join(argv if argv is not None else sys.argv[1:])}`\n")
    path = write_result("reward_isolation", data, header, md, Path(ns.out) if ns.out else None)
    print(path.with_suffix(".md").read_text())
    return data


if __name__ == "__main__":
    main()
