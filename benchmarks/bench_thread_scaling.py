"""Where the second core goes: the SmolLM2 step (``bench_vs_trl``'s work) profiled op by op at
1 and 2 torch threads (issue 17, item 4).

Each thread count runs in its own child process (alternating, ``--reps`` each); every child
runs ``--steps`` steps, the first ``--warmup`` uncounted, under ``torch.profiler`` (CPU
activities only). The table ranks the ops by the seconds they lose to imperfect scaling,
``t(2) − t(1) / 2`` (self CPU-side wall time of the op on the main thread, summed over the
counted steps), so the top rows are where the second core is lost. Phase times (rollout,
π_old pass, update) are taken from the trainer's own ``time/*`` metrics.

    HF_HUB_OFFLINE=1 python -m benchmarks.bench_thread_scaling           # ~6 min, 2 cores
    HF_HUB_OFFLINE=1 python -m benchmarks.bench_thread_scaling --model tiny:llama --steps 2 \\
        --reps 1 --out /tmp/x                                            # seconds
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_vs_trl import add_step_arguments, build_trainer
from benchmarks.common import (
    abba,
    child_main,
    machine,
    median,
    result_name,
    run_child,
    write_result,
)

_BY_SHAPE = ("aten::mm", "aten::addmm", "aten::bmm")


def run_profiled(spec: dict[str, Any]) -> dict[str, Any]:
    """One child: ``steps`` gspo steps at ``threads`` torch threads; op totals and phase times."""
    from torch.profiler import ProfilerActivity, profile

    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer({**spec, "arm": "gspo"}, Path(tmp))
        ops: dict[str, float] = {}
        phases: dict[str, float] = {}
        wall = 0.0
        for k in range(spec["steps"]):
            counted = k >= spec["warmup"]
            if counted:
                with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                    t0 = time.perf_counter()
                    m = trainer.train_step()
                    wall += time.perf_counter() - t0
                for e in prof.key_averages(group_by_input_shape=True):
                    key = e.key
                    if key in _BY_SHAPE:  # the matmuls apart by shape: decode, head, layers
                        key = f"{key} {e.input_shapes}"
                    ops[key] = ops.get(key, 0.0) + e.self_cpu_time_total / 1e6
                for key, v in m.items():
                    if key.startswith("time/") and isinstance(v, (int, float)):
                        phases[key] = phases.get(key, 0.0) + float(v)
            else:
                trainer.train_step()
            trainer.step += 1
        trainer.cleanup()
    n = spec["steps"] - spec["warmup"]
    return {"threads": spec["threads"], "wall_s": wall / n,
            "ops": {k: v / n for k, v in ops.items()},
            "phases": {k: v / n for k, v in phases.items()}}


def _avg(children: list[dict[str, Any]], field: str) -> dict[str, float]:
    keys = {k for c in children for k in c[field]}
    return {k: median([c[field].get(k, 0.0) for c in children]) for k in keys}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_step_arguments(p)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=2, help="children per thread count (alternating)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=25, help="op rows in the table")
    p.add_argument("--overrides", default="", help="space-separated key=value for both arms")
    p.add_argument("--out", default=None)
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    spec = {k: getattr(a, k) for k in ("model", "prompts_per_step", "group_size",
                                       "max_new_tokens", "minibatches", "temperature", "lr",
                                       "steps", "warmup", "seed")}
    spec["overrides"] = a.overrides.split()
    results: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    for threads in abba([1, 2], a.reps):
        r = run_child("benchmarks.bench_thread_scaling", {**spec, "threads": threads})
        results[threads].append(r)
        print(f"threads={threads}: {r['wall_s']:.2f} s/step", flush=True)
    wall = {t: median([c["wall_s"] for c in results[t]]) for t in (1, 2)}
    ops = {t: _avg(results[t], "ops") for t in (1, 2)}
    phases = {t: _avg(results[t], "phases") for t in (1, 2)}
    rows = []
    for name in set(ops[1]) | set(ops[2]):
        t1, t2 = ops[1].get(name, 0.0), ops[2].get(name, 0.0)
        rows.append({"op": name, "t1_s": t1, "t2_s": t2, "lost_s": t2 - t1 / 2,
                     "scaling": t1 / t2 if t2 > 0 else float("nan")})
    rows.sort(key=lambda r: -r["lost_s"])
    lines = [f"Step: {a.prompts_per_step} prompts × {a.group_size} × {a.max_new_tokens} tokens, "
             f"{a.minibatches} minibatches, {a.model}, {a.reps} children per thread count, "
             f"{a.steps - a.warmup} profiled steps each (median over children).", "",
             f"Step wall time under the profiler: 1 thread {wall[1]:.2f} s, 2 threads "
             f"{wall[2]:.2f} s: **{wall[1] / wall[2]:.2f}×**.", "",
             "| phase | 1 thread s | 2 threads s | scaling |", "|---|---|---|---|"]
    for k in sorted(phases[1]):
        if phases[2].get(k):
            lines.append(f"| {k} | {phases[1][k]:.2f} | {phases[2][k]:.2f} | "
                         f"{phases[1][k] / phases[2][k]:.2f}× |")
    lost = sum(r["lost_s"] for r in rows)
    lines += ["", f"Ops ranked by seconds lost to imperfect scaling, t(2) − t(1)/2 (self time; "
              f"all ops together lose {lost:.2f} s a step):", "",
              "| op | 1 thread s | 2 threads s | scaling | lost s |", "|---|---|---|---|---|"]
    for r in rows[:a.top]:
        lines.append(f"| `{r['op']}` | {r['t1_s']:.3f} | {r['t2_s']:.3f} | {r['scaling']:.2f}× "
                     f"| {r['lost_s']:.3f} |")
    out = {"machine": machine(), "spec": spec, "wall": wall, "phases": phases, "ops": rows}
    write_result(result_name("thread_scaling", a.model, a.tag), out, lines[0], lines[1:],
                 Path(a.out) if a.out else None)
    print("\n".join(lines))
    return out


if __name__ == "__main__":
    if not child_main(sys.argv[1:], run_profiled):
        main()
