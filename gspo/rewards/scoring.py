"""Call reward functions defensively: a broken reward never takes the run down."""

from __future__ import annotations

import inspect
import math
import numbers
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gspo.rewards.functions import RewardFn, check_packages, resolve_reward
from gspo.rewards.isolation import IsolatedFailure, RewardProcesses

# Largest finite float32: the trainer holds rewards in float32, where a larger value is inf.
FLOAT32_MAX = 3.4028234663852886e38


def _declares(fn: Any, name: str) -> bool:
    """Whether ``fn`` has a parameter called ``name`` (``**kwargs`` does not count)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a signature
        return False
    return name in params and params[name].kind is not inspect.Parameter.VAR_KEYWORD


def _scalar(v: Any) -> Any:
    """A zero-dimensional array or tensor (``np.bool_``, ``torch.tensor(1.0)``, what ``list``
    of a tensor gives) as its Python value; anything else as it is."""
    if getattr(v, "ndim", None) == 0 and callable(getattr(v, "item", None)):
        try:
            return v.item()
        except Exception:  # not a number after all: unscorable below
            return v
    return v


class RewardError(RuntimeError):
    """Too many responses could not be scored."""


class _Failed(Exception):
    """A reward call that failed in its worker thread or ran past the timeout."""

    def __init__(self, report: str) -> None:
        super().__init__(report)
        self.report = report


@dataclass
class RewardScorer:
    """Weighted sum of reward functions; NaN marks a response no function could score.

    A value may be any real number: a Python or numpy number, a bool (``True`` is 1.0, as in
    TRL), a zero-dimensional array or tensor (so a function may return a 1-D tensor). A response
    is unscorable when any function of nonzero weight returns None for it, raises, returns the
    wrong length, a non-numeric value or one that is not finite in float32, or (with
    ``timeout_s`` > 0) runs longer than ``timeout_s`` seconds on the batch. The first traceback
    of each function is kept in ``first_errors`` and ``failures`` counts unscorable responses
    per function.

    Timeout: each call then runs in a daemon thread that the caller waits on for ``timeout_s``.
    Python cannot kill a thread, so a function that hangs is *left running*; until it returns,
    later batches are not given to it (they are unscorable at once), so at most one hung thread
    per function exists. A function stuck in C code that holds the GIL blocks the caller anyway:
    the timeout covers Python code, sleeps and I/O, not that case. After :meth:`isolate`
    (``reward.isolate=process``) the user's functions run in processes of their own instead,
    which are killed on a timeout, a crash or too much memory (:mod:`gspo.rewards.isolation`).
    """

    functions: list[RewardFn]
    names: list[str]
    weights: list[float]
    first_errors: dict[str, str] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    timeout_s: float = 0.0  # 0: call in the caller's thread, no limit
    _running: dict[str, threading.Thread] = field(default_factory=dict, repr=False)
    processes: RewardProcesses | None = None  # reward.isolate=process: see isolate()

    def __post_init__(self) -> None:
        """One name and one finite weight per function, the names distinct: ``zip`` would
        otherwise leave the extra functions out of the total (computed and logged, never
        trained on), and two functions of one name would share one entry of the values."""
        n = len(self.functions)
        if len(self.names) != n or len(self.weights) != n:
            raise ValueError(f"RewardScorer: {n} reward functions, {len(self.names)} names and "
                             f"{len(self.weights)} weights; give one name and one weight per "
                             "function")
        if len(set(self.names)) != n:
            raise ValueError(f"RewardScorer: reward function names must be distinct, got "
                             f"{self.names}")
        bad = [w for w in self.weights if not math.isfinite(w)]
        if bad:  # NaN made every total NaN ("returned None"); inf made a 0 score NaN
            raise ValueError(f"RewardScorer: reward weights must be finite numbers, got {bad}")

    @classmethod
    def from_specs(cls, specs: Sequence[Any], weights: Sequence[float] = ()) -> RewardScorer:
        """The functions ``specs`` name, with ``weights`` (empty: all 1.0; otherwise one per
        function, else a ValueError). Each is known by its spec or ``__name__``; a name given
        twice (two lambdas, two ``functools.partial`` of one function, a spec listed twice)
        becomes ``name_2``, ``name_3``, ...: the values, weights and failures are kept per
        name."""
        check_packages(list(specs))
        fns = [resolve_reward(s) for s in specs]
        names: list[str] = []
        for s in specs:
            name = s if isinstance(s, str) else getattr(s, "__name__", "reward")
            base, k = name, 2
            while name in names:
                name, k = f"{base}_{k}", k + 1
            names.append(name)
        return cls(fns, names, list(weights) or [1.0] * len(fns))

    def isolate(self, specs: Sequence[Any], *, memory_mb: int) -> None:
        """Run the first ``len(specs)`` functions (the user's; ``specs`` as given to
        :meth:`from_specs`) each in its own process (:mod:`gspo.rewards.isolation`): a crash,
        a hang past ``timeout_s`` or more than ``memory_mb`` MiB kills that process only and
        makes the batch unscorable for it."""
        self.processes = RewardProcesses(self.names[:len(specs)], specs, memory_mb=memory_mb)

    def close(self) -> None:
        """Stop the reward processes (a no-op for thread isolation)."""
        if self.processes is not None:
            self.processes.close()

    def _call(self, name: str, fn: RewardFn, prompts: list[str], completions: list[str],
              columns: dict[str, list]) -> list[float]:
        n = len(completions)
        try:
            values = self._values(name, fn, prompts, completions, columns)
            if len(values) != n:
                raise ValueError(f"returned {len(values)} values for {n} completions")
        except _Failed as e:
            self.failures[name] = self.failures.get(name, 0) + n
            self.first_errors.setdefault(name, e.report)
            return [math.nan] * n
        except Exception:
            self.failures[name] = self.failures.get(name, 0) + n
            self.first_errors.setdefault(name, traceback.format_exc(limit=5))
            return [math.nan] * n
        out = []
        for v in values:
            v = _scalar(v)
            ok = isinstance(v, numbers.Real)  # numpy scalars too; a bool is 1.0 or 0.0
            try:
                ok = ok and math.isfinite(v) and abs(v) <= FLOAT32_MAX
            except OverflowError:  # an int too large for a float
                ok = False
            if not ok and v is not None:
                self.failures[name] = self.failures.get(name, 0) + 1
                self.first_errors.setdefault(
                    name, f"reward value {v!r} is not a finite (float32) number")
            out.append(float(v) if ok else math.nan)
        return out

    def _values(self, name: str, fn: RewardFn, prompts: list[str], completions: list[str],
                columns: dict[str, list]) -> list[Any]:
        if self.processes is not None and name in self.processes:
            try:
                return self.processes.call(name, prompts, completions, columns, self.timeout_s)
            except IsolatedFailure as e:
                raise _Failed(e.report) from None
        if not self.timeout_s:
            return list(fn(prompts, completions, **columns))
        hung = self._running.get(name)
        if hung is not None and hung.is_alive():
            raise _Failed(f"RewardTimeout: {name} still running on an earlier batch "
                          f"(hung past reward.timeout_s={self.timeout_s:g})")
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["values"] = list(fn(prompts, completions, **columns))
            except Exception:
                box["error"] = traceback.format_exc(limit=5)

        worker = threading.Thread(target=work, name=f"reward-{name}", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            self._running[name] = worker
            raise _Failed(f"RewardTimeout: {name} took longer than reward.timeout_s="
                          f"{self.timeout_s:g} s on a batch of {len(completions)}; its thread "
                          "is left running (a thread cannot be killed)")
        if "error" in box:
            raise _Failed(box["error"])
        return box["values"]

    def failed_on_all(self, before: dict[str, int], n: int) -> str | None:
        """``"name: <last line of its first error>"`` for a function of nonzero weight that
        failed on every one of the ``n`` responses scored since ``before`` (a copy of
        :attr:`failures`), else None. A function of weight 0 is only logged: its failures
        leave the responses scorable."""
        for name, weight in zip(self.names, self.weights):
            if weight and n and self.failures.get(name, 0) - before.get(name, 0) >= n:
                report = self.first_errors.get(name, "").strip().splitlines()
                return f"{name}: {report[-1] if report else 'failed'}"
        return None

    def __call__(self, prompts: list[str], completions: list[str], columns: dict[str, list],
                 *, response_tokens: list[int] | None = None
                 ) -> tuple[list[float], dict[str, list[float]]]:
        """Total reward per response (NaN = unscorable) and each function's own values.
        ``response_tokens``: each response's number of sampled tokens (EOS included), given to
        the functions that name a ``response_tokens`` parameter (not to ``**columns``)."""
        def cols(fn: RewardFn) -> dict[str, list]:
            if response_tokens is None or not _declares(fn, "response_tokens"):
                return columns
            return {**columns, "response_tokens": response_tokens}

        per_fn = {name: self._call(name, fn, prompts, completions, cols(fn))
                  for name, fn in zip(self.names, self.functions)}
        # A function of weight 0 is logged, not trained on: its None or error leaves the
        # total alone (0 * NaN would be NaN).
        total = [sum(w * per_fn[name][i] for name, w in zip(self.names, self.weights) if w)
                 for i in range(len(completions))]
        return total, per_fn
