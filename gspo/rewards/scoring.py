"""Call reward functions defensively: a broken reward never takes the run down."""

from __future__ import annotations

import math
import numbers
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gspo.rewards.functions import RewardFn, resolve_reward


class RewardError(RuntimeError):
    """Too many responses could not be scored."""


@dataclass
class RewardScorer:
    """Weighted sum of reward functions; NaN marks a response no function could score.

    A response is unscorable when any weighted function returns None for it, raises, returns
    the wrong length, or a non-finite / non-numeric value. The first traceback of each function
    is kept in ``first_errors`` for the log.
    """

    functions: list[RewardFn]
    names: list[str]
    weights: list[float]
    first_errors: dict[str, str] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_specs(cls, specs: Sequence[Any], weights: Sequence[float] = ()) -> RewardScorer:
        fns = [resolve_reward(s) for s in specs]
        names = [s if isinstance(s, str) else getattr(s, "__name__", "reward") for s in specs]
        return cls(fns, names, list(weights) or [1.0] * len(fns))

    def _call(self, name: str, fn: RewardFn, prompts: list[str], completions: list[str],
              columns: dict[str, list]) -> list[float]:
        n = len(completions)
        try:
            values = list(fn(prompts, completions, **columns))
            if len(values) != n:
                raise ValueError(f"returned {len(values)} values for {n} completions")
        except Exception:
            self.failures[name] = self.failures.get(name, 0) + n
            self.first_errors.setdefault(name, traceback.format_exc(limit=5))
            return [math.nan] * n
        out = []
        for v in values:
            ok = isinstance(v, numbers.Real) and not isinstance(v, bool)  # numpy scalars too
            try:
                ok = ok and math.isfinite(v)
            except OverflowError:  # an int too large for a float
                ok = False
            if not ok and v is not None:
                self.failures[name] = self.failures.get(name, 0) + 1
                self.first_errors.setdefault(name, f"non-numeric reward value {v!r}")
            out.append(float(v) if ok else math.nan)
        return out

    def __call__(self, prompts: list[str], completions: list[str],
                 columns: dict[str, list]) -> tuple[list[float], dict[str, list[float]]]:
        """Total reward per response (NaN = unscorable) and each function's own values."""
        per_fn = {name: self._call(name, fn, prompts, completions, columns)
                  for name, fn in zip(self.names, self.functions)}
        total = [sum(w * per_fn[name][i] for name, w in zip(self.names, self.weights))
                 for i in range(len(completions))]
        return total, per_fn
