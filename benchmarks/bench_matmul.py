"""The training passes' fp32 products: torch's BLAS (``F.linear`` / ``torch.mm``, MKL on x86)
against oneDNN (:func:`gspo.models.onednn.linear`, ``matmul=onednn``), at SmolLM2's shapes of a
minibatch (338 token rows), 1 and 2 threads.

Each product of a layer comes three ways, as a training step runs it: forward ``x Wᵀ``,
∂x ``g W`` and ∂W ``gᵀ x`` (the operands as autograd hands them over, transposed views
included), plus the output layer (256 rows × 49,152). GFLOP/s is the median of ``--reps``
calls; the two libraries alternate, shape by shape. Each thread count runs in its own child
process. ``max abs diff``: oneDNN against BLAS on N(0, 1) operands (entries of size ~√k).

    python -m benchmarks.bench_matmul [--tag T]  # ~1 min
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks.common import child_main, median_time, report, thread_children

# (rows, in, out): SmolLM2's q/o, k/v, gate/up, down projections at a minibatch's token rows;
# the output layer at a head chunk
SHAPES = [(338, 576, 576), (338, 576, 192), (338, 576, 1536), (338, 1536, 576),
          (256, 576, 49152)]
KINDS = ("forward", "grad_x", "grad_w")


def _products(x: Any, w: Any, g: Any) -> dict[str, tuple[Any, Any]]:
    """kind -> (BLAS call, oneDNN call) of the same product."""
    from gspo.models.onednn import mm

    return {"forward": (lambda: x @ w.t(), lambda: mm(x, w, None)),
            "grad_x": (lambda: g @ w, lambda: mm(g, w.t(), None)),
            "grad_w": (lambda: g.t() @ x, lambda: mm(g.t(), x.t(), None))}


def _gflops(f: Any, flop: int, reps: int) -> float:
    inner = max(1, int(0.5e9 / flop))

    def loop() -> None:
        for _ in range(inner):
            f()

    return flop * inner / median_time(loop, reps) / 1e9


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    out: dict[str, Any] = {"threads": spec["threads"], "shapes": {}}
    for m, k, n in spec.get("shapes", SHAPES):
        flop = 2 * m * k * n
        row: dict[str, float] = {}
        calls = _products(torch.randn(m, k), torch.randn(n, k), torch.randn(m, n))
        for kind, (blas, dnn) in calls.items():
            row[f"{kind}_blas"] = _gflops(blas, flop, spec["reps"])
            row[f"{kind}_onednn"] = _gflops(dnn, flop, spec["reps"])
            row[f"{kind}_max_abs_diff"] = float((dnn() - blas()).abs().max())
        out["shapes"][f"{m}x{k}x{n}"] = row
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a, res = thread_children("benchmarks.bench_matmul", __doc__,
                             sys.argv[1:] if argv is None else argv, reps=7)
    header = ("| product (rows × in × out) | kind | BLAS 1 thread | oneDNN 1 thread | "
              "oneDNN / BLAS | BLAS 2 threads | oneDNN 2 threads | oneDNN / BLAS | "
              "max abs diff |\n|---|---|---|---|---|---|---|---|---|")
    rows = []
    for shape in res[1]["shapes"]:
        r1, r2 = res[1]["shapes"][shape], res[2]["shapes"][shape]
        for kind in KINDS:
            b1, d1, b2, d2 = (r[f"{kind}_{lib}"] for r in (r1, r2) for lib in ("blas", "onednn"))
            rows.append(f"| {shape} | {kind} | {b1:.0f} | {d1:.0f} | {d1 / b1:.2f}× | {b2:.0f} | "
                        f"{d2:.0f} | {d2 / b2:.2f}× | {r1[f'{kind}_max_abs_diff']:.1e} |")
    rows += ["", "GFLOP/s, median of the timed calls (each ~0.5 GFLOP of repeated products on "
             "the same operands)."]
    report(a, "matmul", res, header, rows)
    return res


if __name__ == "__main__":
    if not child_main(sys.argv[1:], run):
        main()
