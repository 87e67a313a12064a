"""PNG plots of ``gspo compare``: per arm, the mean over seeds as a line and min..max as a band.

The x axis counts rollouts (sampled responses) seen, so runs with different batch sizes line up
by the samples they consumed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from gspo.analysis.plot import series
from gspo.trainer.metrics import read_metrics

# Not a logged key: the reward per sampled response of a step, ``dynamic/sampled_reward_mean``
# where dynamic sampling logged it (every response drawn, also those of the groups it dropped),
# else ``reward/mean`` (without dynamic sampling every sampled response is trained on).
SAMPLED_REWARD = "reward/per_sampled_response"

# (file stem, title, [(metric key, subplot title, y label, y scale)])
FIGURES: list[tuple[str, str, list[tuple[str, str, str, str]]]] = [
    ("reward", "Training reward", [
        (SAMPLED_REWARD, "Mean reward per sampled response", "reward", "linear")]),
    ("accuracy", "Held-out accuracy (greedy)", [
        ("eval/accuracy", "Accuracy on held-out problems", "accuracy", "linear")]),
    ("clipping", "Clipping", [
        ("objective/clip_frac_tokens", "Clipped-token fraction", "fraction (symlog)", "symlog")]),
    ("seq_ratio", "Sequence importance ratio s_i", [
        ("objective/seq_ratio_std", "Spread of s_i across responses", "std", "linear"),
        ("objective/token_ratio_std", "Spread of the token ratios w_it", "std", "linear")]),
    # figures below are drawn only where the runs log their keys
    ("mismatch", "Engine mismatch (π_rollout vs π_old) and policy drift (π_old vs π_θ)", [
        ("mismatch/seq_log_ratio_abs_p50", "engine: median |mean token log π_old/π_rollout|",
         "|log ρ_i| (symlog)", "symlog"),
        ("mismatch/token_log_ratio_abs_p99", "engine: p99 |token log π_old/π_rollout|",
         "|log ρ_t| (symlog)", "symlog"),
        ("drift/seq_log_ratio_abs_p50", "policy drift: median |log s_i| after the update",
         "|log s_i| (symlog)", "symlog"),
        ("drift/engine_share", "engine share of |log ρ_i| + |log s_i|", "share", "linear")]),
    ("staleness", "Asynchronous rollouts", [
        ("async/staleness_mean", "Staleness of the batch", "updates", "linear"),
        ("async/staleness_drift_abs_mean", "Staleness drift |log π_behaviour − log π_old|",
         "mean |Δ| (symlog)", "symlog")]),
]


def _samples_per_step(run_dir: Path) -> int:
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    return int(cfg["rollout"]["prompts_per_step"]) * int(cfg["rollout"]["group_size"])


def samples_seen(rows: list[dict[str, Any]], run_dir: Path) -> dict[float, float]:
    """Step -> responses sampled up to and including it: ``dynamic/responses_sampled`` summed
    where dynamic sampling logged it (its extra draws count), else prompts x group size."""
    per_step = _samples_per_step(run_dir)
    seen, total = {0.0: 0.0}, 0.0
    for row in rows:
        if "reward/mean" in row:  # one row per RL step
            total += float(row.get("dynamic/responses_sampled", per_step))
            seen[float(row["step"])] = total
    return seen


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """:func:`gspo.analysis.plot.series`, and for :data:`SAMPLED_REWARD` each step's reward per
    sampled response."""
    if key != SAMPLED_REWARD:
        return series(rows, key)
    xs, ys = [], []
    for row in rows:
        if "reward/mean" in row:
            v = row.get("dynamic/sampled_reward_mean", row["reward/mean"])
            xs.append(float(row["step"]))
            ys.append(float(v) if isinstance(v, (int, float)) else math.nan)
    return xs, ys


def band(runs: dict[int, Path], key: str, cache: dict[Path, list[dict[str, Any]]]
         ) -> tuple[list[float], list[float], list[float], list[float]]:
    """(samples, mean, min, max) over seeds at the steps where every seed logged ``key``.
    The x of a step is the seeds' mean count of sampled responses up to it (with dynamic
    sampling the seeds draw different numbers of extra batches)."""
    per_seed, seen_per_seed = [], []
    for run_dir in runs.values():
        rows = cache.setdefault(run_dir, read_metrics(run_dir))
        xs, ys = _series(rows, key)
        seen = samples_seen(rows, run_dir)
        scale = _samples_per_step(run_dir)
        per_seed.append({x: y for x, y in zip(xs, ys) if math.isfinite(y)})
        seen_per_seed.append({x: seen.get(x, x * scale) for x in xs})
    steps = sorted(set.intersection(*(set(d) for d in per_seed))) if per_seed else []
    xs = [sum(s[x] for s in seen_per_seed) / len(seen_per_seed) for x in steps]
    mean = [sum(d[x] for d in per_seed) / len(per_seed) for x in steps]
    return xs, mean, [min(d[x] for d in per_seed) for x in steps], \
        [max(d[x] for d in per_seed) for x in steps]


def _draw(ax: Any, key: str, labels: dict[str, str], runs: dict[str, dict[int, Path]],
          colors: dict[str, Any], cache: dict[Path, list[dict[str, Any]]]) -> bool:
    drawn = False
    for i, (arm, arm_runs) in enumerate(runs.items()):
        xs, mean, lo, hi = band(arm_runs, key, cache)
        if not xs:
            continue
        # distinct dashes: arms that coincide (GSPO and GSPO-token) stay visible
        style = ("o" if key.startswith("eval/") else "") + ["-", "--", "-.", ":"][i % 4]
        ax.plot(xs, mean, style, color=colors[arm], label=labels[arm], linewidth=1.5,
                markersize=4)
        ax.fill_between(xs, lo, hi, color=colors[arm], alpha=0.2, linewidth=0)
        drawn = True
    return drawn


def _figure(stem: str, title: str, panels: list[tuple[str, str, str, str]],
            labels: dict[str, str], runs: dict[str, dict[int, Path]], out: Path,
            cache: dict[Path, list[dict[str, Any]]], n_seeds: int) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    palette = matplotlib.colormaps["tab10"].colors
    colors = {arm: palette[i % len(palette)] for i, arm in enumerate(runs)}
    ncols = min(2, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(6.5 * ncols, 4.2 * nrows), layout="constrained")
    fig.suptitle(f"{title} (line: mean over {n_seeds} seeds; band: min..max)", fontsize=12)
    drawn = False
    for i, (key, sub, ylabel, scale) in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        if _draw(ax, key, labels, runs, colors, cache):
            drawn = True
            ax.legend(fontsize=8)
        if scale == "symlog":
            ax.set_yscale("symlog", linthresh=1e-4)
        ax.set_title(sub, fontsize=10)
        ax.set_xlabel("samples (sampled responses)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    if not drawn:
        return None
    path = out / f"{stem}.png"
    fig.savefig(path, dpi=100)
    return path


def plot_compare(summary: dict[str, Any], runs: dict[str, dict[int, Path]],
                 out: Path) -> list[Path]:
    """Write the comparison's PNGs into ``out``; returns their paths. A figure no run has
    data for is not drawn, and one of that name an earlier call wrote is removed."""
    labels = {name: arm["label"] for name, arm in summary["arms"].items()}
    cache: dict[Path, list[dict[str, Any]]] = {}
    n_seeds = len(summary["seeds"])
    figures = list(FIGURES)
    first = next(iter(next(iter(runs.values())).values()))
    logged = {k for row in read_metrics(first) for k in row}
    layers = sorted((k for k in logged if k.startswith("moe/routing_change_layer")
                     and k.removeprefix("moe/routing_change_layer").isdigit()),
                    key=lambda k: int(k.removeprefix("moe/routing_change_layer")))
    if layers:
        figures.append(("routing", "MoE routing change since π_old, per layer", [
            (k, f"MoE layer {k.removeprefix('moe/routing_change_layer')}",
             "fraction of tokens", "linear") for k in layers]))
    paths = []
    for stem, title, panels in figures:
        path = _figure(stem, title, panels, labels, runs, out, cache, n_seeds)
        if path is not None:
            paths.append(path)
    # a figure an earlier report left here (another comparison's, or these arms' before a
    # change) would be taken for these runs'
    for stem in {stem for stem, _, _ in FIGURES} | {"routing"}:
        if out / f"{stem}.png" not in paths:
            (out / f"{stem}.png").unlink(missing_ok=True)
    return paths
