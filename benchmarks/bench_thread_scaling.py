"""Where the second core goes: the SmolLM2 step (``bench_vs_trl``'s work) profiled op by op at
1 and 2 torch threads (issue 17, item 4).

Each thread count runs in its own child process (alternating, ``--reps`` each); every child
runs ``--steps`` steps, the first ``--warmup`` uncounted, under ``torch.profiler`` (CPU
activities only). The table ranks the ops by the seconds they lose to imperfect scaling,
``t(2) − t(1) / 2`` (self CPU-side wall time of the op on the main thread, summed over the
counted steps), so the top rows are where the second core is lost. Phase times (rollout,
π_old pass, update) are taken from the trainer's own ``time/*`` metrics.

``--isolated`` adds a ceiling that no profiler distorts: one child records every matrix
product of one step (``aten::mm``/``addmm``/``bmm``/``linear`` and the decode's oneDNN
``mkldnn::_linear_pointwise``, with their shapes, strides and counts, through a
``TorchDispatchMode``), then times each distinct product alone at 1 and 2 threads
(alternating rounds) on operands of the same layout, hot (the same operands every call) and
cold (cycling through operand sets of 3× a 32 MiB L3). Their count-weighted sum is the step's
matrix work run back to back, so its scaling bounds what any scheduling of the step can reach
with these kernels; the rest of the step (wall time minus that sum) is reported beside it.
The same child then runs one more step at each thread count with every op timed where it
runs (wall time around each kernel call, no profiler), grouped into products, attention,
AdamW, every other op, and what lies outside any op (Python, the autograd engine, dispatch).

    HF_HUB_OFFLINE=1 python -m benchmarks.bench_thread_scaling           # ~6 min, 2 cores
    HF_HUB_OFFLINE=1 python -m benchmarks.bench_thread_scaling --isolated --reps 0  # ~4 min
    HF_HUB_OFFLINE=1 python -m benchmarks.bench_thread_scaling --model tiny:llama --steps 2 \\
        --reps 1 --out /tmp/x                                            # seconds
"""

from __future__ import annotations

import argparse
import itertools
import math
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


# aten::linear arrives whole under inference mode (no autograd key to decompose it at)
PRODUCT_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear",
               "mkldnn::_linear_pointwise")


def _products_mode() -> Any:
    """A ``TorchDispatchMode`` that counts the matrix products run under it, by signature
    (``.seen``), and times every op in place (``.op_s``: wall time around the kernel call)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: dict[str, dict[str, Any]] = {}
            self.op_s: dict[str, float] = {}  # in-situ wall time per op name

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            name = func._schema.name
            self.op_s[name] = self.op_s.get(name, 0.0) + time.perf_counter() - t0
            if name in PRODUCT_OPS:
                sig = _signature(name, args, out)
                entry = self.seen.setdefault(repr(sig), {"sig": sig, "count": 0})
                entry["count"] += 1
            return out

    return Mode()


def _signature(name: str, args: Any, out: Any) -> dict[str, Any]:
    """What it takes to rerun a product: its operands' sizes and strides (for the oneDNN
    linear: input, output width, and the weight's layout when it is a plain tensor; a packed
    weight's rows are unknown, so the input's row count is used)."""
    import torch

    if name == "mkldnn::_linear_pointwise":
        x, w = args[0], args[1]
        sig = {"op": name, "x": [list(x.shape), list(x.stride())], "n": int(out.shape[-1]),
               "bias": args[2] is not None}
        if not w.is_mkldnn:  # a plain weight (matmul=onednn's products), any strides
            sig["w"] = [list(w.shape), list(w.stride())]
        return sig
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return {"op": name, "operands": [[list(t.shape), list(t.stride())] for t in tensors],
            "scalars": [a for a in args if not isinstance(a, torch.Tensor)]}


def _runner(sig: dict[str, Any], copies: int = 1) -> tuple[Any, float]:
    """A closure that reruns the product of ``sig`` on random operands, and its FLOPs. With
    ``copies`` > 1 it cycles through that many operand sets, so that each call reads operands
    that other calls have pushed out of cache (the "cold" timing)."""
    import torch

    def make(shape: list[int], stride: list[int]) -> Any:  # any layout, expanded ones too
        size = 1 + sum((n - 1) * st for n, st in zip(shape, stride) if n > 0)
        return torch.randn(size).as_strided(shape, stride)

    if sig["op"] == "mkldnn::_linear_pointwise":
        (shape, stride), n = sig["x"], sig["n"]
        k = shape[-1]
        m = max(1, math.prod(shape) // k)
        weight = ((lambda: make(*sig["w"])) if "w" in sig else  # plain, or packed for m rows
                  (lambda: torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k), m)))
        sets = [(make(shape, stride), weight(), torch.randn(n) if sig["bias"] else None)
                for _ in range(copies)]
        call = lambda x, w, b: torch.ops.mkldnn._linear_pointwise(  # noqa: E731
            x, w, b, "none", [], "")
        flops = 2.0 * m * k * n
    else:
        sets = [tuple(make(sh, st) for sh, st in sig["operands"]) for _ in range(copies)]
        shapes = [sh for sh, _ in sig["operands"]]
        scalars = sig["scalars"]
        if sig["op"] == "aten::linear":
            (n, k), m = shapes[1], max(1, math.prod(shapes[0]) // shapes[0][-1])
            call = lambda x, w, *b: torch.nn.functional.linear(x, w, *b)  # noqa: E731
        elif sig["op"] == "aten::mm":
            (m, k), n = shapes[0], shapes[1][1]
            call = torch.mm
        elif sig["op"] == "aten::addmm":
            (m, k), n = shapes[1], shapes[2][1]
            kw = {"beta": scalars[0], "alpha": scalars[1]} if len(scalars) == 2 else {}
            call = lambda *ops: torch.addmm(*ops, **kw)  # noqa: E731
        else:  # bmm
            (b, m, k), n = shapes[0], shapes[1][2]
            m *= b
            call = torch.bmm
        flops = 2.0 * m * k * n
    operands = itertools.cycle(sets)
    return (lambda: call(*next(operands))), flops


def _operand_bytes(sig: dict[str, Any]) -> int:
    """Bytes one call of ``sig`` reads (fp32 operands; the oneDNN linear's weight included)."""
    if sig["op"] == "mkldnn::_linear_pointwise":
        (shape, _), n = sig["x"], sig["n"]
        return 4 * (math.prod(shape) + n * shape[-1])
    return 4 * sum(math.prod(shape) for shape, _ in sig["operands"])


def _time_calls(fn: Any) -> float:
    """Seconds per call of ``fn``: at least 3 calls and 50 ms, after one warm call."""
    fn()
    t0 = time.perf_counter()
    reps = 0
    while reps < 3 or time.perf_counter() - t0 < 0.05:
        fn()
        reps += 1
    return (time.perf_counter() - t0) / reps


COLD_BYTES = 96 << 20  # operand sets cycled per product in the cold timing: 3× this L3


def run_isolated(spec: dict[str, Any]) -> dict[str, Any]:
    """One child: the step unprofiled and under the op timer at 1 and 2 threads, then each of
    its recorded products alone (hot and cold) at 1 and 2 threads."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer({**spec, "arm": "gspo", "threads": 1}, Path(tmp))
        for _ in range(spec["warmup"]):  # the counted steps are steady-state ones
            trainer.train_step()
            trainer.step += 1
        walls: dict[int, list[float]] = {1: [], 2: []}
        for threads in abba([1, 2], 2):  # the step itself, unprofiled, in this process
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            trainer.train_step()
            walls[threads].append(time.perf_counter() - t0)
            trainer.step += 1
        modes: dict[int, Any] = {}
        in_situ: dict[int, float] = {}
        for threads in (1, 2):  # every op timed where it runs, at both thread counts
            torch.set_num_threads(threads)
            modes[threads] = _products_mode()
            t0 = time.perf_counter()
            with modes[threads]:
                trainer.train_step()
            in_situ[threads] = time.perf_counter() - t0
            trainer.step += 1
        trainer.cleanup()
    mode = modes[1]
    products = list(mode.seen.values())
    runners = [_runner(p["sig"]) for p in products]
    times: dict[int, list[list[float]]] = {1: [], 2: []}
    cold: dict[int, list[list[float]]] = {1: [], 2: []}
    for threads in abba([1, 2], spec["rounds"]):
        torch.set_num_threads(threads)
        times[threads].append([_time_calls(fn) for fn, _ in runners])
        per = []
        for p in products:  # cold: cycle through operand sets 3× the size of L3
            copies = max(1, min(256, -(-COLD_BYTES // max(1, _operand_bytes(p["sig"])))))
            per.append(_time_calls(_runner(p["sig"], copies)[0]))
        cold[threads].append(per)
    out = []
    for i, p in enumerate(products):
        t = {th: median([r[i] for r in times[th]]) for th in (1, 2)}
        c = {th: median([r[i] for r in cold[th]]) for th in (1, 2)}
        out.append({"sig": p["sig"], "count": p["count"], "flops": runners[i][1],
                    "t1_s": t[1], "t2_s": t[2], "cold_t1_s": c[1], "cold_t2_s": c[2]})
    return {"products": out, "wall_s": {str(t): median(walls[t]) for t in (1, 2)},
            "in_situ": {str(t): {"wall_s": in_situ[t], "op_s": modes[t].op_s} for t in (1, 2)}}


_GROUPS = (("matrix products", PRODUCT_OPS),
           ("attention (SDPA forward and backward)", (
               "aten::_scaled_dot_product_flash_attention_for_cpu",
               "aten::_scaled_dot_product_flash_attention_for_cpu_backward")),
           ("AdamW (fused)", ("aten::_fused_adamw_",)))


def _in_situ_lines(iso: dict[str, Any], top: int) -> list[str]:
    """Every op of one step timed where it ran, grouped; what no op accounts for is Python,
    the autograd engine and dispatch (this timer's own overhead included)."""
    ins = {t: iso["in_situ"][str(t)] for t in (1, 2)}
    ops = {t: ins[t]["op_s"] for t in (1, 2)}
    names = set(ops[1]) | set(ops[2])
    grouped = {n for _, members in _GROUPS for n in members}
    rows = [(label, [n for n in names if n in members]) for label, members in _GROUPS]
    rows.append(("every other op (elementwise, reductions, copies, indexing, ...)",
                 [n for n in names if n not in grouped]))
    lines = ["", "**Every op timed where it runs** (the same child: one more step at each thread "
             "count under a dispatch-mode timer; wall time around each kernel call):", "",
             "| | 1 thread s | 2 threads s | scaling |", "|---|---|---|---|",
             f"| the step under the timer | {ins[1]['wall_s']:.2f} | {ins[2]['wall_s']:.2f} | "
             f"{ins[1]['wall_s'] / ins[2]['wall_s']:.2f}× |"]
    total = {t: 0.0 for t in (1, 2)}
    for label, members in rows:
        t1, t2 = (sum(ops[t].get(n, 0.0) for n in members) for t in (1, 2))
        total[1], total[2] = total[1] + t1, total[2] + t2
        lines.append(f"| {label} | {t1:.2f} | {t2:.2f} | {t1 / t2:.2f}× |")
    o1, o2 = (ins[t]["wall_s"] - total[t] for t in (1, 2))
    lines.append(f"| outside any op (Python, autograd engine, dispatch, this timer) | {o1:.2f} | "
                 f"{o2:.2f} | {o1 / o2:.2f}× |")
    ranked = sorted(names, key=lambda n: -(ops[2].get(n, 0.0) - ops[1].get(n, 0.0) / 2))
    lines += ["", "Ops ranked by seconds lost in place, t(2) − t(1)/2:", "",
              "| op | 1 thread s | 2 threads s | scaling | lost s |", "|---|---|---|---|---|"]
    for n in ranked[:top]:
        t1, t2 = ops[1].get(n, 0.0), ops[2].get(n, 0.0)
        lines.append(f"| `{n}` | {t1:.3f} | {t2:.3f} | "
                     f"{t1 / t2 if t2 else float('nan'):.2f}× | {t2 - t1 / 2:.3f} |")
    return lines


def _isolated_lines(iso: dict[str, Any], top: int) -> list[str]:
    prods = iso["products"]
    tot = {th: sum(p["count"] * p[f"t{th}_s"] for p in prods) for th in (1, 2)}
    cold = {th: sum(p["count"] * p.get(f"cold_t{th}_s", float("nan")) for p in prods)
            for th in (1, 2)}
    flops = sum(p["count"] * p["flops"] for p in prods)
    wall = {th: iso["wall_s"][str(th)] for th in (1, 2)}
    rest = {th: wall[th] - tot[th] for th in (1, 2)}
    lines = ["", "**The step's matrix products alone** (`--isolated`: every product of one step "
             f"recorded, {len(prods)} distinct signatures, {sum(p['count'] for p in prods)} "
             f"calls, {flops / 1e9:.0f} GFLOP, each timed alone on operands of the same layout, "
             "hot (the same operands each call) and cold (cycling through operand sets 3× the "
             "L3 cache); the step timed unprofiled in the same process, 2 steps per thread "
             "count):",
             "", "| | 1 thread s | 2 threads s | scaling |", "|---|---|---|---|",
             f"| the step, unprofiled | {wall[1]:.2f} | {wall[2]:.2f} | "
             f"{wall[1] / wall[2]:.2f}× |",
             f"| its products, back to back | {tot[1]:.2f} | {tot[2]:.2f} | "
             f"**{tot[1] / tot[2]:.2f}×** |",
             f"| its products, back to back, cold operands | {cold[1]:.2f} | {cold[2]:.2f} | "
             f"{cold[1] / cold[2]:.2f}× |",
             f"| the rest (step − products) | {rest[1]:.2f} | {rest[2]:.2f} | "
             f"{rest[1] / rest[2]:.2f}× |",
             "", "Products ranked by seconds lost, count × (t(2) − t(1)/2):", "",
             "| product | calls | GFLOP/s 1 thread | GFLOP/s 2 threads | scaling | lost s |",
             "|---|---|---|---|---|---|"]
    ranked = sorted(prods, key=lambda p: -p["count"] * (p["t2_s"] - p["t1_s"] / 2))
    for p in ranked[:top]:
        sig = p["sig"]
        if sig["op"] == "mkldnn::_linear_pointwise":
            desc = f"oneDNN linear {sig['x'][0]} → {sig['n']}"
        elif sig["op"] == "aten::linear":
            desc = f"linear {sig['operands'][0][0]} → {sig['operands'][1][0][0]}"
        else:
            desc = sig["op"].split("::")[1] + " " + " × ".join(
                f"{s}{'ᵀ' if len(s) == 2 and st[0] == 1 and s[0] > 1 else ''}"
                for s, st in sig["operands"][-2:])
        lines.append(f"| {desc} | {p['count']} | {p['flops'] / p['t1_s'] / 1e9:.1f} | "
                     f"{p['flops'] / p['t2_s'] / 1e9:.1f} | {p['t1_s'] / p['t2_s']:.2f}× | "
                     f"{p['count'] * (p['t2_s'] - p['t1_s'] / 2):.3f} |")
    return lines


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
    p.add_argument("--isolated", action="store_true",
                   help="also time the step's matrix products alone (the kernel ceiling)")
    p.add_argument("--rounds", type=int, default=4, help="--isolated: rounds per thread count")
    a = p.parse_args(argv)
    spec = {k: getattr(a, k) for k in ("model", "prompts_per_step", "group_size",
                                       "max_new_tokens", "minibatches", "temperature", "lr",
                                       "steps", "warmup", "seed")}
    spec["overrides"] = a.overrides.split()
    lines = [f"Step: {a.prompts_per_step} prompts × {a.group_size} × {a.max_new_tokens} tokens, "
             f"{a.minibatches} minibatches, {a.model}."]
    out: dict[str, Any] = {"machine": machine(), "spec": spec}
    if a.reps > 0:
        out.update(_profiled(spec, a.reps, a.top, lines))
    if a.isolated:
        iso = run_child("benchmarks.bench_thread_scaling",
                        {**spec, "kind": "isolated", "rounds": a.rounds})
        out["isolated"] = iso
        lines += _isolated_lines(iso, a.top) + _in_situ_lines(iso, a.top)
    write_result(result_name("thread_scaling", a.model, a.tag), out, lines[0], lines[1:],
                 Path(a.out) if a.out else None)
    print("\n".join(lines))
    return out


def _profiled(spec: dict[str, Any], reps: int, top: int, lines: list[str]) -> dict[str, Any]:
    """The profiled children (``reps`` per thread count); appends their tables to ``lines``."""
    results: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    for threads in abba([1, 2], reps):
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
    lines += ["", f"Profiled: {reps} children per thread count, {spec['steps'] - spec['warmup']} "
              "profiled steps each (median over children).", "",
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
    for r in rows[:top]:
        lines.append(f"| `{r['op']}` | {r['t1_s']:.3f} | {r['t2_s']:.3f} | {r['scaling']:.2f}× "
                     f"| {r['lost_s']:.3f} |")
    return {"wall": wall, "phases": phases, "ops": rows}


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    return run_isolated(spec) if spec.get("kind") == "isolated" else run_profiled(spec)


if __name__ == "__main__":
    if not child_main(sys.argv[1:], _child):
        main()
