"""The report of ``gspo compare``: per-arm statistics over seeds, a markdown table, PNG plots.

Per run (definitions used in the table):

* final reward: mean training reward (``reward/mean``) over the last quarter of the steps;
* held-out accuracy: greedy accuracy on the task's held-out problems before / after training;
* clipped tokens: ``objective/clip_frac_tokens`` averaged over all steps (GSPO counts every
  token of a clipped sequence);
* clipped sequences among rows with signal: ``objective/clip_frac_seqs_signal``, the clipped
  share of the rows whose advantage is not 0, averaged over all steps. The plain fractions
  count zero-advantage rows, which are never clipped, so they fall as more groups carry no
  signal; this one compares runs with different shares of such groups (dynamic sampling);
* routing change: ``moe/routing_change`` averaged over all steps: the share of (response token,
  MoE layer) whose top-k expert set under π_θ differs from π_old's, measured in every
  minibatch before its optimizer step (the first minibatch of a batch always measures 0);
* routing change after an update: ``moe/routing_change_after_update``, the same over the
  minibatches that follow at least one optimizer step on their rollout batch (the paper's
  "after each gradient update" quantity, not diluted by the first minibatch's 0);
* sequence-ratio spread: ``objective/seq_ratio_std`` averaged over all steps (token-ratio
  spread ``objective/token_ratio_std`` likewise);
* reward per sampled response: ``dynamic/sampled_reward_mean`` (dynamic sampling: every
  response sampled, also those of dropped groups; without it ``reward/mean`` is that already);
* engine mismatch, policy drift, staleness: step means of ``mismatch/*``, ``drift/*`` and
  ``async/*`` (see docs/corrections.md and docs/scaling.md);
* wall time of the run, start to end: loading the model, rollouts, updates, evaluations and
  checkpoints.

Each arm's cell is the mean ± sample standard deviation over the seeds that have a value;
``(n=k/N)`` follows it when only k of the arm's N seeds have one, and the sd is ``—`` when only
one has. Plots draw the mean over seeds as a line and the min..max over seeds as a shaded band.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import yaml

from gspo.analysis.report_plots import plot_compare
from gspo.config import ConfigError
from gspo.trainer.checkpoint import atomic_write_text
from gspo.trainer.metrics import read_metrics

DONE = "compare.json"  # written into a run folder (atomically) once its run finished

# (summary key, column title); a column no run logs (e.g. routing for a dense policy) is left
# out of the tables.
COLUMNS: list[tuple[str, str]] = [
    ("final_reward", "final reward"),
    ("sampled_reward", "reward per sampled response"),
    ("accuracy_after", "held-out accuracy after"),
    ("clip_frac_tokens", "clipped-token fraction"),
    ("clip_frac_seqs", "clipped-sequence fraction"),
    ("clip_frac_seqs_signal", "clipped-sequence fraction, rows with Â ≠ 0"),
    ("routing_change", "routing-change fraction"),
    ("routing_change_after_update", "routing change after an update"),
    ("expert_change", "experts replaced vs π_old"),
    ("token_ratio_std", "token-ratio std"),
    ("seq_ratio_std", "sequence-ratio std"),
    ("mismatch_seq_p50", "engine mismatch, median abs log ρ_i"),
    ("mismatch_token_p99", "engine mismatch, p99 abs log ρ_t"),
    ("mismatch_k3", "k3 KL(π_rollout‖π_old)"),
    ("drift_seq_p50", "policy drift, median abs log s_i"),
    ("engine_share", "engine share of the drift"),
    ("staleness", "staleness (updates)"),
    ("staleness_drift", "staleness drift, mean abs Δ log π_i"),
    ("staleness_routing", "expert sets moved by staleness"),
    ("staleness_experts", "experts replaced by staleness"),
    ("async_engine_mismatch", "async engine mismatch, max abs log ρ_i"),
    ("reward_per_s", "reward per second of training"),
    ("response_len", "response length"),
    ("entropy", "entropy"),
    ("wall_s", "wall time / run (s)"),
]
_STEP_MEANS = {"clip_frac_tokens": "objective/clip_frac_tokens",
               "clip_frac_seqs": "objective/clip_frac_seqs",
               "clip_frac_seqs_signal": "objective/clip_frac_seqs_signal",
               "sampled_reward": "dynamic/sampled_reward_mean",
               "routing_change": "moe/routing_change",
               "routing_change_after_update": "moe/routing_change_after_update",
               "expert_change": "moe/expert_change",
               "token_ratio_std": "objective/token_ratio_std",
               "seq_ratio_std": "objective/seq_ratio_std",
               "mismatch_seq_p50": "mismatch/seq_log_ratio_abs_p50",
               "mismatch_token_p99": "mismatch/token_log_ratio_abs_p99",
               "mismatch_k3": "mismatch/k3_kl",
               "drift_seq_p50": "drift/seq_log_ratio_abs_p50",
               "engine_share": "drift/engine_share",
               "staleness": "async/staleness_mean",
               "staleness_drift": "async/staleness_drift_abs_mean",
               "staleness_routing": "async/staleness_routing_change",
               "staleness_experts": "async/staleness_expert_change",
               "async_engine_mismatch": "async/engine_mismatch_abs_max",
               "response_len": "rollout/response_len_mean",
               "entropy": "train/entropy"}


def _mean(values: list[float]) -> float:
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan


def read_done(run_dir: Path) -> dict[str, Any] | None:
    """The ``compare.json`` of a finished run; None when the run has none, or one that cannot
    be read or parsed (the run did not finish: it counts as unfinished)."""
    try:
        done = json.loads((run_dir / DONE).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return done if isinstance(done, dict) else None


def summarize_run(run_dir: Path) -> dict[str, float]:
    done = read_done(run_dir)
    if done is None or "wall_s" not in done:
        raise ConfigError(f"{run_dir}: not a finished run of gspo compare ({DONE} missing or "
                          f"unreadable); rerun the comparison to finish it")
    rows = read_metrics(run_dir)
    train = [r for r in rows if "reward/mean" in r]
    last = train[-max(1, len(train) // 4):]
    out = {"final_reward": _mean([r["reward/mean"] for r in last]),
           "first_reward": _mean([r["reward/mean"] for r in train[:max(1, len(train) // 4)]]),
           "accuracy_before": (done.get("before") or {}).get("accuracy", math.nan),
           "accuracy_after": (done.get("after") or {}).get("accuracy", math.nan),
           "wall_s": done["wall_s"], "steps": len(train)}
    for name, key in _STEP_MEANS.items():
        out[name] = _mean([r.get(key) for r in train])
    if math.isnan(out["sampled_reward"]):  # no dynamic sampling: every response is trained on
        out["sampled_reward"] = _mean([r["reward/mean"] for r in train])
    out["reward_per_s"] = _reward_per_second(run_dir, train)
    return out


# Timings of work beside the trainer's, which overlap its phases: the async engine's own
# sampling, and the broadcast of the weights to an engine started elsewhere.
OVERLAPPING = ("time/rollout_engine_s", "time/publish_send_s")


def step_seconds(row: dict[str, Any]) -> float:
    """The trainer's wall seconds for one logged step: the sum of its ``time/*_s`` phases,
    without the timings of work that overlaps them (:data:`OVERLAPPING`)."""
    return sum(v for k, v in row.items() if k.startswith("time/") and k.endswith("_s")
               and k not in OVERLAPPING and isinstance(v, (int, float)))


def _reward_per_second(run_dir: Path, train: list[dict[str, Any]]) -> float:
    """Reward collected per second of the steps themselves: Σ_steps mean reward × responses
    scored / Σ_steps :func:`step_seconds` (start-up and evaluations left out). Dynamic
    sampling scores more responses than a batch holds: its ``dynamic/groups_sampled`` counts."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    group = cfg["rollout"]["group_size"]
    reward = seconds = 0.0
    for r in train:
        groups = r.get("dynamic/groups_sampled", cfg["rollout"]["prompts_per_step"])
        mean = r.get("dynamic/sampled_reward_mean", r["reward/mean"])
        # a step where no response could be scored (reward.max_unscorable_frac=1) collected
        # nothing: dynamic sampling's mean over no response is null there (reward/mean is 0)
        if isinstance(mean, (int, float)) and math.isfinite(mean):
            reward += mean * groups * group
        seconds += step_seconds(r)
    return reward / seconds if seconds > 0 else math.nan


def _stats(values: list[float]) -> dict[str, float]:
    """Mean, sample sd (NaN for one value), min, max over the finite ``values``; ``n`` of the
    ``of`` values given were finite (a seed whose run did not log the measure has NaN)."""
    v = [x for x in values if isinstance(x, (int, float)) and math.isfinite(x)]
    if not v:
        return {"mean": math.nan, "sd": math.nan, "min": math.nan, "max": math.nan, "n": 0,
                "of": len(values)}
    sd = statistics.stdev(v) if len(v) > 1 else math.nan
    return {"mean": sum(v) / len(v), "sd": sd, "min": min(v), "max": max(v), "n": len(v),
            "of": len(values)}


def summarize(spec: Any, runs: dict[str, dict[int, Path]],
              probes: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per-run and per-arm (over seeds) statistics, plus the first-update routing probe."""
    arms = {}
    for arm in spec.arms:
        per_seed = {seed: summarize_run(d) for seed, d in runs[arm.name].items()}
        keys = per_seed[next(iter(per_seed))].keys()
        # over the comparison's seeds: a seed without a finished run (a partial report) is a
        # seed without a value, counted in the cell's (n=k/N)
        seeds = [*spec.seeds, *(s for s in per_seed if s not in spec.seeds)]
        arms[arm.name] = {"label": arm.label, "overrides": arm.overrides, "runs": per_seed,
                          "stats": {k: _stats([per_seed[s][k] if s in per_seed else math.nan
                                               for s in seeds]) for k in keys}}
    probe_values = [p for p in probes.values() if p]
    probe = {}
    if probe_values:
        probe = {k: _stats([p[k] for p in probe_values])
                 for k in ("token_change", "expert_change")}
        probe["per_seed"] = {str(s): p for s, p in probes.items()}
    first_cfg = next(iter(next(iter(runs.values())).values())) / "config.yaml"
    return {"spec": str(spec.path), "seeds": spec.seeds, "arms": arms, "probe": probe,
            "base_config": first_cfg.read_text(),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg")
                        else None}}


def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return "n/a"
    if x != 0 and abs(x) < 0.01:
        return f"{x:.1e}"
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3f}"


def _cell(s: dict[str, float], digits: int | None = None) -> str:
    """``mean ± sd``; the sd in the mean's notation so the two read together, ``—`` when one
    value has none; ``(n=k/N)`` after it when only k of the N values were finite."""
    n = int(s["n"])
    if not n:
        return "n/a"
    m, sd = s["mean"], s["sd"]
    if digits is None and m != 0 and abs(m) < 0.01:
        text = f"{m:.1e} ± " + ("—" if n == 1 else f"{sd:.0e}")
    else:
        d = 3 if digits is None else digits
        text = f"{m:.{d}f} ± " + ("—" if n == 1 else f"{sd:.{d}f}")
    of = int(s.get("of", n))
    return text + (f" (n={n}/{of})" if n < of else "")


def _logged(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The columns some run of the comparison has a value for."""
    return [(key, title) for key, title in COLUMNS
            if any(arm["stats"].get(key, {}).get("n") for arm in summary["arms"].values())]


def markdown_table(summary: dict[str, Any]) -> str:
    columns = _logged(summary)
    head = ["arm", *(title for _, title in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in summary["arms"].values():
        cells = [_cell(arm["stats"][key], 0 if key == "wall_s" else None) for key, _ in columns]
        lines.append("| " + " | ".join([_escape(arm["label"]), *cells]) + " |")
    return "\n".join(lines)


def _escape(label: str) -> str:
    """An arm's label as one markdown table cell (a ``|`` in it would start another)."""
    return label.replace("|", "\\|")


def _per_seed_table(summary: dict[str, Any]) -> str:
    logged = {key for key, _ in _logged(summary)}
    keys = [k for k in ("first_reward", "final_reward", "sampled_reward", "accuracy_before",
                        "accuracy_after", "clip_frac_tokens", "routing_change",
                        "routing_change_after_update", "seq_ratio_std", "mismatch_seq_p50",
                        "drift_seq_p50", "staleness", "wall_s")
            if k in logged or k in ("first_reward", "accuracy_before")]
    lines = ["| arm | seed | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 2)]
    for arm in summary["arms"].values():
        for seed, r in arm["runs"].items():
            lines.append(f"| {_escape(arm['label'])} | {seed} | "
                         + " | ".join(_fmt(r[k]) for k in keys) + " |")
    return "\n".join(lines)


def _start_text(summary: dict[str, Any]) -> str:
    """What every arm starts from (same initial policy and evaluation set per seed): the
    held-out accuracy before training once per seed, from the first arm that has a value for
    it (an arm may lack a seed's run: ``scripts/compare_report.py --partial``)."""
    runs = [r for arm in summary["arms"].values() for r in arm["runs"].values()]
    per_seed: dict[Any, float] = {}
    for arm in summary["arms"].values():
        for seed, r in arm["runs"].items():
            if math.isfinite(r["accuracy_before"]):
                per_seed.setdefault(seed, r["accuracy_before"])
    before = _stats([per_seed.get(seed, math.nan) for seed in summary["seeds"]])
    first = _stats([r["first_reward"] for r in runs])
    minutes = sum(r["wall_s"] for r in runs) / 60
    return (f"Before RL (shared by every arm): held-out accuracy {_cell(before)}. Over the "
            f"first quarter of the steps, already training: mean training reward "
            f"(`reward/mean`, as the final reward) {_cell(first)} (all runs of every arm). "
            f"Sum of the runs' wall times: {minutes:.1f} min.")


def _probe_text(probe: dict[str, Any]) -> str:
    if not probe:
        return "No routing probe (the policy is not a Mixture-of-Experts model)."
    t, e = probe["token_change"], probe["expert_change"]
    return (f"After one optimizer step from the initial policy (one minibatch), "
            f"{_cell(e)} of the experts chosen under π_old were replaced ({_cell(t)} of "
            f"(response token, MoE layer) pairs changed their expert set), over {t['n']} seeds.")


def write_report(summary: dict[str, Any], runs: dict[str, dict[int, Path]],
                 out_dir: Path) -> list[Path]:
    """``results.md``, ``summary.json`` and the PNGs; returns the PNG paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pngs = plot_compare(summary, runs, out_dir)
    images = "\n".join(f"![{p.stem}]({p.name})" for p in pngs)
    text = "\n\n".join([
        "# gspo compare", f"Command: `{summary['command']}`" if summary.get("command") else "",
        f"Seeds: {summary['seeds']}. This invocation took {summary['total_wall_s'] / 60:.1f} min "
        f"(finished runs are reused, not rerun) on {summary['machine']['cpus']} CPUs, load "
        f"average at the end {summary['machine']['load_average']}.",
        "Mean ± standard deviation over seeds (definitions: gspo/analysis/report.py); "
        "(n=k/N): only k of the N seeds have a value, the mean and sd are over those k; "
        "—: one value, no standard deviation.",
        markdown_table(summary), _start_text(summary), "## Routing drift after one update",
        _probe_text(summary["probe"]),
        "## Per seed", _per_seed_table(summary), "## Plots", images,
        "## Base run config", f"```yaml\n{summary['base_config']}```"])
    atomic_write_text(out_dir / "results.md", text + "\n")
    atomic_write_text(out_dir / "summary.json",
                      json.dumps(_finite_or_null(summary), indent=2, default=str, allow_nan=False))
    return pngs


def _finite_or_null(value: Any) -> Any:
    """``value`` with every NaN or infinite float as None: ``summary.json`` is strict JSON
    (``null`` where a seed's figure is missing or a spread needs two seeds), as
    ``metrics.jsonl`` is, which JavaScript's ``JSON.parse`` and other strict readers accept."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value
