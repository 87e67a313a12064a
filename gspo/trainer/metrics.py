"""Per-step metrics: ``metrics.jsonl`` always, TensorBoard when asked for."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from gspo.data import DataError
from gspo.rollout.batch import policy_tokens
from gspo.trainer.checkpoint import atomic_write_text


def to_float(v: Any) -> float:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().item())
    return float(v)


# How each stat of a minibatch is a mean, which decides how minibatches and ranks combine it.
# Every stat declares one (objectives: gspo.objectives.STAT_KINDS; the update, the MoE hooks:
# their own tables); nothing is guessed from a key's name.
#   rows    mean over the valid rows           tokens  mean over response tokens
#   signal_rows / signal_tokens               the same over the rows with Â_i ≠ 0 only
#   weight  Σ w_i x_i / Σ w_i, the objective's row weights
#   rank    each rank's own value, averaged over ranks
#   min / max                                  std     pooled with its ``*_mean`` (same kind)
KINDS = ("rows", "tokens", "signal_rows", "signal_tokens", "weight", "rank", "min", "max", "std")


def stat_kind(key: str, kinds: Mapping[str, str]) -> str:
    """The declared reduction of ``key``; an undeclared stat is an error, not a guess."""
    try:
        return kinds[key]
    except KeyError:
        raise KeyError(f"stat {key!r} declares no reduction kind (one of {', '.join(KINDS)})"
                       ) from None


def max_over_ranks(metrics: dict[str, float], dist: Any) -> dict[str, float]:
    """Each value's maximum over ranks (one all-reduce; every rank passes the same keys). For
    the timings of what each rank runs on its own and the step waits for, e.g. its rollout
    engine's: the slowest rank's, where logging rank 0's would hide a slow engine elsewhere."""
    if not metrics or not dist.enabled:
        return metrics
    keys = sorted(metrics)
    top = dist.all_reduce(torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64),
                          "max")
    return dict(zip(keys, top.tolist()))


def mean_stats(stats: list[dict[str, torch.Tensor]], kinds: Mapping[str, str],
               counts: list[dict[str, float]] | None = None) -> dict[str, float]:
    """Combine each key over minibatches: min/max kinds take the min/max, the ``signal_*``
    kinds a mean weighted by each minibatch's rows (tokens) with signal, given ``counts`` (a
    minibatch without any adds nothing; 0 when no minibatch has one), the others the plain
    mean; one host sync. Given ``counts``, a minibatch without a valid row (every row masked,
    e.g. by ``rollout.mask_truncated``) adds nothing to any kind but ``rank``: its stats are
    placeholders (0, or ±inf for an extreme over ranks), not values of any row."""
    if not stats:
        return {}
    out: dict[str, float] = {}
    for key in stats[0]:
        kind = stat_kind(key, kinds)
        rows = stats
        if counts is not None and kind != "rank" and not kind.startswith("signal_"):
            rows = [s for s, c in zip(stats, counts) if c["rows"] > 0]
            if not rows:
                out[key] = 0.0
                continue
        values = torch.stack([s[key].detach().float() for s in rows])
        if kind == "min":
            out[key] = float(values.min())
        elif kind == "max":
            out[key] = float(values.max())
        elif kind.startswith("signal_") and counts is not None:
            n = torch.tensor([c[kind] for c in counts], dtype=torch.float64)
            out[key] = float((values.double() * n).sum() / n.sum()) if n.sum() > 0 else 0.0
        else:
            out[key] = float(values.mean())
    return out


def reduce_stats(stats: list[dict[str, torch.Tensor]], counts: list[dict[str, float]],
                 all_reduce: Callable[[torch.Tensor, str], torch.Tensor],
                 kinds: Mapping[str, str]) -> list[dict[str, torch.Tensor]]:
    """Global per-minibatch stats from each rank's stats of its own rows (two all-reduces).

    ``counts[m]`` holds this rank's ``rows`` (valid rows), ``tokens`` (response tokens),
    ``signal_rows`` / ``signal_tokens`` (those of rows with Â_i ≠ 0) and ``weight`` (Σ w_i of
    the objective's mean) in minibatch m; a rank without rows there has zeros. ``kinds``
    declares each key's reduction (see :data:`KINDS`): means over rows or tokens (with
    signal or all) become count-weighted means, the losses Σ w·loss / Σ w, min / max the min / max
    over ranks, and std the pooled std (exact when the matching ``*_mean`` is in the stats,
    else the root of the mean within-rank variance; weighted like that mean).
    """
    if not stats:
        return stats
    keys = sorted(stats[0])
    kind_of = {k: stat_kind(k, kinds) for k in keys}
    for k in keys:  # a std is pooled with its mean's counts
        if kind_of[k] == "std":
            kind_of[k] = stat_kind(k[:-4] + "_mean", kinds)
            kind_of[k + "/std"] = "std"
    sums, extremes = [], []
    for s, c in zip(stats, counts):
        n = {**c, "rank": float(c["rows"] > 0)}
        has_rows = c["rows"] > 0
        for k in keys:
            v, kind = float(s[k]), kind_of[k]
            if kind in ("max", "min"):
                extremes.append((v if kind == "max" else -v) if has_rows else -math.inf)
                continue
            if k + "/std" in kind_of:
                mean = float(s.get(k[:-4] + "_mean", torch.tensor(0.0)))
                v = v * v + mean * mean
            sums += [v * n[kind], n[kind]]
    total = all_reduce(torch.tensor(sums, dtype=torch.float64), "sum").tolist()
    top = all_reduce(torch.tensor(extremes or [0.0], dtype=torch.float64), "max").tolist()
    out: list[dict[str, torch.Tensor]] = []
    for _ in stats:
        row: dict[str, float] = {}
        for k in keys:
            kind = kind_of[k]
            if kind in ("max", "min"):
                row[k] = top.pop(0) * (1 if kind == "max" else -1)
                continue
            weighted, n = total.pop(0), total.pop(0)
            row[k] = weighted / n if n > 0 else 0.0
        for k in keys:  # E[x²] − E[x]² for the pooled stds, now that the means are global
            if k + "/std" in kind_of:
                mean = row.get(k[:-4] + "_mean", 0.0)
                row[k] = math.sqrt(max(row[k] - mean * mean, 0.0))
        out.append({k: torch.tensor(v, dtype=torch.float32) for k, v in row.items()})
    return out


def _is_main_process() -> bool:
    """False on ranks > 0 of a torch.distributed job: only rank 0 writes logs."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()
                and torch.distributed.get_rank() != 0)


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool | str = False,
                 resume_step: int = -1) -> None:
        """``tensorboard``: ``"auto"`` writes event files when TensorBoard is installed and says
        nothing otherwise; ``"on"`` / ``True`` prints one line when it is missing (the user
        asked for it); ``"off"`` / ``False`` never writes them."""
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        self.enabled = _is_main_process()
        if not self.enabled:
            return
        if resume_step >= 0 and self.path.is_file():
            # Drop lines logged after the checkpoint we resume from: they will be redone. The
            # file is replaced whole, and only when a line goes: a kill while it is written
            # must not empty the run's log.
            lines = self.path.read_text().splitlines()
            kept = [ln for ln in lines
                    if ln.strip() and json.loads(ln).get("step", -1) <= resume_step]
            if kept != lines:
                atomic_write_text(self.path, "".join(ln + "\n" for ln in kept))
        mode = {True: "on", False: "off"}.get(tensorboard, tensorboard)
        if mode != "off":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # optional extra: mention it only when it was asked for
                if mode == "on":
                    print("tensorboard is not installed; logging to metrics.jsonl only")
            else:
                # resumed: TensorBoard hides what the earlier event files hold past the
                # checkpoint (those steps are redone), as the lines of metrics.jsonl are cut
                self.tb = SummaryWriter(str(run_dir / "tensorboard"),
                                        purge_step=resume_step + 1 if resume_step >= 0 else None)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
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


def reward_part_metrics(parts: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """``reward/<name>``: each reward function's mean over the scorable responses of ``parts``
    (its values of the global batch's rows; NaN when it scored none of them); with one
    function, nothing (``reward/mean`` is its value times its weight)."""
    if len(parts) < 2:
        return {}
    return {f"reward/{k}": float(v.nanmean()) for k, v in parts.items()}


def rollout_metrics(roll: Any, batch: dict[str, torch.Tensor], entropy: torch.Tensor | None,
                    gap: torch.Tensor | None, t: dict[str, float], epochs: int,
                    dist: Any, sampled_tokens: float | None = None,
                    stand_ins: torch.Tensor | None = None) -> dict[str, float]:
    """Entropy, response and prompt lengths, truncation, sampler/trainer log-prob gap and
    throughput over the global batch (sums and maxima all-reduced over ``dist``; times are
    this rank's). Entropy and gap come from the π_old pass; on a step without one they are
    not logged, each apart (async: the gap is the engine's against the pass on the behaviour
    weights, which a step may lack while its pass on this step's weights gives the entropy).
    Entropy is a mean over the tokens of ``batch["response_mask"]``: NaN (``null`` in metrics.jsonl)
    when it holds none (``rollout.mask_truncated`` with every response truncated), and so is
    the gap, then measured on no token.
    ``sampled_tokens``: the global count of tokens the policy sampled in ``t["rollout"]``
    (dynamic sampling's discarded draws included); default the batch's. Either way a
    multi-turn episode's observation tokens are not counted: the environment wrote them.
    ``stand_ins``: [len(roll)] bool, dynamic sampling's stand-in rows under torchrun (see
    :meth:`gspo.trainer.Trainer.refill`): the lengths, truncation and update throughput leave
    them out, as one process, which has none, does (``response_mask`` has them masked)."""
    mask = batch["response_mask"]
    lengths = torch.tensor([len(r) for r in roll.response_ids], dtype=torch.float64)
    prompt_lengths = torch.tensor([len(p) for p in roll.prompt_ids], dtype=torch.float64)
    cut = torch.tensor(roll.truncated, dtype=torch.float64)
    attended = batch["attention_mask"]
    if stand_ins is not None:
        keep = ~stand_ins.cpu()
        lengths, prompt_lengths, cut = lengths[keep], prompt_lengths[keep], cut[keep]
        attended = attended[keep.to(attended.device)]
    no_entropy, no_gap = entropy is None, gap is None
    if no_entropy:
        entropy = torch.zeros_like(mask)
    if no_gap:
        gap = torch.zeros(1)
    sums = dist.all_reduce(torch.stack([
        (entropy * mask).sum().double().cpu(), mask.sum().double().cpu(), lengths.sum(),
        prompt_lengths.sum(), torch.tensor(float(len(lengths)), dtype=torch.float64), cut.sum(),
        attended.sum().double().cpu(),
        torch.tensor(float(sum(policy_tokens(roll.response_ids, roll.model_mask))),
                     dtype=torch.float64)]))
    ent, n_tok, len_sum, prompt_sum, n_rows, truncated, n_tokens, n_policy = sums.tolist()
    none = torch.zeros((), dtype=torch.float64)  # a rank whose rows are all stand-ins
    len_max, prompt_max, gap_max = dist.all_reduce(torch.stack([
        lengths.max() if len(lengths) else none,
        prompt_lengths.max() if len(prompt_lengths) else none,
        gap.abs().max().double().cpu()]), "max").tolist()
    out = {
        "rollout/response_len_mean": len_sum / n_rows,
        "rollout/response_len_max": len_max,
        # the prompts as the policy reads them (chat template and system prompt included)
        "rollout/prompt_len_mean": prompt_sum / n_rows,
        "rollout/prompt_len_max": prompt_max,
        "rollout/truncated_frac": truncated / n_rows,
        "perf/rollout_tokens_per_s": (n_policy if sampled_tokens is None else sampled_tokens)
        / max(t["rollout"], 1e-9),
        "perf/update_tokens_per_s": n_tokens * epochs / max(t["update"], 1e-9),
    }
    if not no_entropy:
        out["train/entropy"] = ent / n_tok if n_tok > 0 else math.nan
    if not no_gap:
        out["rollout/logprob_gap_abs_max"] = gap_max if n_tok > 0 else math.nan
    return out


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Rows of ``run_dir/metrics.jsonl``; a torn last line (a run killed while writing it) is
    skipped. Any other line that is not a JSON row with a step is a :class:`DataError` naming
    it: the file was damaged, and results read from it would silently lack those steps."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            rows.append(row)
        elif i < len(lines) - 1 and line.strip():
            raise DataError(f"{path}: line {i + 1} is not a metrics row with a step: "
                            f"{line[:60]!r}")
    return rows
