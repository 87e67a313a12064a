"""Sample completions with their rewards, appended to ``RUN/samples.jsonl`` every k steps."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _clean(v: Any) -> Any:
    """JSON-safe reward value: NaN (unscorable) becomes null."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def write_samples(run_dir: str | Path, step: int, prompts: list[str], completions: list[str],
                  rewards: list[float], *, answers: list[Any] | None = None,
                  per_fn: dict[str, list[float]] | None = None, limit: int = 0) -> Path:
    """Append one line per completion: step, prompt, completion, reward (null = unscorable),
    the reference answer and each reward function's value. ``limit`` > 0 keeps the first
    ``limit`` rows (with a rollout's rows in group order: whole groups of one prompt)."""
    path = Path(run_dir) / "samples.jsonl"
    n = len(completions) if limit <= 0 else min(limit, len(completions))
    with open(path, "a", encoding="utf-8") as fh:
        for i in range(n):
            row: dict[str, Any] = {"step": step, "prompt": prompts[i],
                                   "completion": completions[i], "reward": _clean(rewards[i])}
            if answers is not None:
                row["answer"] = answers[i]
            if per_fn:
                row["rewards"] = {k: _clean(v[i]) for k, v in per_fn.items()}
            fh.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    return path
