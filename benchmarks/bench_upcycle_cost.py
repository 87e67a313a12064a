"""Cost of one RL step of the default job: dense SmolLM2 vs its sparse upcycles.

Each arm runs the default job (``gspo train`` defaults, HF engine, 4 minibatches) for a few
steps in its own child process, arms alternating (A B B A ...). Reported per arm: the median
wall time of the steps after the first (``time/step_s``) and the peak resident memory (VmHWM)
of the child; the ratio to the dense arm is what issue 16 bounds (≤ 2.5×, ≤ 16 GB).

An arm ``<model>@plain`` runs the step without shared-prompt packing, the lean passes and the
lean decode (the path MoE policies took before they were covered), beside the default one. The
arm ``deep128`` is not the default job but the deep_moe_128 testbed's
(``configs/moe/deep128_compare.yaml``: byte tokenizer, 16 layers, 128 experts, top-8).

    python -m benchmarks.bench_upcycle_cost                    # dense, e8k2, e4k2 (~10 min)
    python -m benchmarks.bench_upcycle_cost --arms dense 'experts=8&top_k=2' --steps 3
    python -m benchmarks.bench_upcycle_cost --arms dense 'experts=4&top_k=2' \
        'experts=4&top_k=2@plain' deep128 deep128@plain --tag paths

Writes benchmarks/results/upcycle_cost.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import abba, child_main, machine, median, run_child, write_result

DENSE = "smollm2-135m-instruct"


PLAIN = ["logprob_packing=false", "lean_forward=false", "rollout.fast_decode=false"]


DEEP128 = "sft:deep_moe_128?steps=700"  # the job of configs/moe/deep128_compare.yaml


def model_name(arm: str) -> str:
    arm = arm.split("@")[0]
    if arm == "deep128":
        return DEEP128
    return DENSE if arm == "dense" else f"upcycle:{DENSE}?{arm}"


def job(arm: str) -> tuple[str | None, list[str]]:
    """The arm's config file (None: the default job) and its overrides."""
    base, extra = ("moe/deep_moe", ["optim.lr=1e-4"]) if model_name(arm) == DEEP128 else (None, [])
    return base, [f"model={model_name(arm)}", *extra, *path_overrides(arm)]


def path_overrides(arm: str) -> list[str]:
    """``@plain``: :data:`PLAIN`; no suffix: the defaults."""
    path = arm.split("@")[1] if "@" in arm else ""
    if path not in ("", "plain"):
        raise SystemExit(f"bench_upcycle_cost: arm {arm!r}: unknown path {path!r} (plain)")
    return PLAIN if path else []


def run_arm(spec: dict[str, Any]) -> dict[str, Any]:
    """Child: ``steps`` steps of the default job on ``spec['arm']``'s model; per-step times."""
    import torch

    from gspo.config import load_config
    from gspo.trainer import Trainer

    torch.set_num_threads(spec["threads"])
    with tempfile.TemporaryDirectory() as out:
        base, overrides = job(spec["arm"])
        cfg = load_config(base, [*overrides, f"steps={spec['steps']}",
                                 f"output_dir={out}", "run_name=bench", "eval_before=false",
                                 "eval_every=0", "task.eval_size=0", "progress=false",
                                 "tensorboard=false", f"num_threads={spec['threads']}",
                                 "logging.samples_every=0"])
        Trainer(cfg).setup().train()
        rows = [json.loads(x) for x in (Path(out) / "bench" / "metrics.jsonl").read_text()
                .splitlines() if x.strip()]
    steps = [r for r in rows if "time/update_s" in r]
    return {"arm": spec["arm"],
            "step_s": [sum(v for k, v in r.items() if k.startswith("time/")) for r in steps],
            "update_s": [r.get("time/update_s") for r in steps],
            "rollout_s": [r.get("time/rollout_s") for r in steps]}


def main(argv: list[str]) -> None:
    if child_main(argv, run_arm):
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", nargs="+", default=["dense", "experts=8&top_k=2",
                                                   "experts=4&top_k=2"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tag", default="", help="results file suffix (upcycle_cost_<tag>)")
    args = ap.parse_args(argv)
    for arm in args.arms:
        path_overrides(arm)
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in args.arms}
    for arm in abba(args.arms, args.reps):
        res = run_child("benchmarks.bench_upcycle_cost",
                        {"arm": arm, "steps": args.steps, "threads": args.threads})
        runs[arm].append(res)
        print(f"{arm}: steps {[round(s, 1) for s in res['step_s']]} s, "
              f"peak {res['peak_rss_mb'] / 1024:.2f} GiB", flush=True)
    def after_first(rs: list[dict[str, Any]], key: str) -> float:
        """Median of every child's ``key`` times after its first step (all, if one step)."""
        return median([x for r in rs for x in r[key][1:]] or [x for r in rs for x in r[key]])

    summary = {}
    for arm, rs in runs.items():
        summary[arm] = {"model": model_name(arm), "path": " ".join(path_overrides(arm)),
                        **{f"{k}_median": after_first(rs, k)
                           for k in ("step_s", "rollout_s", "update_s")},
                        "peak_rss_gib": max(r["peak_rss_mb"] for r in rs) / 1024}
    base = summary.get("dense", {}).get("step_s_median")
    rows = []
    for arm, s in summary.items():
        default_job = job(arm)[0] is None
        s["vs_dense"] = s["step_s_median"] / base if base and default_job else None
        ratio = f"{s['vs_dense']:.2f}×" if s["vs_dense"] else "—"
        rows.append(f"| `{s['model']}` | {s['path'] or 'default'} | {s['step_s_median']:.1f} | "
                    f"{s['rollout_s_median']:.1f} | {s['update_s_median']:.1f} | {ratio} | "
                    f"{s['peak_rss_gib']:.2f} |")
    cmd = "python -m benchmarks.bench_upcycle_cost " + " ".join(argv)
    header = (f"# RL step of the default job: dense vs upcycled SmolLM2 (MoE paths)\n\n`{cmd}` "
              f"({args.threads} thread(s), {args.steps} steps per arm, median of steps after "
              "the first)\n\n| model | path | step s | rollout s | update s | vs dense | "
              "peak RSS GiB |\n|---|---|---|---|---|---|---|")
    name = "upcycle_cost" + (f"_{args.tag}" if args.tag else "")
    write_result(name, {"machine": machine(), "args": vars(args), "runs": runs,
                        "summary": summary}, header, rows)


if __name__ == "__main__":
    main(sys.argv[1:])
