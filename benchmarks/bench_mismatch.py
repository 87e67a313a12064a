"""The hf engine in fp32 (the policy module itself) vs its bf16 copy (``rollout.precision=bf16``).

For each precision: start-up (building the engine: the bf16 copy), sampling throughput at batch
16 (``--prompts`` × ``--group-size`` rows of the default arithmetic task's prompts, reps
alternating A B B A in one process), the per-update weight sync (``sync_weights`` after a
perturbation of the policy, as after an AdamW step), and the mismatch of the engine's log-probs
against the trainer's fp32 recompute at the same weights (per-token and per-sequence
log-ratio quantiles, k3 KL; :func:`gspo.trainer.mismatch.mismatch_metrics`).

    OMP_NUM_THREADS=2 python -m benchmarks.bench_mismatch --model smollm2-135m-instruct
    python -m benchmarks.bench_mismatch --model tiny:llama --reps 1
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from benchmarks.common import PROMPT_SETS, fmt, machine, median, result_name, write_result

ARMS = ("fp32", "bf16")


def _setup(model_name: str) -> tuple[Any, Any, list[list[int]]]:
    from gspo.data import format_prompt
    from gspo.models import load_model

    model, tok = load_model(model_name, dtype=torch.float32, seed=0)
    msgs, system = PROMPT_SETS["arithmetic"]
    prompts = [format_prompt(tok, m, chat_template=True, system_prompt=system) for m in msgs]
    return model, tok, prompts


def _sample(engine: Any, prompts: list[list[int]], group: int, new: int, seed: int) -> Any:
    from gspo.rollout import SamplingParams

    params = SamplingParams(new, 1.0, 1.0, 0)
    return engine.generate(prompts, group_size=group, params=params,
                           seeds=[seed * 1000 + i for i in range(len(prompts))])


def _mismatch(model: Any, roll: Any, pad_id: int) -> dict[str, float]:
    from gspo.models import token_logprobs
    from gspo.rollout import pad_batch
    from gspo.trainer.distributed import Dist
    from gspo.trainer.mismatch import mismatch_metrics

    b = pad_batch(roll.prompt_ids, roll.response_ids, pad_id, roll.logprobs)
    with torch.no_grad():
        old = token_logprobs(model, b["input_ids"], b["attention_mask"], b["response_mask"],
                             temperature=1.0)[0]
    return mismatch_metrics(b["old_logprobs"], old, None, b["response_mask"], Dist())


def run(args: argparse.Namespace) -> dict[str, Any]:
    from gspo.rollout import EngineOptions, build_engine

    model, tok, all_prompts = _setup(args.model)
    prompts = all_prompts[: args.prompts]
    engines, startup = {}, {}
    for arm in ARMS:
        t0 = time.perf_counter()
        engines[arm] = build_engine("hf", model, tok, EngineOptions(precision=arm))
        startup[arm] = time.perf_counter() - t0
    _sample(engines["bf16"], prompts, args.group_size, 4, 999)  # warm-up, both paths
    _sample(engines["fp32"], prompts, args.group_size, 4, 999)
    tps: dict[str, list[float]] = {a: [] for a in ARMS}
    mism: dict[str, list[dict[str, float]]] = {a: [] for a in ARMS}
    order = [a for r in range(args.reps) for a in (ARMS if r % 2 == 0 else ARMS[::-1])]
    for i, arm in enumerate(order):
        t0 = time.perf_counter()
        roll = _sample(engines[arm], prompts, args.group_size, args.max_new_tokens, i)
        dt = time.perf_counter() - t0
        tps[arm].append(sum(len(r) for r in roll.response_ids) / dt)
        mism[arm].append(_mismatch(model, roll, tok.pad_token_id))
    sync: dict[str, float] = {}
    for arm in ARMS:
        times = []
        for _ in range(args.sync_reps):
            with torch.no_grad():  # an update's worth of change
                for p in model.parameters():
                    p.add_(1e-6)
            t0 = time.perf_counter()
            engines[arm].sync_weights(model)
            times.append(time.perf_counter() - t0)
        sync[arm] = median(times)
    rows = {}
    for arm in ARMS:
        keys = mism[arm][0].keys()
        rows[arm] = {"tokens_per_s": median(tps[arm]), "startup_s": startup[arm],
                     "sync_s": sync[arm],
                     **{k: max(m[k] for m in mism[arm]) if "max" in k or "p99" in k
                        else median([m[k] for m in mism[arm]]) for k in keys}}
    return {"model": args.model, "batch": args.prompts * args.group_size,
            "max_new_tokens": args.max_new_tokens, "reps": args.reps, "arms": rows,
            "machine": machine(), "command": " ".join(["python -m benchmarks.bench_mismatch",
                                                       *sys.argv[1:]])}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--sync-reps", type=int, default=5)
    p.add_argument("--out", default="")
    p.add_argument("--tag", default="", help="suffix of the result file name")
    args = p.parse_args(argv)
    data = run(args)
    header = (f"hf engine fp32 vs bf16 copy, {args.model}, batch {data['batch']}, "
              f"{args.max_new_tokens} new tokens, {args.reps} reps (A B B A)\n\n"
              "| precision | tok/s | start-up s | sync s | token |δ| p50 | token |δ| p99 | "
              "token |δ| max | seq |δ| p50 | seq |δ| p99 | seq |δ| max | k3 KL |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|")
    md = [f"| {a} | {fmt(r['tokens_per_s'], 1)} | {r['startup_s']:.3f} | {r['sync_s']:.4f} | "
          f"{r['mismatch/token_log_ratio_abs_p50']:.2e} | "
          f"{r['mismatch/token_log_ratio_abs_p99']:.2e} | "
          f"{r['mismatch/token_log_ratio_abs_max']:.2e} | "
          f"{r['mismatch/seq_log_ratio_abs_p50']:.2e} | "
          f"{r['mismatch/seq_log_ratio_abs_p99']:.2e} | "
          f"{r['mismatch/seq_log_ratio_abs_max']:.2e} | {r['mismatch/k3_kl']:.2e} |"
          for a, r in data["arms"].items()]
    from pathlib import Path

    write_result(result_name("mismatch", args.model, args.tag), data, header, md,
                 Path(args.out) if args.out else None)
    print("\n".join([header, *md]))
    return data


if __name__ == "__main__":
    main()
