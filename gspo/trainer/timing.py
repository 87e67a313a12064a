"""One timer for the step's phases: ``with timer("rollout"): ...`` adds to ``timer.seconds``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch


class PhaseTimer:
    """Wall seconds per named phase, in the order the phases first ran. On a GPU ``device``
    each phase starts and ends with a synchronize, so queued kernels are charged to the phase
    that launched them (on the CPU nothing is queued)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self._sync = (torch.cuda.synchronize if device is not None and device.type == "cuda"
                      else None)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self._sync is not None:
            self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """``time/<phase>_s`` for every phase run."""
        return {f"time/{k}_s": v for k, v in self.seconds.items()}


def gpu_memory_metrics(device: torch.device) -> dict[str, float]:
    """``perf/gpu_peak_memory_gib``: the most memory torch's allocator has held on a GPU
    ``device`` since the process started (nothing on the CPU)."""
    if device.type != "cuda":
        return {}
    return {"perf/gpu_peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30}
