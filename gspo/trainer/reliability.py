"""The trainer's reliability side: the guard's responses, interruption and reward errors.

A mixin of :class:`gspo.trainer.trainer.Trainer`, kept apart so that the trainer reads as the
algorithm. It uses the trainer's ``cfg``, ``step``, ``run_dir``, ``model``, ``optimizer``,
``scheduler``, ``scorer`` and ``save_checkpoint``; the policy itself lives in
:mod:`gspo.trainer.guard`.
"""

from __future__ import annotations

from typing import Any

from gspo.trainer.checkpoint import latest_checkpoint


class Reliability:
    """Guard responses (rollback / lower lr / stop), graceful interruption, reward errors."""

    def _arm_reliability(self) -> None:
        """Guard (counters restored on resume), reward timeout and the reward error log."""
        from gspo.trainer.guard import Guard, RewardErrorLog

        if getattr(self, "guard", None) is None:
            self.guard = Guard(self.cfg.guard)
            if getattr(self, "_guard_state", None):
                self.guard.load_state_dict(self._guard_state)
        if hasattr(self.scorer, "timeout_s"):
            self.scorer.timeout_s = self.cfg.reward.timeout_s
        self.reward_log = RewardErrorLog(self.run_dir)
        self._saved_step = getattr(self, "_saved_step", None)
        self.final_eval = getattr(self, "final_eval", None)

    def _log_reward_errors(self, step: int) -> None:
        errors = getattr(self.scorer, "first_errors", {})
        for name in self.reward_log.update(step, errors):
            last = (errors[name].strip().splitlines() or ["?"])[-1]
            print(f"reward function '{name}' failed at step {step}: {last} "
                  f"(traceback: {self.reward_log.path})", flush=True)

    def _respond(self, reason: str) -> str | None:
        """Act on a guard signal: roll back (None: the run goes on) or the reason to stop."""
        g = self.cfg.guard
        print(f"guard: step {self.step}: {reason}", flush=True)
        if g.on_fault == "stop":
            return reason
        if self.guard.rollbacks >= g.max_rollbacks:
            return f"{reason}; rolled back {self.guard.rollbacks} times already"
        from gspo.trainer.guard import roll_back

        ckpt = self.guard.good_checkpoint(self.run_dir / "checkpoints")
        if ckpt is None:
            return f"{reason}; no checkpoint to roll back to (set save_every > 0)"
        factor = g.lr_factor if g.on_fault == "lower_lr" else 1.0
        roll_back(ckpt, self.model, self.optimizer, self.scheduler, lr_factor=factor)
        self.guard.acted(rolled_back=True)
        lr = f", lr now {self.scheduler.get_last_lr()[0]:.3g}" if factor != 1.0 else ""
        print(f"guard: rolled back to {ckpt.name} (weights and optimizer){lr}; rollback "
              f"{self.guard.rollbacks} of at most {g.max_rollbacks}", flush=True)
        return None

    def _guard_stop(self, reason: str) -> None:
        from gspo.trainer.guard import GuardStop

        if self._saved_step != self.step:
            self.save_checkpoint()
        raise GuardStop(f"guard stopped the run at step {self.step}: {reason}; state saved in "
                        f"{self.run_dir}/checkpoints/step_{self.step:06d}, metrics in "
                        f"{self.run_dir}/metrics.jsonl")

    def _interrupted(self) -> dict[str, Any]:
        if self._saved_step != self.step:
            self.save_checkpoint()
        print(f"interrupted at step {self.step}; resume with: gspo train resume={self.run_dir}",
              flush=True)
        return {"steps": self.step, "before": getattr(self, "baseline_eval", None), "after": {},
                "run_dir": str(self.run_dir), "interrupted": True}

    def _abandoned(self) -> None:
        ckpt = latest_checkpoint(self.run_dir / "checkpoints")
        where = (f"resume from {ckpt.name} with: gspo train resume={self.run_dir}" if ckpt
                 else "no checkpoint yet: start the run again")
        print(f"interrupted again after step {self.step}: work in progress abandoned; {where}",
              flush=True)
