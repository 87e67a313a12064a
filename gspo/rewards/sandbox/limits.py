"""The limits of one run: checked once in the parent, then handed to the child as rlimits."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

_FSIZE_BYTES = 16 << 20  # RLIMIT_FSIZE: largest file the program may write
_DISK_BYTES = 64 << 20  # size of the private tmpfs work dir, when mount namespaces work
_NOFILE = 64


@dataclass(frozen=True)
class _Limits:
    wall_timeout_s: float
    cpu_s: int
    memory_mb: int
    max_procs: int
    max_output_bytes: int


def _make_limits(*, wall_timeout_s: float = 5.0, cpu_s: int = 4, memory_mb: int = 512,
                 max_procs: int = 16, max_output_bytes: int = 64_000) -> _Limits:
    if not (isinstance(wall_timeout_s, (int, float)) and 0 < wall_timeout_s < math.inf):
        raise ValueError("wall_timeout_s must be a positive number")
    for name, value in (("cpu_s", cpu_s), ("memory_mb", memory_mb), ("max_procs", max_procs),
                        ("max_output_bytes", max_output_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer")
    if memory_mb < 64:
        raise ValueError("memory_mb below 64 cannot start an interpreter")
    return _Limits(float(wall_timeout_s), cpu_s, memory_mb, max_procs, max_output_bytes)



def _child_limits(limits: _Limits) -> dict[str, Any]:
    """The ``limits`` entry of the child's payload (wall time and output stay with the parent)."""
    return {"cpu_s": limits.cpu_s, "memory": limits.memory_mb << 20,
            "max_procs": limits.max_procs, "fsize": _FSIZE_BYTES,
            "nofile": _NOFILE, "disk_kb": _DISK_BYTES >> 10}
