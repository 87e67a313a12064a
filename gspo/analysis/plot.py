"""PNG figures comparing runs' ``metrics.jsonl`` (what ``gspo plot`` draws).

One figure per panel group (reward, evaluation, clipping, sequence ratio, response length,
divergence, entropy, GSPO diagnostics, MoE routing); one line per run, named by its folder.
Groups no run logged are skipped.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from gspo.config import ConfigError
from gspo.trainer.metrics import read_metrics

# (file stem, figure title, [(metric key, subplot title, y label)]). A key may hold "{}"
# filled with each run's extra keys (per-function rewards).
PANELS: list[tuple[str, str, list[tuple[str, str, str]]]] = [
    ("reward", "Reward", [
        ("reward/mean", "Mean reward per response", "reward"),
        ("reward/std_within_group", "Reward spread within a prompt's group", "std"),
        ("reward/frac_groups_zero_std", "Groups where every response got the same reward",
         "fraction of groups"),
        ("reward/{}", "Reward function: {}", "mean value"),
    ]),
    ("eval", "Held-out evaluation (greedy)", [
        ("eval/accuracy", "Accuracy on held-out prompts", "accuracy"),
        ("eval/reward_mean", "Mean reward on held-out prompts", "reward"),
    ]),
    ("clipping", "Clipping", [
        ("objective/clip_frac_seqs", "Responses clipped (sequence level)", "fraction"),
        ("objective/clip_frac_tokens", "Tokens clipped", "fraction"),
        ("objective/clip_frac_seqs_signal", "Responses clipped, among those with Â ≠ 0",
         "fraction"),
        ("objective/clip_frac_seqs_low", "Responses clipped below 1 - eps_low", "fraction"),
        ("objective/clip_frac_seqs_high", "Responses clipped above 1 + eps_high", "fraction"),
    ]),
    ("seq_ratio", r"Sequence importance ratio $s_i(\theta)$", [
        ("objective/seq_ratio_mean", "Ratio range: mean line, band from min to max", "ratio"),
        ("objective/seq_ratio_std", "Ratio spread across responses", "std"),
    ]),
    ("length", "Response length", [
        ("rollout/response_len_mean", "Mean response length", "tokens"),
        ("rollout/response_len_max", "Longest response", "tokens"),
        ("rollout/truncated_frac", "Responses cut at max_new_tokens", "fraction"),
    ]),
    ("divergence", "Divergence", [
        ("objective/approx_kl", "Approximate KL to the rollout policy", "KL"),
        ("objective/kl_ref", "KL to the reference policy", "KL"),
    ]),
    ("entropy", "Policy entropy", [
        ("train/entropy", "Mean entropy of the policy on response tokens", "nats"),
    ]),
    ("diagnostics", "GSPO diagnostics (whole step)", [
        ("diag/seq_ratio_p50", "Per-sequence ratio s_i: median, bands p10..p90 and p1..p99",
         "ratio"),
        ("diag/clip_frac_len_q1", "Tokens clipped, responses up to 1/4 of max_new_tokens",
         "fraction"),
        ("diag/clip_frac_len_q2", "Tokens clipped, responses of 1/4..1/2 of max_new_tokens",
         "fraction"),
        ("diag/clip_frac_len_q3", "Tokens clipped, responses of 1/2..3/4 of max_new_tokens",
         "fraction"),
        ("diag/clip_frac_len_q4", "Tokens clipped, responses of 3/4..all of max_new_tokens",
         "fraction"),
        ("reward/frac_groups_zero_std", "Trained groups without reward variance",
         "fraction of groups"),
        ("dynamic/zero_signal_frac_sampled", "Sampled groups without reward variance "
         "(dynamic sampling)", "fraction of groups"),
        ("dynamic/extra_batches", "Extra rollout batches drawn (dynamic sampling)", "batches"),
    ]),
    ("routing", "MoE routing", [
        ("moe/routing_change", "Expert choices that changed since the rollout policy",
         "fraction"),
        ("moe/load_balancing_loss", "Router load-balancing loss", "loss"),
        ("moe/router_entropy", "Router entropy / log E (1: uniform)", "entropy"),
        ("moe/load_imbalance", "Expert load: busiest / mean (1: balanced)", "ratio"),
    ]),
    ("routing_volatility", "MoE routing volatility: experts replaced after one update", [
        ("moe/expert_change_after_update", "All MoE layers", "fraction of experts"),
        ("moe/expert_change_layer{}_after_update", "MoE layer {}", "fraction of experts"),
    ]),
]
# reward/* keys that are statistics of the total reward, not a reward function.
_REWARD_STATS = {"mean", "std", "std_within_group", "frac_groups_zero_std", "unscorable_frac"}


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows that logged ``key`` (null values become NaN gaps)."""
    xs, ys = [], []
    for row in rows:
        if key in row:
            v = row[key]
            xs.append(float(row["step"]))
            ys.append(float(v) if isinstance(v, (int, float)) else math.nan)
    return xs, ys


def _run_labels(run_dirs: list[Path]) -> list[str]:
    """One label per run folder: its name, or as many of its last path parts as tell the
    runs apart (the same folder given twice is refused: it would draw over itself)."""
    paths = [p.resolve() for p in run_dirs]
    if len(set(paths)) < len(paths):
        twice = next(str(p) for p in paths if paths.count(p) > 1)
        raise ConfigError(f"gspo plot: run folder given twice: {twice}")
    depth = 1
    while True:
        names = ["/".join(p.parts[-depth:]) for p in paths]
        if len(set(names)) == len(names):
            return names
        depth += 1


def _expand(specs: list[tuple[str, str, str]], runs: dict[str, list[dict[str, Any]]]
            ) -> list[tuple[str, str, str]]:
    """Fill "{}" keys with the per-function reward names the runs logged; drop unlogged keys."""
    logged = {k for rows in runs.values() for row in rows for k in row}
    out = []
    for key, title, ylabel in specs:
        if "{}" in key:
            prefix, suffix = key.split("{}")
            names = {k[len(prefix):len(k) - len(suffix)] for k in logged
                     if k.startswith(prefix) and k.endswith(suffix)
                     and len(k) > len(prefix) + len(suffix)}
            extra = sorted((n for n in names if n not in _REWARD_STATS and "/" not in n),
                           key=lambda n: (0, int(n), "") if n.isdigit() else (1, 0, n))
            out += [(key.format(n), title.format(n), ylabel) for n in extra]
        elif key in logged:
            out.append((key, title, ylabel))
    return out


def _draw(ax: Any, key: str, runs: dict[str, list[dict[str, Any]]], colors: dict[str, Any]
          ) -> None:
    for label, rows in runs.items():
        xs, ys = series(rows, key)
        if not xs:
            continue
        style = "o-" if key.startswith("eval/") or len(xs) == 1 else "-"
        ax.plot(xs, ys, style, color=colors[label], label=label, linewidth=1.5, markersize=4)
        if key == "diag/seq_ratio_p50":
            for lo_key, hi_key, alpha in (("p10", "p90", 0.25), ("p01", "p99", 0.1)):
                _, lo = series(rows, f"diag/seq_ratio_{lo_key}")
                _, hi = series(rows, f"diag/seq_ratio_{hi_key}")
                if len(lo) == len(hi) == len(xs):
                    ax.fill_between(xs, lo, hi, color=colors[label], alpha=alpha, linewidth=0)
        if key == "objective/seq_ratio_mean":
            _, lo = series(rows, "objective/seq_ratio_min")
            _, hi = series(rows, "objective/seq_ratio_max")
            if len(lo) == len(hi) == len(xs):
                ax.fill_between(xs, lo, hi, color=colors[label], alpha=0.2, linewidth=0)


def plot_runs(run_dirs: list[str | Path], out: str | Path) -> list[Path]:
    """Write one PNG per panel group with data into ``out``; return their paths. A group
    with no data for these runs has its PNG removed from ``out`` (one an earlier call wrote
    would be taken for these runs')."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    dirs = [Path(d) for d in run_dirs]
    runs = dict(zip(_run_labels(dirs), (read_metrics(d) for d in dirs)))
    palette = matplotlib.colormaps["tab10"].colors
    colors = {label: palette[i % len(palette)] for i, label in enumerate(runs)}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, fig_title, specs in PANELS:
        panels = _expand(specs, runs)
        if not panels:  # a figure an earlier call left here would not show these runs
            (out / f"{stem}.png").unlink(missing_ok=True)
            continue
        ncols = min(2, len(panels))
        nrows = math.ceil(len(panels) / ncols)
        fig = Figure(figsize=(6.5 * ncols, 4.0 * nrows), layout="constrained")
        fig.suptitle(fig_title, fontsize=14)
        for i, (key, title, ylabel) in enumerate(panels):
            ax = fig.add_subplot(nrows, ncols, i + 1)
            _draw(ax, key, runs, colors)
            ax.set_title(title, fontsize=11)
            ax.set_xlabel("RL step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(title="run", fontsize=8)
        path = out / f"{stem}.png"
        fig.savefig(path, dpi=110)
        written.append(path)
    return written
