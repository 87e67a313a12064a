"""Interruption: the first SIGINT/SIGTERM finishes the step, a second abandons it."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any


class GracefulStop:
    """Within ``with``: the first SIGINT/SIGTERM sets ``requested`` (the signal's name); a
    second raises ``KeyboardInterrupt`` wherever the main thread is. Outside the main thread
    (where Python cannot install handlers) it does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested = name
            # os.write, not print: a handler may run in the middle of another print.
            os.write(2, f"\n{name}: finishing this step, then checkpointing "
                        f"(send it again to stop at once)\n".encode())
            return
        self._restore()  # a third signal gets the default behaviour
        raise KeyboardInterrupt(f"second {name}")

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __exit__(self, *exc: Any) -> None:
        self._restore()
