"""Per-step metrics: ``metrics.jsonl`` always, TensorBoard when asked for."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch


def to_float(v: Any) -> float:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().item())
    return float(v)


def mean_stats(stats: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Average each key over minibatches (min/max keys take the min/max); one host sync."""
    if not stats:
        return {}
    out: dict[str, float] = {}
    for key in stats[0]:
        values = torch.stack([s[key].detach().float() for s in stats])
        if key.endswith("_min"):
            out[key] = float(values.min())
        elif key.endswith("_max"):
            out[key] = float(values.max())
        else:
            out[key] = float(values.mean())
    return out


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool = False, resume_step: int = -1) -> None:
        self.path = run_dir / "metrics.jsonl"
        if resume_step >= 0 and self.path.is_file():
            # Drop lines logged after the checkpoint we resume from: they will be redone.
            kept = [ln for ln in self.path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", -1) <= resume_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # optional extra
                print("tensorboard is not installed; logging to metrics.jsonl only")
            else:
                self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step}
        for k, v in metrics.items():
            f = to_float(v) if not isinstance(v, str) else v
            row[k] = f if isinstance(f, str) or math.isfinite(f) else None
        with open(self.path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, float):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
