"""The same GSPO work through gspo's Trainer and through TRL's GRPOTrainer, interleaved A/B.

One "step" is one rollout batch: N = B × G responses sampled (temperature T, top_p 1, top_k 0),
the π_old log-prob pass, then ``minibatches`` AdamW steps of N / minibatches rows each
(GSPO, ε 3e-4 / 4e-4, β 0, fp32). TRL is configured for exactly that:

    per_device_train_batch_size = N / minibatches, gradient_accumulation_steps = 1,
    steps_per_generation = minibatches (one generation feeds that many optimizer steps),
    num_iterations = 1, importance_sampling_level="sequence", loss_type="grpo",
    bf16=False, gradient_checkpointing=False (TRL's defaults are True for both), TRL's default
    optimizer (fused AdamW), the chat template's default system prompt.

With gradient_accumulation_steps (1) not a multiple of steps_per_generation (2), TRL runs its
own π_old log-prob pass, as gspo does (``objective.old_logprobs=recompute``), so the work is
the same. gspo's savings are its own: one prompt prefill per group in generation, each distinct
prompt run once in the log-prob passes, the LM head on response positions only. Other gspo arms
are listed in :data:`GSPO_ARMS`.

Each arm runs in its own child process (peak RSS = the child's VmHWM); arms alternate
A B C, C B A, ... so that load from other processes falls on all. With one thread (the
default) the primary clock is the process's CPU time, which other load does not inflate;
wall time is reported too. The prompts ask for long stories, so nearly every response runs to
max_new_tokens in every arm (token counts are reported).

    HF_HUB_OFFLINE=1 python -m benchmarks.bench_vs_trl --model smollm2-135m-instruct
    HF_HUB_OFFLINE=1 python -m benchmarks.bench_vs_trl --model tiny:llama --steps 4 --reps 3
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    PROMPTS,
    abba,
    child_main,
    fmt,
    machine,
    median,
    now,
    result_name,
    run_child,
    write_result,
)


def distinct_words(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
    """Share of distinct words (any cheap reward with variance within a group will do)."""
    out = []
    for c in completions:
        text = c[-1]["content"] if isinstance(c, list) else c  # TRL passes chat messages
        words = text.split()
        out.append(len(set(words)) / max(1, len(words)))
    return out


# ----------------------------------------------------------------------------- gspo arm
def _timed(fn: Any, into: list[tuple[float, float]]) -> Any:
    """Wrap ``fn`` to append its (wall, CPU) seconds to ``into``; measurement only."""
    def wrapper(*a: Any, **k: Any) -> Any:
        w0, c0 = now()
        out = fn(*a, **k)
        w1, c1 = now()
        into.append((w1 - w0, c1 - c0))
        return out

    return wrapper


def _engine_side(m: dict[str, float]) -> dict[str, float]:
    """An async step's engine-process seconds (its batch, and the sync of its own weight copy
    within that) and its publish (the trainer's share; the broadcast to an engine started
    elsewhere), and with thread lending the trainer's seconds on the engine's threads and the
    engine's on the trainer's, where the metrics have them."""
    keys = {"time/rollout_engine_s": "engine_s", "async/engine_sync_s": "engine_sync_s",
            "time/weight_sync_s": "publish_s", "time/publish_send_s": "publish_send_s",
            "async/lent_threads_s": "lent_s", "async/engine_borrowed_s": "borrowed_s"}
    return {short: m[k] for k, short in keys.items() if k in m}


def _step(wall: float, cpu: float, rollout: tuple[float, float], response_tokens: float,
          tokens: float, **extra: float) -> dict[str, float]:
    return {"step_s": wall, "step_cpu_s": cpu, "rollout_s": rollout[0],
            "rollout_cpu_s": rollout[1], "response_tokens": response_tokens, "tokens": tokens,
            **extra}


# Extra overrides of each gspo arm over the shared settings. "gspo" is gspo as shipped (the
# defaults: shared-prompt log-prob packing, fused AdamW, freed memory kept for reuse, π_old
# recomputed in fp32, by the first minibatch's own forward for its rows) and does the same work
# as TRL; "gspo_plain" switches packing, the fused optimizer and the memory reuse off;
# "gspo_rollout_lp"
# takes π_old from the sampler's fp32 log-probs and skips the trainer's π_old pass (the paper's
# Sec. 5.4 setting: less work than TRL, which always recomputes here).
GSPO_ARMS: dict[str, list[str]] = {
    "gspo": [],
    "gspo_plain": ["logprob_packing=false", "optim.fused=false", "keep_freed_memory=false"],
    "gspo_rollout_lp": ["objective.old_logprobs=rollout", "logging.rollout_check_every=0"],
}


def build_trainer(spec: dict[str, Any], tmp: Path) -> Any:
    """A set-up gspo Trainer for one step's work of ``spec`` (its files under ``tmp``), on
    ``spec["threads"]`` torch threads; ``spec["arm"]`` picks :data:`GSPO_ARMS`' overrides."""
    import torch

    from gspo.config import load_config
    from gspo.models import load_model
    from gspo.trainer import Trainer

    torch.set_num_threads(spec["threads"])
    model, tok = load_model(spec["model"], seed=spec["seed"])
    path = tmp / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": ""}) + "\n" for p in PROMPTS))
    cfg = load_config(None, [
        f"model={spec['model']}", f"output_dir={tmp}", "run_name=bench", "progress=false",
        "eval_before=false", f"steps={spec['steps']}", f"seed={spec['seed']}",
        f"num_threads={spec['threads']}", "task.name=jsonl", f"task.path={path}",
        "task.eval_size=0", "task.system_prompt=",  # the chat template's default, as TRL
        f"rollout.prompts_per_step={spec['prompts_per_step']}",
        f"rollout.group_size={spec['group_size']}",
        f"rollout.max_new_tokens={spec['max_new_tokens']}",
        f"rollout.temperature={spec['temperature']}", "rollout.top_p=1.0", "rollout.top_k=0",
        f"objective.num_minibatches={spec['minibatches']}", "objective.eps_low=3e-4",
        "objective.eps_high=4e-4", "objective.beta=0.0", f"optim.lr={spec['lr']}",
        "optim.grad_clip=1.0", *GSPO_ARMS[spec["arm"]], *spec.get("overrides", [])])
    return Trainer(cfg, reward_fns=[distinct_words], model=model, tokenizer=tok).setup()


def run_gspo(spec: dict[str, Any]) -> dict[str, Any]:
    n = spec["prompts_per_step"] * spec["group_size"]
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(spec, Path(tmp))
        rollout_t: list[tuple[float, float]] = []
        old_t: list[tuple[float, float]] = []
        trainer.rollout = _timed(trainer.rollout, rollout_t)
        trainer.old_logprobs = _timed(trainer.old_logprobs, old_t)
        steps = []
        for k in range(spec["steps"]):
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            w0, c0 = now()
            m = trainer.train_step()
            w1, c1 = now()
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            trainer.step += 1
            old = old_t.pop() if old_t else (0.0, 0.0)  # (0, 0): the step skipped the pass
            steps.append(_step(w1 - w0, c1 - c0, rollout_t[k], m["rollout/response_len_mean"] * n,
                               m["perf/update_tokens_per_s"] * m["time/update_s"],
                               old_logprobs_s=old[0], old_logprobs_cpu_s=old[1],
                               sys_cpu_s=r1.ru_stime - r0.ru_stime,
                               minor_faults=float(r1.ru_minflt - r0.ru_minflt),
                               **_engine_side(m)))
        trainer.cleanup()  # the engine (and an async engine's process)
    return {"arm": spec["arm"], "steps": steps}


# ----------------------------------------------------------------------------- TRL arm
def run_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gspo.models import load_model

    torch.set_num_threads(spec["threads"])
    model, tok = load_model(spec["model"], seed=spec["seed"])
    n, mb = spec["prompts_per_step"] * spec["group_size"], spec["minibatches"]
    ends: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            ends.append(now())

        def on_step_end(self, *a: Any, **k: Any) -> None:
            ends.append(now())

    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, per_device_train_batch_size=n // mb, gradient_accumulation_steps=1,
            steps_per_generation=mb, num_iterations=1, num_generations=spec["group_size"],
            max_completion_length=spec["max_new_tokens"], temperature=spec["temperature"],
            top_p=1.0, top_k=0, learning_rate=spec["lr"], lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
            max_grad_norm=1.0, beta=0.0, epsilon=3e-4, epsilon_high=4e-4,
            importance_sampling_level="sequence", loss_type="grpo", scale_rewards="group",
            max_steps=mb * spec["steps"], bf16=False, gradient_checkpointing=False,
            use_cpu=True, report_to="none", logging_steps=1, save_strategy="no",
            disable_tqdm=True, seed=spec["seed"], dataloader_num_workers=0)
        data = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS])
        trainer = GRPOTrainer(model=model, reward_funcs=[distinct_words], args=args,
                              train_dataset=data, processing_class=tok, callbacks=[Clock()])
        gen_t: list[tuple[float, float]] = []
        counts: list[tuple[float, float]] = []
        score = trainer._generate_and_score_completions

        def counted_score(*a: Any, **k: Any) -> Any:  # measurement only: count real tokens
            out = score(*a, **k)
            resp = float(out["completion_mask"].sum())
            counts.append((resp, resp + float(out["prompt_mask"].sum())))
            return out

        trainer._generate = _timed(trainer._generate, gen_t)
        trainer._generate_and_score_completions = counted_score
        trainer.train()
    steps = []
    for k in range(spec["steps"]):
        (w0, c0), (w1, c1) = ends[k * mb], ends[(k + 1) * mb]
        steps.append(_step(w1 - w0, c1 - c0, gen_t[k], *counts[k]))
    return {"arm": "trl", "steps": steps}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    return (run_trl if spec["arm"] == "trl" else run_gspo)(spec)


# ----------------------------------------------------------------------------- driver
CLOCKS = {"cpu": "_cpu_s", "wall": "_s"}  # key suffix of each clock's times in a step record


def summarize(results: list[dict[str, Any]], warmup: int, clock: str) -> dict[str, Any]:
    """Medians over every measured step of every child of an arm, on one clock."""
    sfx = CLOCKS[clock]
    out: dict[str, dict[str, float]] = {}
    for arm in dict.fromkeys(r["arm"] for r in results):
        steps = [s for r in results if r["arm"] == arm for s in r["steps"][warmup:]]
        step = [s["step" + sfx] for s in steps]
        roll = [s["rollout" + sfx] for s in steps]
        out[arm] = {
            "step_s": median(step), "rollout_s": median(roll),
            "update_s": median([a - b for a, b in zip(step, roll)]),
            "rollout_tok_s": median([s["response_tokens"] / r for s, r in zip(steps, roll)]),
            "update_tok_s": median([s["tokens"] / (a - b) for s, a, b in zip(steps, step, roll)]),
            "response_tokens": median([s["response_tokens"] for s in steps]),
            "tokens": median([s["tokens"] for s in steps]),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in results if r["arm"] == arm),
            "n_steps": len(steps)}
        if arm.startswith("gspo"):  # its π_old pass (skipped by gspo_rollout_lp)
            out[arm]["old_logprobs_s"] = median([s["old_logprobs" + sfx] for s in steps])
    ratio = {}  # per gspo arm: speed-up over TRL (> 1: gspo faster); memory: gspo / TRL
    t = out.get("trl")
    for arm, g in out.items():
        if arm.startswith("gspo") and t:
            ratio[arm] = {"step": t["step_s"] / g["step_s"],
                          "rollout_tok_s": g["rollout_tok_s"] / t["rollout_tok_s"],
                          "update_tok_s": g["update_tok_s"] / t["update_tok_s"],
                          "peak_rss": g["peak_rss_mb"] / t["peak_rss_mb"],
                          "paired_step": _paired(results, warmup, "step" + sfx, arm)}
    return {"arms": out, "gspo_over_trl": ratio}


def _paired(results: list[dict[str, Any]], warmup: int, key: str, arm: str) -> list[float]:
    """TRL/``arm`` step-time ratio of each round (one child of every arm, run back to back)."""
    n_arms = len({r["arm"] for r in results})
    ratios = []
    for i in range(0, len(results), n_arms):
        t = {r["arm"]: median([s[key] for s in r["steps"][warmup:]])
             for r in results[i:i + n_arms]}
        if {arm, "trl"} <= t.keys():
            ratios.append(t["trl"] / t[arm])
    return ratios


def table(model: str, threads: int, summary: dict[str, Any]) -> tuple[str, list[str]]:
    header = ("| model | threads | clock | arm | s/step | rollout tok/s | update tok/s "
              "| peak RSS MiB | tokens/step (response) |\n|---|---|---|---|---|---|---|---|---|")
    rows = []
    for clock, sm in summary.items():
        for arm, s in sm["arms"].items():
            rows.append(f"| {model} | {threads} | {clock} | {arm} | {fmt(s['step_s'])} | "
                        f"{fmt(s['rollout_tok_s'], 1)} | {fmt(s['update_tok_s'], 1)} | "
                        f"{fmt(s['peak_rss_mb'], 0)} | {fmt(s['tokens'], 0)} "
                        f"({fmt(s['response_tokens'], 0)}) |")
        for arm, r in sm["gspo_over_trl"].items():
            rows.append(f"| {model} | {threads} | {clock} | **{arm} vs TRL** | "
                        f"**{fmt(r['step'])}× faster** | {fmt(r['rollout_tok_s'])}× | "
                        f"{fmt(r['update_tok_s'])}× | {fmt(r['peak_rss'])}× | |")
    return header, rows


def add_step_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that define one step's work (shared with benchmarks.bench_async)."""
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-6)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_step_arguments(p)
    p.add_argument("--steps", type=int, default=3, help="rollout batches per child")
    p.add_argument("--warmup", type=int, default=1, help="first steps of each child not counted")
    p.add_argument("--reps", type=int, default=2, help="children per arm (alternating)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--arms", default="gspo,gspo_plain,gspo_rollout_lp,trl",
                   help=f"comma list of {', '.join(GSPO_ARMS)}, trl (see GSPO_ARMS)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--tag", default="", help="suffix of the result file name")
    a = p.parse_args(argv)
    spec = {k: getattr(a, k) for k in ("model", "prompts_per_step", "group_size",
                                       "max_new_tokens", "minibatches", "temperature", "lr",
                                       "steps", "threads", "seed")}
    results = []
    for arm in abba(a.arms.split(","), a.reps):
        w0 = time.perf_counter()
        r = run_child("benchmarks.bench_vs_trl", {**spec, "arm": arm})
        print(f"  {arm}: {[round(s['step_s'], 2) for s in r['steps']]} s/step wall, "
              f"{[round(s['step_cpu_s'], 2) for s in r['steps']]} CPU "
              f"({time.perf_counter() - w0:.0f} s with start-up)", flush=True)
        results.append(r)
    summary = {clock: summarize(results, a.warmup, clock) for clock in CLOCKS}
    name = result_name("vs_trl", a.model, a.tag)
    data = {"config": spec, "warmup": a.warmup, "reps": a.reps, "machine": machine(),
            "summary": summary, "raw": results}
    header, rows = table(a.model, a.threads, summary)
    write_result(name, data, header, rows, a.out)
    print("\n".join([header, *rows]))
    return data


if __name__ == "__main__":
    if not child_main(sys.argv[1:], run):
        main()
