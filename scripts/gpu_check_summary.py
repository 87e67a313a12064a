"""Summarise the runs of ``scripts/gpu_check.sh``: one Markdown row per run folder.

    python scripts/gpu_check_summary.py OUT_DIR NAME RUN_DIR [PEAK_MIB [WALL_S]]
    python scripts/gpu_check_summary.py --phases RUN_DIR...   (per-phase medians, Markdown)

Appends to ``OUT_DIR/results.md`` (and ``results.jsonl``): seconds per step (median over the
steps after the first, which includes warm-up), response tokens per second (sampled tokens /
step time), the rollout-vs-trainer log-prob gap (``rollout/logprob_gap_abs_max``, worst step),
the async staleness drift when logged, the peak device memory the caller sampled with
nvidia-smi (MiB, every process on the GPU; "n/a" when it did not), the peak of torch's
allocator in the trainer (``perf/gpu_peak_memory_gib``) and the run's wall time.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import yaml

from gspo.analysis.report import step_seconds


def summarise(run_dir: Path) -> dict[str, float | int | None]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
            if x.strip()]
    steps = [r for r in rows if "train/loss" in r]
    if not steps:
        raise SystemExit(f"{run_dir}: no training step logged")
    secs = [step_seconds(r) for r in steps]
    tail = secs[1:] or secs
    tokens = [r.get("rollout/response_len_mean", 0.0) for r in steps]
    gap = [r["rollout/logprob_gap_abs_max"] for r in steps if "rollout/logprob_gap_abs_max" in r]
    drift = [r["async/staleness_drift_abs_mean"] for r in steps
             if "async/staleness_drift_abs_mean" in r]
    peak = [r["perf/gpu_peak_memory_gib"] for r in steps if "perf/gpu_peak_memory_gib" in r]
    rollout = yaml.safe_load((run_dir / "config.yaml").read_text())["rollout"]
    n_rows = rollout["prompts_per_step"] * rollout["group_size"]
    step_s = statistics.median(tail)
    return {"steps": len(steps), "s_per_step": step_s,
            "tok_per_s": statistics.mean(tokens) * n_rows / step_s,
            "gap_abs_max": max(gap) if gap else None,
            "torch_peak_gib": max(peak) if peak else None,
            "staleness_drift_abs_mean": statistics.mean(drift) if drift else None}


def phases(run_dir: Path) -> str:
    """One Markdown list item: the median of each ``time/*`` phase over steps 2..N."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
            if x.strip()]
    rows = [r for r in rows if "train/loss" in r]
    rows = rows[1:] or rows
    keys = sorted({k for r in rows for k in r if k.startswith("time/")})
    cells = [f"{k[5:-2]} {statistics.median(r.get(k, 0.0) for r in rows):.2f}" for k in keys]
    return f"- {run_dir.name}: " + ", ".join(cells)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--phases":
        print("\nPer phase, median over steps 2..N (s):\n")
        print("\n".join(phases(Path(p)) for p in argv[1:]))
        return 0
    out, name, run = Path(argv[0]), argv[1], Path(argv[2])
    peak = argv[3] if len(argv) > 3 else "n/a"
    wall = argv[4] if len(argv) > 4 else "n/a"
    s = summarise(run)
    s_fmt = {k: ("—" if v is None else f"{v:.4g}") for k, v in s.items()}
    with open(out / "results.md", "a") as fh:
        fh.write(f"| {name} | {s_fmt['steps']} | {s_fmt['s_per_step']} | {s_fmt['tok_per_s']} "
                 f"| {peak} | {s_fmt['torch_peak_gib']} | {wall} | {s_fmt['gap_abs_max']} "
                 f"| {s_fmt['staleness_drift_abs_mean']} |\n")
    with open(out / "results.jsonl", "a") as fh:
        fh.write(json.dumps({"name": name, "peak_mib": peak, "wall_s": wall, **s}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
