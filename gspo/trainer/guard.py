"""What keeps a run alive: fault and collapse detection, signals, logs that resume exactly.

* :class:`Guard` watches each step's metrics for a streak of numerical faults (updates skipped
  for non-finite values, see :func:`gspo.trainer.update.policy_update`) and for collapse signals
  (:class:`gspo.config.ReliabilityConfig`); the trainer acts on what it reports (rollback,
  lower_lr or stop). Its counters travel in checkpoints, so a resumed run decides identically.
* :class:`GracefulStop` turns the first SIGINT/SIGTERM into a request the loop honours after
  the current step; a second one abandons the step at once (``KeyboardInterrupt``).
* :class:`RewardErrorLog` writes each reward function's first traceback once to
  ``RUN/reward_errors.log``.
* :func:`log_sizes` / :func:`truncate_logs`: the append-only logs are cut back on resume to what
  they held when the checkpoint was written, so no step is logged twice or lost.
* :func:`extra_rng_state` / :func:`set_extra_rng_state`: Python's, NumPy's and CUDA's RNGs
  (the trainer saves torch's CPU RNG itself).
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
from collections import deque
from pathlib import Path
from typing import Any

import torch

APPEND_ONLY_LOGS = ("metrics.jsonl", "samples.jsonl")


class GuardStop(RuntimeError):
    """The guard stopped the run (guard.on_fault=stop, or no rollback was possible)."""


class Guard:
    """Count faulty steps and evaluate the collapse signals of ``cfg`` (a ReliabilityConfig)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.faults = 0  # faulty steps in the whole run
        self.consecutive = 0
        self.rollbacks = 0
        self.best_window_reward: float | None = None
        self.recent_rewards: deque[float] = deque(maxlen=cfg.collapse_window)
        self.last_good_step: int | None = None  # newest checkpoint written while healthy
        self.alarm = False  # a signal fired and nothing was rolled back (a stop): not healthy

    def observe(self, metrics: dict[str, Any]) -> str | None:
        """Record one step; the reason to act, or None while the run looks healthy."""
        reason = self._signal(metrics)
        self.alarm = self.alarm or reason is not None
        return reason

    def _signal(self, metrics: dict[str, Any]) -> str | None:
        cfg = self.cfg
        if metrics.get("train/skipped_updates", 0) > 0:
            self.faults += 1
            self.consecutive += 1
        else:
            self.consecutive = 0
        drop = self._reward_drop(metrics.get("reward/mean"))  # the window moves every step
        if cfg.max_consecutive_faults and self.consecutive >= cfg.max_consecutive_faults:
            return (f"{self.consecutive} consecutive steps with updates skipped for non-finite "
                    "loss, gradient or log-probs")
        entropy = metrics.get("train/entropy")
        if cfg.collapse_entropy_floor and _finite(entropy) and entropy < cfg.collapse_entropy_floor:
            return f"entropy {entropy:.4g} fell below guard.collapse_entropy_floor"
        ratio = metrics.get("objective/seq_ratio_max")
        if cfg.collapse_ratio_ceiling and _finite(ratio) and ratio > cfg.collapse_ratio_ceiling:
            return f"sequence ratio max {ratio:.4g} rose above guard.collapse_ratio_ceiling"
        return drop

    def _reward_drop(self, reward: Any) -> str | None:
        if not self.cfg.collapse_reward_drop or not _finite(reward):
            return None
        self.recent_rewards.append(float(reward))
        if len(self.recent_rewards) < self.recent_rewards.maxlen:
            return None
        mean = sum(self.recent_rewards) / len(self.recent_rewards)
        best = mean if self.best_window_reward is None else max(self.best_window_reward, mean)
        self.best_window_reward = best
        if best - mean > self.cfg.collapse_reward_drop:
            return (f"reward mean over the last {len(self.recent_rewards)} steps ({mean:.4g}) "
                    f"fell {best - mean:.4g} below its best ({best:.4g})")
        return None

    def acted(self, rolled_back: bool) -> None:
        """Reset the streak and the reward window after an action (the best is kept)."""
        self.consecutive, self.alarm = 0, False
        self.recent_rewards.clear()
        self.rollbacks += int(rolled_back)

    def good_checkpoint(self, root: Path) -> Path | None:
        """The newest checkpoint written while healthy (kept by ``keep_checkpoints`` pruning)."""
        from gspo.trainer.checkpoint import latest_checkpoint

        good = None if self.last_good_step is None else root / f"step_{self.last_good_step:06d}"
        if good is not None and (good / "state.json").is_file():
            return good
        return latest_checkpoint(root)  # a checkpoint from before the guard kept count

    def saved(self, step: int) -> None:
        if self.consecutive == 0 and not self.alarm:
            self.last_good_step = step

    def metrics(self) -> dict[str, float]:
        return {"guard/faults": self.faults, "guard/consecutive_faults": self.consecutive,
                "guard/rollbacks": self.rollbacks}

    def state_dict(self) -> dict[str, Any]:
        return {"faults": self.faults, "consecutive": self.consecutive,
                "rollbacks": self.rollbacks, "best_window_reward": self.best_window_reward,
                "recent_rewards": list(self.recent_rewards),
                "last_good_step": self.last_good_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.faults, self.consecutive = state["faults"], state["consecutive"]
        self.rollbacks, self.best_window_reward = state["rollbacks"], state["best_window_reward"]
        self.recent_rewards.clear()
        self.recent_rewards.extend(state["recent_rewards"])
        # ``alarm`` is not restored: it is only ever set when a run stopped, and resuming such
        # a run (with another config, say) starts from that checkpoint afresh.
        self.last_good_step = state["last_good_step"]


def roll_back(ckpt: Path, model: Any, optimizer: Any, scheduler: Any, *,
              lr_factor: float = 1.0) -> None:
    """Load weights and optimizer moments from ``ckpt`` and scale the lr by ``lr_factor``.
    The step, data position, RNG and lr-schedule position stay: the run goes on with fresh
    prompts and samples instead of replaying the ones that led to the fault."""
    from gspo.trainer.checkpoint import load_checkpoint_state, load_weights

    optim_state, _ = load_checkpoint_state(ckpt)
    load_weights(model, ckpt)
    optimizer.load_state_dict(optim_state["optimizer"])
    # LambdaLR recomputes the lr from base_lrs at every step: scale those (they are saved in
    # the scheduler's state, so a resumed run keeps the lower lr).
    scheduler.base_lrs = [lr * lr_factor for lr in scheduler.base_lrs]
    scheduler._last_lr = [lr * lr_factor for lr in scheduler.get_last_lr()]
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and v == v and abs(v) != float("inf")


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


class RewardErrorLog:
    """Append each reward function's first error to ``RUN/reward_errors.log``, once per run
    (names already in the file, from before a resume, are not written again)."""

    HEADER = re.compile(r"^== reward function '(.*)' first failed at step \d+", re.M)

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "reward_errors.log"
        self.logged = set(self.HEADER.findall(self.path.read_text())) if self.path.is_file() \
            else set()

    def update(self, step: int, first_errors: dict[str, str]) -> list[str]:
        """Write the errors not logged yet; returns the names written."""
        new = [n for n in first_errors if n not in self.logged]
        if new:
            with open(self.path, "a") as fh:
                for name in new:
                    fh.write(f"== reward function '{name}' first failed at step {step} ==\n"
                             f"{first_errors[name].rstrip()}\n\n")
            self.logged.update(new)
        return new


def log_sizes(run_dir: Path) -> dict[str, int]:
    return {name: (run_dir / name).stat().st_size if (run_dir / name).is_file() else 0
            for name in APPEND_ONLY_LOGS}


def truncate_logs(run_dir: Path, sizes: dict[str, int]) -> None:
    """Cut each append-only log back to its size at checkpoint time: the lines written after it
    (including a line cut short by a kill) belong to steps the resumed run redoes."""
    for name, size in sizes.items():
        path = run_dir / name
        if path.is_file() and path.stat().st_size > size:
            os.truncate(path, size)


def extra_rng_state() -> dict[str, Any]:
    """JSON-able states of Python's and NumPy's global RNGs (reward code may use them)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss]}
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def set_extra_rng_state(state: dict[str, Any]) -> None:
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def cuda_rng_state() -> list[torch.Tensor] | None:
    return torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
