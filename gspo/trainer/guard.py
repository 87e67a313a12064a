"""What keeps a run healthy: fault and collapse detection, and rolling back.

:class:`Guard` watches each step's metrics for a streak of numerical faults (updates skipped
for non-finite values, see :func:`gspo.trainer.update.policy_update`) and for collapse signals
(:class:`gspo.config.GuardConfig`); :class:`gspo.trainer.reliability.Reliability` acts on what it
reports (rollback, lower_lr or stop) with :func:`roll_back`. Its counters travel in
checkpoints, so a resumed run decides identically.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

from gspo.trainer.checkpoint import latest_checkpoint, load_checkpoint_state, load_weights
from gspo.trainer.distributed import (
    Dist,
    full_state_loader,
    group_settings,
    load_optimizer_state,
)


class GuardStop(RuntimeError):
    """The guard stopped the run (guard.on_fault=stop, or no rollback was possible)."""


class Guard:
    """Count faulty steps and evaluate the collapse signals of ``cfg`` (a
    :class:`gspo.config.GuardConfig`)."""

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
        # the window moves every step; with dynamic sampling reward/mean is over the groups
        # kept (with reward variance, so near the middle of the range whatever the policy
        # does): the mean over every sampled response is what collapses. A step where no
        # response could be scored (a reward outage) has no reward mean (reward/mean is 0
        # then): the window skips it, as it skips dynamic sampling's NaN mean.
        reward = metrics.get("dynamic/sampled_reward_mean")
        if reward is None and metrics.get("reward/unscorable_frac", 0.0) < 1.0:
            reward = metrics.get("reward/mean")
        drop = self._reward_drop(reward)
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
              dist: Dist, lr_factor: float = 1.0) -> int:
    """Load weights and optimizer moments from ``ckpt`` and scale the lr by ``lr_factor``.
    The step, data position, RNG and lr-schedule position stay: the run goes on with fresh
    prompts and samples instead of replaying the ones that led to the fault. ``dist``: the
    run's processes (under FSDP2 the full checkpoint is loaded into each rank's shards, as on
    resume). Returns the checkpoint's step: the model holds the weights of that many updates
    again. The optimizer's hyperparameters stay the run's: a checkpoint written before a
    resume that changed ``optim.*`` holds the earlier run's betas, weight decay and base lr."""
    optim_state, state = load_checkpoint_state(ckpt)
    load_weights(model, ckpt, full_state_loader(dist))
    hyper = group_settings(optimizer)
    load_optimizer_state(model, optimizer, optim_state["optimizer"], dist)
    for group, kept in zip(optimizer.param_groups, hyper):
        group.update(kept)  # the moments are the checkpoint's, the settings this run's
    # LambdaLR recomputes the lr from base_lrs at every step: scale those (they are saved in
    # the scheduler's state, so a resumed run keeps the lower lr).
    scheduler.base_lrs = [lr * lr_factor for lr in scheduler.base_lrs]
    scheduler._last_lr = [lr * lr_factor for lr in scheduler.get_last_lr()]
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr
    return int(state["step"])


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and v == v and abs(v) != float("inf")
