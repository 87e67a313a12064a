"""The decode step's matrix products: ``F.linear`` (torch's BLAS, MKL on x86) against oneDNN
with weights packed once (``rollout.decode_matmul``), at SmolLM2's shapes, 1 and 2 threads.

Each shape runs with enough distinct weight copies (~200 MB) that the weights come from memory,
as in a decode step (a model's layers are read one after the other). GFLOP/s is the median of
``--reps`` calls. Also a memory-bandwidth row (a 512 MB sum), to tell a kernel limit from a
memory limit. Each thread count runs in its own child process.

Two more columns answer "would a kernel of our own do better?", and are not used by gspo:

- MKL's packed GEMM (``torch.ops.mkl._mkl_linear`` on ``_mkl_reorder_linear_weight``), the
  path inductor takes for frozen fp32 linears when torch has MKL;
- a probe: a small hand-written C kernel (:data:`PROBE_C`, built here with ``gcc -O3
  -march=native``; skipped without gcc) for exactly this case: 8 rows × 2 column blocks of
  the native vector width per pass (16 accumulators), each row's input broadcast from memory
  into a fused multiply-add, weights packed block-major so each block streams contiguously, and
  a software prefetch 32 rows of the block ahead. Threads split the column blocks (OpenMP).
  Where it beats the libraries by little, a kernel issue would gain little.

    python -m benchmarks.bench_decode_matmul [--tag T]  # ~1 min
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import child_main, report, thread_children

PROBE_C = r"""
#include <stddef.h>
#ifdef __AVX512F__
#define VW 16
#else
#define VW 8
#endif
typedef float vec __attribute__((vector_size(VW * 4)));
int width(void) { return VW; }
/* y[rows][n] = x[rows][k] . W^T for rows a multiple of 8; xt: x transposed [k][rows];
   p: W packed as [n / VW][k][VW] (n a multiple of 2 * VW) */
void gemm(const float* xt, const float* p, float* y, int rows, int k, int n, int threads) {
  int blocks = n / VW;
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int nb = 0; nb < blocks; nb += 2) {
    const float* pa = p + (size_t)nb * k * VW;
    const float* pb = pa + (size_t)k * VW;
    for (int h = 0; h < rows; h += 8) {
      vec a[8], b[8];
      for (int m = 0; m < 8; m++) { a[m] = (vec){0}; b[m] = (vec){0}; }
      for (int kk = 0; kk < k; kk++) {
        vec wa = *(const vec*)(pa + (size_t)kk * VW), wb = *(const vec*)(pb + (size_t)kk * VW);
        if (h == 0) {
          __builtin_prefetch(pa + (size_t)(kk + 32) * VW, 0, 3);
          __builtin_prefetch(pb + (size_t)(kk + 32) * VW, 0, 3);
        }
        const float* xr = xt + (size_t)kk * rows + h;
        #pragma GCC unroll 8
        for (int m = 0; m < 8; m++) { a[m] += xr[m] * wa; b[m] += xr[m] * wb; }
      }
      for (int m = 0; m < 8; m++) {
        float* yr = y + (size_t)(h + m) * n + (size_t)nb * VW;
        for (int j = 0; j < VW; j++) { yr[j] = a[m][j]; yr[VW + j] = b[m][j]; }
      }
    }
  }
}
"""


def _probe(workdir: str) -> Any:
    """The probe kernel built with gcc (OpenMP), or None where gcc is missing or fails."""
    import ctypes
    import shutil
    import subprocess

    if shutil.which("gcc") is None:
        return None
    src, lib = Path(workdir) / "probe.c", Path(workdir) / "probe.so"
    src.write_text(PROBE_C)
    built = subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
                            str(src), "-o", str(lib)], capture_output=True)
    return ctypes.CDLL(str(lib)) if built.returncode == 0 else None

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


def _probe_call(probe: Any, packed: Any, y: Any, threads: int) -> Any:
    """``x ↦ y = x Wᵀ`` through the probe kernel, ``W`` packed block-major [n / vw][k][vw]."""
    import ctypes

    blocks, k, vw = packed.shape
    out = ctypes.c_void_p(y.data_ptr())
    w = ctypes.c_void_p(packed.data_ptr())

    def call(x: Any) -> None:
        xt = x.t().contiguous()
        probe.gemm(ctypes.c_void_p(xt.data_ptr()), w, out, x.shape[0], k, blocks * vw, threads)
    return call


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import tempfile

    import torch
    import torch.nn.functional as F

    from gspo.models.decode import _Linear, onednn_available

    torch.set_num_threads(spec["threads"])
    workdir = tempfile.TemporaryDirectory()
    probe = _probe(workdir.name)
    vw = probe.width() if probe is not None else 0
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
        if torch._C.has_mkl and hasattr(torch.ops.mkl, "_mkl_linear"):
            mkl = [(torch.ops.mkl._mkl_reorder_linear_weight(w, m), w) for w in ws]
            row["mkl_packed"] = flop / median_s(_cycle(
                [lambda a, p=p, w=w, m=m: torch.ops.mkl._mkl_linear(a, p, w, None, m)
                 for p, w in mkl], x)) / 1e9
        if probe is not None and m % 8 == 0 and n % (2 * vw) == 0:
            # block-major [n / vw][k][vw]: each block of vw output columns contiguous
            pw = [w.view(n // vw, vw, k).transpose(1, 2).contiguous() for w in ws]
            y = torch.empty(m, n)
            calls = [_probe_call(probe, p, y, spec["threads"]) for p in pw]
            row["probe"] = flop / median_s(_cycle(calls, x)) / 1e9
            calls[0](x)
            row["probe_max_abs_diff"] = float((y - F.linear(x, ws[0])).abs().max())
        out["shapes"][f"{m}x{k}x{n}"] = row
    workdir.cleanup()
    out["probe_vector_width"] = vw
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a, res = thread_children("benchmarks.bench_decode_matmul", __doc__,
                             sys.argv[1:] if argv is None else argv, reps=20)
    header = ("| product (rows × in × out) | F.linear 1 thread | oneDNN packed 1 thread | "
              "F.linear 2 threads | oneDNN packed 2 threads | scaling F.linear / oneDNN | "
              "max abs diff | MKL packed 1 / 2 threads | probe kernel 1 / 2 threads | "
              "probe / oneDNN 1 / 2 threads | probe max abs diff |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    nan = float("nan")
    for shape in res[1]["shapes"]:
        r1, r2 = res[1]["shapes"][shape], res[2]["shapes"][shape]
        one = r1.get("onednn", nan)
        two = r2.get("onednn", nan)
        rows.append(f"| {shape} | {r1['blas']:.1f} | {one:.1f} | {r2['blas']:.1f} | {two:.1f} | "
                    f"{r2['blas'] / r1['blas']:.2f}× / {two / one:.2f}× | "
                    f"{r1.get('max_abs_diff', nan):.1e} | "
                    f"{r1.get('mkl_packed', nan):.1f} / {r2.get('mkl_packed', nan):.1f} | "
                    f"{r1.get('probe', nan):.1f} / {r2.get('probe', nan):.1f} | "
                    f"{r1.get('probe', nan) / one:.2f}× / {r2.get('probe', nan) / two:.2f}× | "
                    f"{r1.get('probe_max_abs_diff', nan):.1e} |")
    rows += ["", "GFLOP/s, median of the calls; weights read from memory (≥ 200 MB of copies "
             "per shape). Memory read bandwidth (a 512 MB sum): "
             f"{res[1]['read_gb_s']:.1f} GB/s at 1 thread, {res[2]['read_gb_s']:.1f} at 2. "
             f"Probe kernel vector width {res[1]['probe_vector_width']} floats (0: not built)."]
    report(a, "decode_matmul", res, header, rows)
    return res


if __name__ == "__main__":
    if not child_main(sys.argv[1:], run):
        main()
