"""Which groups and tokens a step trains on: DAPO dynamic sampling, truncation masking, and the
zero-signal warning.

Dynamic sampling (DAPO, arXiv:2503.14476 v1, Sec. 3.2): a group whose G rewards are all equal
has all-zero advantages under group normalisation, so it adds no policy gradient (with β = 0)
and only dilutes the mean over rows. With ``rollout.dynamic_sampling`` the step drops such
groups and draws further rollout batches of ``prompts_per_step`` new prompts until
``prompts_per_step`` groups carry signal, or until ``rollout.dynamic_max_extra_batches`` extra
batches were drawn; past that cap it trains on the groups with signal it has
(``dynamic/cap_reached``). Surplus groups of the last draw are discarded, as in DAPO.

Reproducibility: draw ``d`` of step ``k`` takes its prompts from the task's own checkpointed
stream and samples with seeds that are a function of (seed, k, d, prompt index)
(``Trainer.rollout``), so a resumed run redraws exactly the same batches.

Truncation masking (``rollout.mask_truncated``; DAPO's overlong filtering, TRL's
``mask_truncated_completions``): responses cut at ``max_new_tokens`` keep their reward and
their place in the group's advantage baseline, but get zero loss weight.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gspo.rollout import Rollout
from gspo.rollout.batch import join_replayed, join_routing, policy_tokens
from gspo.rollout.multiturn import episode_metrics

__all__ = ["Draw", "DynamicBatch", "ZeroSignalWatch", "collect", "concat_rollouts",
           "mask_truncated", "signal_groups"]


def signal_groups(rewards: Tensor, group_size: int) -> Tensor:
    """[n_groups] bool: the group has ≥ 2 scorable (non-NaN) rewards that are not all equal,
    i.e. non-zero advantages (the same rule as ``reward/frac_groups_zero_std``)."""
    r = rewards.detach().double().reshape(-1, group_size)
    ok = ~torch.isnan(r)
    hi = torch.where(ok, r, -math.inf).amax(-1)
    lo = torch.where(ok, r, math.inf).amin(-1)
    return (ok.sum(-1) >= 2) & (hi > lo)


def concat_rollouts(rolls: list[Rollout]) -> Rollout:
    """The rows of several rollouts in order (same group size), with what each row carries: the
    multi-turn observation mask, the experts the engine routed to (R3), and from the async
    pipeline its policy version and the trainer's log-probs (and experts, and R3's replayed
    log-probs: a batch without them contributes its trainer log-probs) on that version. A
    multi-turn batch's episode metrics (``rollout/turns_mean`` etc., means over a draw's rows)
    are recomputed for the joined rows from their masks (:func:`episode_metrics`)."""
    def present(name: str) -> list[Any] | None:
        per = [getattr(r, name) for r in rolls]
        if all(x is None for x in per):
            return None
        if any(x is None for x in per):
            raise ValueError(f"concat_rollouts: some rollouts have {name} and some do not")
        return per

    def rows(name: str) -> list[Any] | None:
        per = present(name)
        return None if per is None else [row for x in per for row in x]

    def routing(name: str) -> list[Tensor] | None:  # per-batch layouts: re-padded, joined
        per = present(name)
        return None if per is None else join_routing(per, [len(r) for r in rolls],
                                                      complete=name == "trainer_routing")

    mask = rows("model_mask")
    return Rollout([p for r in rolls for p in r.prompt_ids],
                   [y for r in rolls for y in r.response_ids],
                   [lp for r in rolls for lp in r.logprobs],
                   [t for r in rolls for t in r.truncated], rolls[0].group_size,
                   routing("routing"),
                   extras={} if mask is None else episode_metrics(mask),
                   model_mask=mask, versions=rows("versions"),
                   trainer_logprobs=rows("trainer_logprobs"),
                   trainer_routing=routing("trainer_routing"),
                   replayed_logprobs=join_replayed([r.replayed_logprobs for r in rolls],
                                                   [r.trainer_logprobs for r in rolls]))


@dataclass
class Draw:
    """One scored rollout batch: its examples, rollout and rewards [n_groups · G], and each
    reward function's own values [n_groups · G] (``reward/<name>``, the samples file)."""

    examples: list[Any]
    roll: Rollout
    rewards: Tensor
    parts: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class DynamicBatch:
    """The groups a step trains on, from one or more draws (each reward function's values of
    their rows in ``parts``), and what it cost."""

    examples: list[Any]
    roll: Rollout
    rewards: Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    parts: dict[str, Tensor] = field(default_factory=dict)
    stand_ins: list[int] = field(default_factory=list)  # indices of stand-in groups (min_groups)


def collect(first: Draw, draw: Callable[[int], Draw], *, prompts_per_step: int,
            max_extra_batches: int, min_rows: int = 1, min_groups: int = 1) -> DynamicBatch:
    """Groups with reward variance from ``first`` and further draws ``draw(1)``, ``draw(2)``, …
    until ``prompts_per_step`` of them are collected or ``max_extra_batches`` extra draws ran.

    The batch holds the first ``prompts_per_step`` groups with signal in draw order. When it
    would hold fewer than ``min_rows`` rows (the update's minibatch count; also when no group
    had signal), it is topped up with zero-signal groups in draw order, which carry zero
    advantage (``dynamic/groups_filled``). When it would then hold fewer than ``min_groups``
    groups (under torchrun every rank needs one), further zero-signal groups join as
    stand-ins (``DynamicBatch.stand_ins``, their indices in the batch): not a choice one
    process makes, so the trainer gives them zero loss weight and leaves them out of the
    reward metrics and ``dynamic/groups_filled``. A draw with every group kept returns its
    own tensors unchanged (with its stand-ins, when some of its groups are).
    """
    g = first.roll.group_size
    draws, signal = [first], [signal_groups(first.rewards, g)]
    start = time.perf_counter()
    while sum(int(s.sum()) for s in signal) < prompts_per_step and len(draws) <= max_extra_batches:
        d = draw(len(draws))
        draws.append(d)
        signal.append(signal_groups(d.rewards, g))
    extra_s = time.perf_counter() - start
    order = [(i, j) for i, s in enumerate(signal) for j in range(len(s))]
    kept = [(i, j) for i, j in order if signal[i][j]][:prompts_per_step]
    need = max(0, math.ceil(min_rows / g) - len(kept))
    zero = [(i, j) for i, j in order if not signal[i][j]]
    filled = zero[:need]
    extra = zero[need:need + max(0, min_groups - len(kept) - len(filled))]
    chosen = sorted(kept + filled + extra)
    sampled = torch.cat([d.rewards for d in draws]).double()
    n_sampled = sum(len(s) for s in signal)
    metrics = {
        "dynamic/groups_sampled": float(n_sampled),
        "dynamic/groups_kept": float(len(kept)),
        "dynamic/groups_filled": float(len(filled)),
        "dynamic/extra_batches": float(len(draws) - 1),
        "dynamic/extra_s": extra_s,
        "dynamic/cap_reached": float(len(kept) < prompts_per_step),
        "dynamic/responses_sampled": float(sampled.numel()),
        "dynamic/response_tokens_sampled": float(sum(
            sum(policy_tokens(d.roll.response_ids, d.roll.model_mask)) for d in draws)),
        "dynamic/sampled_reward_mean": float(sampled.nanmean()) if sampled.numel() else 0.0,
        "dynamic/zero_signal_frac_sampled": 1.0 - sum(int(s.sum()) for s in signal) / n_sampled,
    }
    stand_ins = [chosen.index(x) for x in extra]
    if len(draws) == 1 and len(chosen) == len(signal[0]):
        return DynamicBatch(first.examples, first.roll, first.rewards, metrics, first.parts,
                            stand_ins)
    rows = lambda j: list(range(j * g, (j + 1) * g))  # noqa: E731
    roll = concat_rollouts([draws[i].roll.select(rows(j)) for i, j in chosen])
    rewards = torch.cat([draws[i].rewards[j * g:(j + 1) * g] for i, j in chosen])
    parts = {k: torch.cat([draws[i].parts[k][j * g:(j + 1) * g] for i, j in chosen])
             for k in first.parts}
    return DynamicBatch([draws[i].examples[j] for i, j in chosen], roll, rewards, metrics,
                        parts, stand_ins)


def mask_truncated(response_mask: Tensor, truncated: list[bool]) -> Tensor:
    """``response_mask`` [N, T] with the rows of truncated responses set to 0 (a new tensor):
    the objectives give rows without response tokens zero weight."""
    keep = torch.tensor([not t for t in truncated], dtype=response_mask.dtype,
                        device=response_mask.device)
    return response_mask * keep[:, None]


class ZeroSignalWatch:
    """One warning when more than half of the sampled groups had zero reward variance for ``k``
    consecutive steps (Unsloth #3485: runs where most groups teach nothing, unnoticed).

    It reads ``dynamic/zero_signal_frac_sampled`` when dynamic sampling ran, else
    ``reward/frac_groups_zero_std`` (the trained batch). ``k = 0``: never warns.
    """

    THRESHOLD = 0.5

    def __init__(self, k: int) -> None:
        self.k, self.streak, self.warned = k, 0, False

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak, "warned": self.warned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak, self.warned = int(state["streak"]), bool(state["warned"])

    def observe(self, metrics: dict[str, float]) -> str | None:
        """The warning line, on the step the streak reaches ``k`` (once per streak)."""
        dynamic = "dynamic/zero_signal_frac_sampled" in metrics
        frac = metrics.get("dynamic/zero_signal_frac_sampled",
                           metrics.get("reward/frac_groups_zero_std"))
        if self.k == 0 or frac is None:
            return None
        if frac <= self.THRESHOLD:
            self.streak, self.warned = 0, False
            return None
        self.streak += 1
        if self.streak < self.k or self.warned:
            return None
        self.warned = True
        what = ("dynamic sampling discards most rollouts" if dynamic
                else "the update is mostly empty")
        return (f"warning: {frac:.0%} of groups had zero reward variance ({self.streak} steps "
                f"in a row above {self.THRESHOLD:.0%}): {what}; make the task easier or harder "
                "(task.levels), raise rollout.group_size, or raise rollout.temperature")
