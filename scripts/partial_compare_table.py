"""One Markdown table from run folders of a comparison, finished or not.

``gspo compare`` reports only complete comparisons (every arm, every seed, every step). A run
cut short (a deadline, a crash) still logged every step it took in ``metrics.jsonl``; this
script tabulates those steps, one row per run, and the routing probes (``probe_s*``):

    python scripts/partial_compare_table.py results/moe_upcycled_gpu/run_metrics > table.md

Each run folder holds ``config.yaml`` and ``metrics.jsonl`` (or ``metrics.jsonl.gz``); a probe
folder holds the probe's ``compare.json``. Columns: steps done, held-out accuracy at each
evaluation, mean reward per sampled response over steps 1-10 / 11-20 / the last 10, token and
sequence clip fractions, the share of π_old's experts replaced after one update (first five
steps, all steps), grad norm, response length and the median seconds per step. Then a
per-arm summary (mean ± std over the arm's runs, folders named ``<arm>_s<seed>``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from gspo.analysis.report import read_done, step_seconds


def read_metrics(run: Path) -> list[dict[str, Any]]:
    plain, packed = run / "metrics.jsonl", run / "metrics.jsonl.gz"
    text = (plain.read_text() if plain.is_file()
            else gzip.decompress(packed.read_bytes()).decode() if packed.is_file() else "")
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.mean(vals) if vals else float("nan")


def run_values(run: Path) -> dict[str, float] | None:
    """The numbers one run contributes to the per-arm summary (None: no step taken)."""
    rows = read_metrics(run)
    steps = [r for r in rows if "train/loss" in r]
    if not steps:
        return None
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    return {"steps": len(steps), "acc_before": evals[0] if evals else float("nan"),
            "acc_last": evals[-1] if len(evals) > 1 else float("nan"),
            "reward_all": _mean(steps, "reward/mean"),
            "reward_last10": _mean(steps[-10:], "reward/mean"),
            "clip_tokens": _mean(steps, "objective/clip_frac_tokens"),
            "clip_seqs": _mean(steps, "objective/clip_frac_seqs"),
            "experts_replaced": _mean(steps, "moe/expert_change_after_update"),
            "seq_ratio_std": _mean(steps, "objective/seq_ratio_std"),
            "grad_norm": _mean(steps, "train/grad_norm")}


SUMMARY = [("acc_before", "held-out before", ".3f"),
           ("acc_last", "held-out at the last eval", ".3f"),
           ("reward_all", "reward, all steps", ".3f"), ("reward_last10", "reward, last 10", ".3f"),
           ("clip_tokens", "clip frac tokens", ".4f"), ("clip_seqs", "clip frac seqs", ".4f"),
           ("experts_replaced", "experts replaced per update", ".4f"),
           ("seq_ratio_std", "seq-ratio std", ".2e"), ("grad_norm", "grad norm", ".3f")]


def arm_summary(folders: list[Path]) -> list[str]:
    """Mean ± std over seeds per arm (folders named ``<arm>_s<seed>``)."""
    by_arm: dict[str, list[dict[str, float]]] = {}
    for f in folders:
        v = run_values(f)
        if v is not None:
            by_arm.setdefault(f.name.rsplit("_s", 1)[0], []).append(v)
    out = ["| arm | runs (steps) | " + " | ".join(t for _, t, _ in SUMMARY) + " |",
           "|---" * (len(SUMMARY) + 2) + "|"]
    for arm, vals in by_arm.items():
        cells = []
        for key, _, fmt in SUMMARY:
            xs = [v[key] for v in vals if v[key] == v[key]]
            sd = f" ± {statistics.stdev(xs):{fmt}}" if len(xs) > 1 else ""
            cells.append(f"{statistics.mean(xs):{fmt}}{sd}" if xs else "—")
        steps = ",".join(str(v["steps"]) for v in vals)
        out.append(f"| {arm} | {len(vals)} ({steps}) | " + " | ".join(cells) + " |")
    return out


def run_row(run: Path) -> str | None:
    rows = read_metrics(run)
    steps = [r for r in rows if "train/loss" in r]
    if not steps:
        return None
    evals = " / ".join(f"{r['eval/accuracy']:.1%} @{r.get('step', '?')}" for r in rows
                       if "eval/accuracy" in r)
    step_s = statistics.median(step_seconds(r) for r in steps)
    cells = [run.name, str(len(steps)), evals or "—",
             f"{_mean(steps[:10], 'reward/mean'):.3f}", f"{_mean(steps[10:20], 'reward/mean'):.3f}",
             f"{_mean(steps[-10:], 'reward/mean'):.3f}",
             f"{_mean(steps, 'objective/clip_frac_tokens'):.4f}",
             f"{_mean(steps, 'objective/clip_frac_seqs'):.4f}",
             f"{_mean(steps[:5], 'moe/expert_change_after_update'):.2%}",
             f"{_mean(steps, 'moe/expert_change_after_update'):.2%}",
             f"{_mean(steps, 'train/grad_norm'):.3f}",
             f"{_mean(steps, 'rollout/response_len_mean'):.1f}", f"{step_s:.2f}"]
    return "| " + " | ".join(cells) + " |"


def probe_row(probe: Path) -> str:
    res = read_done(probe)
    if res is None:
        return f"| {probe.name} | unfinished |  |"
    per_layer = res.get("expert_change_per_layer") or [0.0]
    worst = max(range(len(per_layer)), key=per_layer.__getitem__)
    return (f"| {probe.name} | {res['expert_change']:.2%} | {per_layer[worst]:.2%} "
            f"(layer {worst}) | {res['token_change']:.2%} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", help="folder searched (recursively) for run and probe folders")
    args = p.parse_args(argv)
    root = Path(args.root)
    folders = sorted({f.parent for pat in ("metrics.jsonl", "metrics.jsonl.gz", "compare.json")
                      for f in root.rglob(pat)})
    runs = [r for r in (run_row(f) for f in folders if not f.name.startswith("probe_")) if r]
    probes = {f.name: f for f in folders if f.name.startswith("probe_")}  # one per seed
    print("| run | steps | held-out accuracy @step | reward 1-10 | 11-20 | last 10 "
          "| clip frac tokens | clip frac seqs | experts replaced, steps 1-5 | all steps "
          "| grad norm | response len | s/step |")
    print("|---" * 13 + "|")
    print("\n".join(runs))
    print("\nPer arm, mean ± std over its runs:\n")
    print("\n".join(arm_summary([f for f in folders if not f.name.startswith("probe_")])))
    if probes:
        print("\nOne update from the initial policy (the probe, one per seed):\n")
        print("| probe | experts replaced | worst layer | (token, layer) expert set changed |")
        print("|---|---|---|---|")
        print("\n".join(probe_row(probes[k]) for k in sorted(probes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
