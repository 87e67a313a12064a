"""fp32 matrix products through oneDNN on the CPU, for the trainer's log-prob passes.

PyTorch multiplies fp32 matrices on x86 CPUs through its BLAS, Intel's MKL (``F.linear``,
``torch.mm``). On AMD CPUs MKL runs its AVX2 kernels even where the core has AVX-512: on the
Zen 5 host of 2026-12-06 a [338, 576] × [576, 1536] product ran at 121 GFLOP/s on one thread
and 234 on two through MKL, and at 265 and 521 through oneDNN, which PyTorch also bundles and
which picks its kernels by the CPU's features, not its vendor (``python -m
benchmarks.bench_matmul --tag zen5``). :func:`linear` is ``F.linear`` through oneDNN
(``torch.ops.mkldnn._linear_pointwise``, the op inductor emits for CPU linears; the decode
steps' packed products are the same op, :mod:`gspo.models.decode`), with a backward of two
more oneDNN products: ∂x = g W, ∂W = gᵀ x. Values equal ``F.linear``'s to fp32 rounding
(tests/models/test_onednn.py). :func:`pays` is where ``matmul=auto`` uses it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F


def mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x Wᵀ + b`` for a 2-D ``x`` [M, K] and ``weight`` [N, K] (any strides), by oneDNN."""
    if x.shape[0] == 0:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return mm(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1],
                                                                    weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        need_x, need_w, need_b = ctx.needs_input_grad
        gx = mm(g, weight.t(), None).view(x.shape) if need_x else None
        gw = mm(g.t(), x.reshape(-1, x.shape[-1]).t(), None) if need_w else None
        gb = g.sum(0) if need_b and ctx.has_bias else None
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (fp32, CPU) with its products through oneDNN, forward and
    backward."""
    return _Linear.apply(x, weight, bias)


@functools.cache
def _cpu() -> tuple[str, frozenset[str]]:
    """This CPU's vendor and feature flags (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines()
                        if ":" in line)
    except OSError:
        return "", frozenset()
    info = {k.strip(): v.strip() for k, v in info.items()}
    return info.get("vendor_id", ""), frozenset(info.get("flags", "").split())


def pays(model: Any) -> str | None:
    """Why ``matmul=auto`` keeps ``F.linear`` (BLAS) for ``model``'s log-prob passes; None
    when it uses :func:`linear`: an fp32 model on an AMD CPU with AVX-512 (MKL's AVX2 kernels
    there run at about half the rate of oneDNN's, measured on Zen 5), whose layers are large
    enough (above :data:`gspo.models.decode.FUSE_MAX_BYTES`, as the decode's packing; the
    tiny test presets keep BLAS). Elsewhere (Intel CPUs, where MKL uses AVX-512 itself; AMD
    without AVX-512) it was not measured to pay, so ``auto`` keeps BLAS."""
    from gspo.models.decode import packable, packing_pays
    from gspo.models.lean_forward import lean_unsupported

    if (why := lean_unsupported(model)) is not None:  # e.g. a PEFT wrapper
        return f"the lean passes do not take this model: {why}"
    if (why := packable(model)) is not None:
        return why
    vendor, flags = _cpu()
    if vendor != "AuthenticAMD" or "avx512f" not in flags:
        return f"the CPU is {vendor or 'unknown'}{'' if 'avx512f' in flags else ' without AVX-512'}"
    if not packing_pays(model):
        return "the model's layers are too small for oneDNN's per-call cost to pay"
    return None
