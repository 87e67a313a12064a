"""Seconds per RL step and peak memory per rank: one process vs torchrun with DDP and FSDP2.

Each configuration runs ``Trainer.train_step`` ``--steps`` times on the built-in arithmetic task
(one torch thread per process, as torchrun sets ``OMP_NUM_THREADS=1``) under
``python -m torch.distributed.run --nproc_per_node N`` (gloo on CPU), or in one plain process.
Reported: the median wall seconds per step after the first, its rollout and update phases (rank
0's), and the largest peak RSS of any rank.

    python -m benchmarks.bench_scaling --model tiny:llama
    python -m benchmarks.bench_scaling --model smollm2-135m-instruct --prompts 4 --group-size 4 \\
        --max-new-tokens 16 --minibatches 2 --steps 3
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

from benchmarks.common import fmt, machine, median, peak_rss_mb, result_name, write_result

REPO = Path(__file__).resolve().parents[1]


def child(spec: dict[str, Any]) -> None:
    """One rank (or the single process) of a configuration; rank 0 writes ``spec['out']``."""
    import torch

    from gspo.config import load_config
    from gspo.trainer import Trainer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [
            f"model={spec['model']}", f"output_dir={tmp}", "run_name=bench", "progress=false",
            "eval_before=false", "task.eval_size=0", "tensorboard=false", "num_threads=1",
            f"steps={spec['steps']}", f"rollout.prompts_per_step={spec['prompts']}",
            f"rollout.group_size={spec['group_size']}",
            f"rollout.max_new_tokens={spec['max_new_tokens']}",
            f"objective.num_minibatches={spec['minibatches']}",
            f"dist.strategy={spec['strategy'] if spec['strategy'] != 'none' else 'ddp'}"])
        trainer = Trainer(cfg).setup()
        steps = []
        for _ in range(spec["steps"]):
            t0 = time.perf_counter()
            m = trainer.train_step()
            steps.append({"step_s": time.perf_counter() - t0, "rollout_s": m["time/rollout_s"],
                          "update_s": m["time/update_s"]})
            trainer.step += 1
        rss = torch.tensor(peak_rss_mb())
        d = trainer.dist
        if d.enabled:
            rss = d.all_reduce(rss, "max")
        if d.is_main:
            Path(spec["out"]).write_text(json.dumps({"steps": steps, "peak_rss_mb": float(rss)}))
        trainer.cleanup()


def run_config(spec: dict[str, Any], procs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        spec = {**spec, "out": str(Path(tmp) / "out.json")}
        head = [sys.executable]
        if procs > 1:
            head += ["-m", "torch.distributed.run", "--nproc_per_node", str(procs),
                     "--master_port", str(29_500 + os.getpid() % 1000)]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        subprocess.run([*head, "-m", "benchmarks.bench_scaling", "--child", json.dumps(spec)],
                       check=True, env=env, cwd=REPO)
        return json.loads(Path(spec["out"]).read_text())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny:llama")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--minibatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--configs", default="1:none,2:ddp,2:fsdp2",
                   help="comma list of PROCESSES:STRATEGY")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if a.child is not None:
        child(json.loads(a.child))
        return {}
    base = {"model": a.model, "prompts": a.prompts, "group_size": a.group_size,
            "max_new_tokens": a.max_new_tokens, "minibatches": a.minibatches,
            "steps": a.steps}
    rows, results = [], {}
    for item in a.configs.split(","):
        procs, strategy = item.split(":")
        r = run_config({**base, "strategy": strategy}, int(procs))
        results[item] = r
        later = r["steps"][1:] or r["steps"]
        rows.append(f"| {a.model} | {procs} | {strategy} | "
                    f"{fmt(median([s['step_s'] for s in later]))} | "
                    f"{fmt(median([s['rollout_s'] for s in later]))} | "
                    f"{fmt(median([s['update_s'] for s in later]))} | "
                    f"{fmt(r['peak_rss_mb'] / 1024)} GB |")
        print(rows[-1], flush=True)
    header = ("| model | processes | strategy | s / step | rollout s | update s "
              "| peak RSS per rank |\n|---|---|---|---|---|---|---|")
    data = {"config": base, "machine": machine(), "results": results}
    name = result_name("scaling", a.model)
    write_result(name, data, header, rows, a.out)
    print("\n".join([header, *rows]))
    return data


if __name__ == "__main__":
    main()
