"""The trainer's reliability side, as a part it holds: the guard's responses and reward errors.

:class:`Reliability` owns the run's :class:`gspo.trainer.guard.Guard` (its counters restored
from a checkpoint) and the reward error log; the trainer asks it what to do after each step.
The policy of when to act lives in :mod:`gspo.trainer.guard`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

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

    def report_reward_errors(self, step: int, errors: dict[str, str], dist: Any = None, *,
                             agreed: bool = True) -> None:
        """Print (once per function and run) the last line of each reward function's first
        error; the full traceback goes to the reward error log.

        ``dist``: under torchrun each rank scores its own rows, so each has its own first
        errors: rank 0 writes and prints each function's once, the lowest rank's, naming that
        rank (collectives: every rank calls this alike). ``agreed=False`` where the ranks may
        not all be here (this rank's step raised an error the others may not have): no
        collective, and rank 0 reports its own errors only."""
        new = {n: e for n, e in errors.items() if n not in self.reward_log.logged}
        ranks: dict[str, int] = {}
        if dist is not None and dist.enabled:
            if agreed and dist.all_reduce(torch.tensor([float(len(new))]), "max").item() > 0:
                for rank, share in enumerate(dist.gather_objects(new)):
                    for name, error in share.items():
                        if name not in ranks:
                            new[name], ranks[name] = error, rank
            else:
                ranks = dict.fromkeys(new, dist.rank)
            if not dist.is_main:  # rank 0 logs them
                self.reward_log.logged.update(new)
                return
        for name in self.reward_log.update(step, new, ranks):
            last = (new[name].strip().splitlines() or ["?"])[-1]
            where = f" on rank {ranks[name]}" if name in ranks else ""
            print(f"reward function '{name}' failed at step {step}{where}: {last} "
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
