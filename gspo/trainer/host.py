"""Host (CPU) memory behaviour of the training process.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap``
and unmaps it on free, so each large tensor of a step (an embedding's dense gradient, weight
gradients, activations) page-faults all of its pages in again, step after step. On the SmolLM2
update phase that is ~15% of the time (``benchmarks/bench_vs_trl.py`` measures the trainer with
it on). :func:`keep_freed_memory` makes glibc serve large blocks from the heap and keep freed
ones for reuse: the process's RSS then stays near its peak instead of shrinking between steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Ask glibc to serve large allocations from the heap and never trim it; True if applied
    (Linux with glibc), False elsewhere (other platforms or C libraries: nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
