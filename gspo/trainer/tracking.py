"""Optional experiment trackers (Weights & Biases, trackio) next to ``metrics.jsonl``.

Used only when asked for (``logging.wandb_project`` / ``logging.trackio_project``) and when
the package imports; neither is a dependency. A tracker that fails to start prints one line
and the run goes on with ``metrics.jsonl`` (and TensorBoard).
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any


class Tracker:
    """One started tracker run: ``log(step, metrics)`` and ``close()``."""

    def __init__(self, name: str, module: Any, run: Any) -> None:
        self.name, self.module, self.run = name, module, run

    def log(self, step: int, metrics: dict[str, float]) -> None:
        target = self.run if self.run is not None and hasattr(self.run, "log") else self.module
        target.log(metrics, step=step)

    def close(self) -> None:
        target = self.run if self.run is not None and hasattr(self.run, "finish") else self.module
        target.finish()


def start_trackers(logging_cfg: Any, run_dir: Path, config: dict[str, Any]) -> list[Tracker]:
    """Start the trackers named in :class:`gspo.config.LoggingConfig`."""
    wanted = [("wandb", logging_cfg.wandb_project), ("trackio", logging_cfg.trackio_project)]
    out = []
    for name, project in wanted:
        if not project:
            continue
        try:
            module = importlib.import_module(name)
        except ImportError:
            print(f"logging.{name}_project is set but {name} is not installed; skipping it")
            continue
        kwargs: dict[str, Any] = {"project": project, "name": run_dir.name, "config": config}
        if name == "wandb":
            kwargs["dir"] = str(run_dir)
        try:
            out.append(Tracker(name, module, module.init(**kwargs)))
        except Exception as e:  # a login or network problem must not stop the run
            line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            print(f"{name} could not start ({line}); skipping it")
    return out


class TeeLogger:
    """A metrics logger that also forwards every row to trackers (same ``log``/``close``)."""

    def __init__(self, logger: Any, trackers: list[Tracker]) -> None:
        self.logger, self.trackers = logger, trackers

    def __getattr__(self, name: str) -> Any:  # path, tb, ... of the wrapped logger
        return getattr(self.logger, name)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.logger.log(step, metrics)
        scalars = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and math.isfinite(float(v))}
        for t in list(self.trackers):
            try:
                t.log(step, scalars)
            except Exception as e:  # never let a tracker take the run down
                line = (str(e).strip().splitlines() or [type(e).__name__])[0]
                print(f"{t.name} failed to log ({line}); no longer logging to it")
                self.trackers.remove(t)

    def close(self) -> None:
        self.logger.close()
        for t in self.trackers:
            t.close()


def with_trackers(logger: Any, logging_cfg: Any, run_dir: Path, config: dict[str, Any]) -> Any:
    """``logger`` itself when no tracker is asked for or available, else a :class:`TeeLogger`."""
    trackers = start_trackers(logging_cfg, run_dir, config)
    return TeeLogger(logger, trackers) if trackers else logger
