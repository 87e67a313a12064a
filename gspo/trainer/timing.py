"""One timer for the step's phases: ``with timer("rollout"): ...`` adds to ``timer.seconds``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class PhaseTimer:
    """Wall seconds per named phase, in the order the phases first ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """``time/<phase>_s`` for every phase run."""
        return {f"time/{k}_s": v for k, v in self.seconds.items()}
