"""A long-run soak: does a 1,000-step run leak memory, file descriptors or threads?

Runs ``gspo train`` as a child process (the real CLI, the tiny preset) for ``--steps`` steps
with a checkpoint every ``--save-every`` steps and a held-out evaluation every
``--eval-every``, and samples the child from outside every ``--interval`` seconds:
resident memory (``VmRSS``), open file descriptors (``/proc/<pid>/fd``), OS threads
(``Threads``) and the step reached (the last row of ``metrics.jsonl``). Memory growth is the
median RSS over the last ``--window`` steps over the median RSS over the ``--window`` steps
after ``--warmup``, minus one; the target is ≤ 5%.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_soak

writes ``results/soak_tiny-llama.json`` (every sample), ``.md`` and ``.png`` (the curves).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, ROOT, fmt, machine, median, result_name, write_result

TARGET_GROWTH = 0.05


def sample(pid: int) -> dict[str, float] | None:
    """RSS (MiB), threads, open fds and CPU seconds of ``pid`` now; None once it has gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    if "VmRSS" not in fields:  # exited, not yet reaped
        return None
    return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
            "threads": int(fields["Threads"]), "fds": fds,
            "cpu_s": (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")}


def last_step(metrics: Path) -> int:
    """The highest step written to ``metrics.jsonl`` so far (0 before the first)."""
    try:
        lines = metrics.read_text().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):  # a line being written
            continue
    return 0


def soak(args: argparse.Namespace, run_dir: Path) -> tuple[list[dict[str, float]], float, int]:
    """Run the child and sample it; (samples, wall seconds, return code)."""
    cmd = [sys.executable, "-m", "gspo", "train", args.config, f"model={args.model}",
           f"steps={args.steps}", f"save_every={args.save_every}",
           f"eval_every={args.eval_every}", f"output_dir={run_dir.parent}",
           f"run_name={run_dir.name}", "progress=false", "tensorboard=false", *args.overrides]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    log = (run_dir.parent / "soak.log").open("w")
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    samples: list[dict[str, float]] = []
    while child.poll() is None:
        s = sample(child.pid)
        if s is not None:
            s |= {"t": time.perf_counter() - t0, "step": last_step(run_dir / "metrics.jsonl")}
            samples.append(s)
        time.sleep(args.interval)
    log.close()
    return samples, time.perf_counter() - t0, child.returncode


def summarise(samples: list[dict[str, float]], warmup: int, window: int, steps: int
              ) -> dict[str, Any]:
    """Growth of RSS, fds and threads between the window after warm-up and the last window."""
    after = [s for s in samples if s["step"] >= warmup]
    base = [s for s in after if s["step"] < warmup + window]
    end = [s for s in after if s["step"] > steps - window]
    out: dict[str, Any] = {"warmup_step": warmup, "window_steps": window,
                           "samples_after_warmup": len(after)}
    for key in ("rss_mb", "fds", "threads"):
        b, e = median([s[key] for s in base]), median([s[key] for s in end])
        out[key] = {"after_warmup": b, "end": e, "growth": e / b - 1 if b else float("nan"),
                    "min_after_warmup": min((s[key] for s in after), default=float("nan")),
                    "max_after_warmup": max((s[key] for s in after), default=float("nan"))}
    if len(after) >= 2:  # least-squares slope of RSS over steps, MiB per 1,000 steps
        xs, ys = [s["step"] for s in after], [s["rss_mb"] for s in after]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        out["rss_slope_mb_per_1000_steps"] = (
            1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0)
    out["met"] = out["rss_mb"]["growth"] <= TARGET_GROWTH
    return out


def plot(samples: list[dict[str, float]], summary: dict[str, Any], path: Path,
         title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    steps = [s["step"] for s in samples]
    for ax, key, label in zip(axes, ("rss_mb", "fds", "threads"),
                              ("RSS (MiB)", "open fds", "threads")):
        ax.plot(steps, [s[key] for s in samples], lw=1)
        ax.axvline(summary["warmup_step"], color="grey", ls="--", lw=0.8)
        ax.set_ylabel(label)
    axes[0].set_title(title)
    axes[-1].set_xlabel("step (dashed: end of warm-up)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--model", default="tiny:llama")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--warmup", type=int, default=100, help="steps before the baseline window")
    p.add_argument("--window", type=int, default=50, help="steps per baseline/end window")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    p.add_argument("--out", default="", help="result folder (default benchmarks/results)")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for gspo train")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gspo-soak-") as tmp:
        run_dir = Path(tmp) / "soak"
        samples, wall, rc = soak(args, run_dir)
        if rc != 0:
            raise SystemExit(f"gspo train failed (rc {rc}):\n"
                             + (Path(tmp) / "soak.log").read_text()[-3000:])
        ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    summary = summarise(samples, args.warmup, args.window, args.steps)
    name = result_name("soak", args.model)
    out = Path(args.out) if args.out else RESULTS
    cmd = "OMP_NUM_THREADS=1 python -m benchmarks.bench_soak " + " ".join(argv or sys.argv[1:])
    steps_cpu = [x for x in samples if x["step"] >= 1]
    cpu_per_step = ((steps_cpu[-1]["cpu_s"] - steps_cpu[0]["cpu_s"])
                    / max(steps_cpu[-1]["step"] - steps_cpu[0]["step"], 1)) if steps_cpu else 0.0
    data = {"settings": vars(args), "command": cmd.strip(), "machine": machine(),
            "cpu_s_per_step": cpu_per_step, "wall_s": wall, "s_per_step": wall / max(args.steps, 1),
            "checkpoints_left": ckpts, "summary": summary, "samples": samples}
    r, f, th = summary["rss_mb"], summary["fds"], summary["threads"]
    rows = ["| quantity | after warm-up (step "
            f"{args.warmup}–{args.warmup + args.window}) | last {args.window} steps | growth "
            "| min–max after warm-up |", "|---|---|---|---|---|"]
    for label, d, digits in (("RSS (MiB)", r, 1), ("open fds", f, 0), ("threads", th, 0)):
        rows.append(f"| {label} | {fmt(d['after_warmup'], digits)} | {fmt(d['end'], digits)} | "
                    f"{100 * d['growth']:+.2f}% | {fmt(d['min_after_warmup'], digits)}–"
                    f"{fmt(d['max_after_warmup'], digits)} |")
    rows += ["", f"RSS slope after warm-up: {summary.get('rss_slope_mb_per_1000_steps', 0):+.2f} "
             f"MiB per 1,000 steps; target growth ≤ {100 * TARGET_GROWTH:.0f}%: "
             f"{'met' if summary['met'] else 'NOT met'}. {args.steps} steps in {wall:.0f} s "
             f"wall ({wall / max(args.steps, 1):.2f} s/step; {cpu_per_step:.3f} CPU s/step), "
             f"{len(samples)} samples; "
             f"checkpoints left: {', '.join(ckpts)}.", "", f"`{data['command']}`"]
    header = (f"# Soak: {args.steps} steps of `{args.model}` ({args.config}), checkpoint every "
              f"{args.save_every}, eval every {args.eval_every}\n")
    path = write_result(name, data, header, rows, out)
    plot(samples, summary, path.with_suffix(".png"),
         f"{args.model}: {args.steps} steps, ckpt/{args.save_every}, eval/{args.eval_every}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
