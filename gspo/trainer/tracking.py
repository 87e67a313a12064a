"""Optional experiment trackers (Weights & Biases, trackio) next to ``metrics.jsonl``.

Used only when asked for (``logging.wandb_project`` / ``logging.trackio_project``) and when
the package imports; neither is a dependency. A tracker that fails to start prints one line
and the run goes on with ``metrics.jsonl`` (and TensorBoard).
"""

from __future__ import annotations

import importlib
import math
import secrets
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


WANDB_ID = "wandb_run_id"  # in the run folder: the W&B run a resumed run continues


def _wandb_id(run_dir: Path) -> str:
    """The W&B run id of this run folder: made on its first start, read back on resume."""
    path = run_dir / WANDB_ID
    if not path.is_file():
        path.write_text(secrets.token_hex(8))
    return path.read_text().strip()


def start_trackers(logging_cfg: Any, run_dir: Path, config: dict[str, Any], *,
                   resumed: bool = False) -> list[Tracker]:
    """Start the trackers named in :class:`gspo.config.LoggingConfig`. ``resumed``: the run
    continues from a checkpoint, and each tracker continues its run rather than open a
    second one (W&B by the id kept in the run folder, trackio by the run's name)."""
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
            kwargs.update(dir=str(run_dir), id=_wandb_id(run_dir), resume="allow")
        elif resumed:
            kwargs["resume"] = "allow"
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


def with_trackers(logger: Any, logging_cfg: Any, run_dir: Path, config: dict[str, Any], *,
                  resumed: bool = False) -> Any:
    """``logger`` itself when no tracker is asked for or available, else a :class:`TeeLogger`
    (``resumed``: see :func:`start_trackers`)."""
    trackers = start_trackers(logging_cfg, run_dir, config, resumed=resumed)
    return TeeLogger(logger, trackers) if trackers else logger
