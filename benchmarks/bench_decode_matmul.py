"""The decode step's matrix products: ``F.linear`` (torch's BLAS, MKL on x86) against oneDNN
with weights packed once (``rollout.decode_matmul``), at SmolLM2's shapes, 1 and 2 threads.

Each shape runs with enough distinct weight copies (~200 MB) that the weights come from memory,
as in a decode step (a model's layers are read one after the other). GFLOP/s is the median of
``--reps`` calls. Also a memory-bandwidth row (a 512 MB sum), to tell a kernel limit from a
memory limit. Each thread count runs in its own child process.

    python -m benchmarks.bench_decode_matmul            # ~1 min
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import child_main, machine, run_child, write_result

# (rows, in, out): SmolLM2-135M's projections at a decode step of 16 rows, and the head at the
# update's 256-row chunk
SHAPES = [(16, 576, 49152), (16, 576, 1536), (16, 1536, 576), (16, 576, 576), (16, 576, 192),
          (256, 576, 49152)]


def _cycle(fns: list[Any], x: Any) -> Any:
    """A call that applies the next of ``fns`` to ``x`` (round robin over weight copies)."""
    i = [0]

    def call() -> None:
        i[0] = (i[0] + 1) % len(fns)
        fns[i[0]](x)
    return call


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from gspo.models.decode import _Linear, onednn_available

    torch.set_num_threads(spec["threads"])
    reps = spec["reps"]

    def median_s(f: Any) -> float:
        f()
        f()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2]

    x = torch.rand(128 * 1024 * 1024)  # 512 MB
    out: dict[str, Any] = {"threads": spec["threads"],
                           "read_gb_s": x.numel() * 4 / median_s(x.sum) / 1e9, "shapes": {}}
    del x
    for m, k, n in SHAPES:
        copies = max(1, int(200e6 / (k * n * 4)))
        ws = [torch.randn(n, k) * 0.02 for _ in range(copies)]
        x = torch.randn(m, k)
        flop = 2 * m * k * n
        row = {}
        row["blas"] = flop / median_s(_cycle([lambda a, w=w: F.linear(a, w) for w in ws], x)
                                      ) / 1e9
        if onednn_available():
            packed = [_Linear(w, None, m) for w in ws]
            row["onednn"] = flop / median_s(_cycle(packed, x)) / 1e9
            row["max_abs_diff"] = float((packed[0](x) - F.linear(x, ws[0])).abs().max())
        out["shapes"][f"{m}x{k}x{n}"] = row
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    res = {t: run_child("benchmarks.bench_decode_matmul", {"threads": t, "reps": a.reps})
           for t in (1, 2)}
    header = ("| product (rows × in × out) | F.linear 1 thread | oneDNN packed 1 thread | "
              "F.linear 2 threads | oneDNN packed 2 threads | scaling F.linear / oneDNN | "
              "max abs diff |\n|---|---|---|---|---|---|---|")
    rows = []
    for shape in res[1]["shapes"]:
        r1, r2 = res[1]["shapes"][shape], res[2]["shapes"][shape]
        one = r1.get("onednn", float("nan"))
        two = r2.get("onednn", float("nan"))
        rows.append(f"| {shape} | {r1['blas']:.1f} | {one:.1f} | {r2['blas']:.1f} | {two:.1f} | "
                    f"{r2['blas'] / r1['blas']:.2f}× / {two / one:.2f}× | "
                    f"{r1.get('max_abs_diff', float('nan')):.1e} |")
    rows += ["", "GFLOP/s, median of the calls; weights read from memory (≥ 200 MB of copies "
             "per shape). Memory read bandwidth (a 512 MB sum): "
             f"{res[1]['read_gb_s']:.1f} GB/s at 1 thread, {res[2]['read_gb_s']:.1f} at 2."]
    write_result("decode_matmul", {"machine": machine(), "results": res}, header, rows,
                 None if a.out is None else Path(a.out))
    print(header)
    print("\n".join(rows))
    return res


if __name__ == "__main__":
    if not child_main(sys.argv[1:], run):
        main()
