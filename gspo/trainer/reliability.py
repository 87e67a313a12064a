"""The trainer's reliability side, as a part it holds: the guard's responses and reward errors.

:class:`Reliability` owns the run's :class:`gspo.trainer.guard.Guard` (its counters restored
from a checkpoint) and the reward error log; the trainer asks it what to do after each step.
The policy of when to act lives in :mod:`gspo.trainer.guard`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gspo.config import GuardConfig
from gspo.trainer.guard import Guard, roll_back
from gspo.trainer.run_logs import RewardErrorLog


class Reliability:
    """Guard responses (rollback / lower lr / stop) and reward error reporting for one run."""

    def __init__(self, cfg: GuardConfig, run_dir: Path,
                 guard_state: dict[str, Any] | None = None) -> None:
        self.cfg = cfg
        self.guard = Guard(cfg)
        if guard_state:
            self.guard.load_state_dict(guard_state)
        self.reward_log = RewardErrorLog(run_dir)
        self.checkpoints = run_dir / "checkpoints"
        self.restored_step: int | None = None  # the step of the last rollback's checkpoint

    def report_reward_errors(self, step: int, errors: dict[str, str]) -> None:
        """Print (once per function and run) the last line of each reward function's first
        error; the full traceback goes to the reward error log."""
        for name in self.reward_log.update(step, errors):
            last = (errors[name].strip().splitlines() or ["?"])[-1]
            print(f"reward function '{name}' failed at step {step}: {last} "
                  f"(traceback: {self.reward_log.path})", flush=True)

    def respond(self, reason: str, step: int, model: Any, optimizer: Any,
                scheduler: Any, dist: Any) -> str | None:
        """Act on a guard signal: roll back (None: the run goes on; :attr:`restored_step` is
        then the step whose weights the model holds again) or the reason to stop. ``dist``:
        the run's processes (every rank acts alike; the first one prints)."""
        g = self.cfg
        say = print if dist.is_main else lambda *a, **k: None
        say(f"guard: step {step}: {reason}", flush=True)
        if g.on_fault == "stop":
            return reason
        if self.guard.rollbacks >= g.max_rollbacks:
            return f"{reason}; rolled back {self.guard.rollbacks} times already"
        ckpt = self.guard.good_checkpoint(self.checkpoints)
        if ckpt is None:
            return f"{reason}; no checkpoint to roll back to (set save_every > 0)"
        factor = g.lr_factor if g.on_fault == "lower_lr" else 1.0
        self.restored_step = roll_back(ckpt, model, optimizer, scheduler, dist=dist,
                                       lr_factor=factor)
        self.guard.acted(rolled_back=True)
        lr = f", lr now {scheduler.get_last_lr()[0]:.3g}" if factor != 1.0 else ""
        say(f"guard: rolled back to {ckpt.name} (weights and optimizer){lr}; rollback "
            f"{self.guard.rollbacks} of at most {g.max_rollbacks}", flush=True)
        return None
