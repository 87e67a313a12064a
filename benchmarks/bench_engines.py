"""Low-precision rollout engines against gspo's fp32 sampler: speed, start-up, sync, mismatch.

For each engine (``hf`` fp32, the reference; ``llamacpp``, llama.cpp on Q8_0 GGUF weights;
``vllm`` where its venv runs) on SmolLM2-135M-Instruct, one thread, batch 16 (2 story prompts
× 8 samples, every response runs to ``--max-new-tokens``), temperature ``--temperature``,
top_k 0, top_p 1:

- tok/s of ``generate`` (response tokens / wall seconds, and / CPU seconds);
- start-up: from the policy in memory to an engine ready to sample;
- per-update sync: ``sync_weights(policy)`` (llamacpp: re-export to GGUF + reload, split);
- mismatch: for the engine's own samples, log π_fp32 − log π_engine per token and per
  sequence (mean over the response's tokens, i.e. log of GSPO's s_i at θ = θ_old,
  arXiv:2507.18071 v2, Eq. (7)), π_fp32 from the trainer's pass
  (:func:`gspo.models.token_logprobs`): mean, and p50 / p99 / max of |·|.

And a check of llama-cpp-python's own ``logprobs`` (``create_completion(logprobs=1)``):
whether they are log_softmax of the temperature-scaled logits, which the sampled tokens'
log-probs must be, or of the raw logits.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m benchmarks.bench_engines
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from benchmarks.common import PROMPTS, fmt, machine, now, write_result


def stats(x: torch.Tensor) -> dict[str, float]:
    a = x.abs().double()
    return {"mean": float(x.double().mean()), "p50_abs": float(a.quantile(0.5)),
            "p99_abs": float(a.quantile(0.99)), "max_abs": float(a.max()), "n": x.numel()}


def mismatch(model: Any, tokenizer: Any, roll: Any, temperature: float) -> dict[str, Any]:
    from gspo.models import token_logprobs
    from gspo.rollout import pad_batch

    b = pad_batch(roll.prompt_ids, roll.response_ids, tokenizer.pad_token_id, roll.logprobs)
    with torch.no_grad():
        fp32, _ = token_logprobs(model, b["input_ids"], b["attention_mask"], b["response_mask"],
                                 temperature=temperature)
    m = b["response_mask"].bool()
    diff = (fp32 - b["old_logprobs"])
    per_seq = (diff * m).sum(-1) / m.sum(-1).clamp(min=1)
    return {"token": stats(diff[m]), "sequence": stats(per_seq)}


def run_engine(name: str, model: Any, tokenizer: Any, prompts: list[list[int]],
               args: argparse.Namespace) -> dict[str, Any]:
    from gspo.rollout import EngineOptions, SamplingParams, build_engine

    params = SamplingParams(args.max_new_tokens, args.temperature)
    w0, c0 = now()
    dtype = args.vllm_dtype if name == "vllm" else "float32"
    engine = build_engine(name, model, tokenizer, EngineOptions(dtype=dtype, seed=0))
    w1, c1 = now()
    out: dict[str, Any] = {"engine": name, "precision": engine.capabilities.precision,
                           "startup_s": w1 - w0, "startup_cpu_s": c1 - c0, "rounds": []}
    try:
        for r in range(args.reps):
            w0, c0 = now()
            roll = engine.generate(prompts, group_size=args.group_size, params=params,
                                   seeds=[100 * r + i for i in range(len(prompts))])
            w1, c1 = now()
            tokens = sum(len(x) for x in roll.response_ids)
            out["rounds"].append({"tokens": tokens, "wall_s": w1 - w0, "cpu_s": c1 - c0})
            if r == 0:
                out["mismatch"] = mismatch(model, tokenizer, roll, args.temperature)
        syncs = []
        if not engine.capabilities.shares_policy_weights:
            for _ in range(args.syncs):
                w0, c0 = now()
                engine.sync_weights(model)
                w1, c1 = now()
                syncs.append({"wall_s": w1 - w0, "cpu_s": c1 - c0})
        out["syncs"] = syncs
    finally:
        engine.close()
    best = min(out["rounds"], key=lambda x: x["wall_s"])
    out["tok_s"] = best["tokens"] / best["wall_s"]
    out["tok_cpu_s"] = best["tokens"] / best["cpu_s"]
    out["sync_s"] = min((s["wall_s"] for s in syncs), default=0.0)
    return out


def llamacpp_split(model: Any, tokenizer: Any) -> dict[str, float]:
    """Export and load times of one llamacpp sync, separately."""
    import tempfile
    from pathlib import Path

    import llama_cpp

    from gspo.rollout.llamacpp_engine import export_gguf

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = export_gguf(model, tokenizer, Path(tmp) / "m.gguf")
        t1 = time.perf_counter()
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=2048, n_threads=1, verbose=False)
        t2 = time.perf_counter()
        size = path.stat().st_size
        del llm
    return {"export_s": t1 - t0, "load_s": t2 - t1, "gguf_mb": size / 2**20}


def llamacpp_logprobs_check(model: Any, tokenizer: Any, prompt: list[int],
                            temperature: float) -> dict[str, Any]:
    """Compare llama-cpp-python's own ``logprobs`` with log_softmax(logits / T) and
    log_softmax(logits) of the same llama.cpp logits, on its own sampled tokens."""
    import tempfile
    from pathlib import Path

    import llama_cpp
    import numpy as np

    from gspo.rollout.llamacpp_engine import export_gguf

    with tempfile.TemporaryDirectory() as tmp:
        path = export_gguf(model, tokenizer, Path(tmp) / "m.gguf")
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=1, logits_all=True,
                              verbose=False, seed=0)
        out = llm.create_completion(prompt, max_tokens=16, temperature=temperature, top_k=0,
                                    top_p=1.0, min_p=0.0, repeat_penalty=1.0, logprobs=1,
                                    seed=0)
        returned = out["choices"][0]["logprobs"]["token_logprobs"]
        ids = [int(t) for t in llm._input_ids[len(prompt):]][:len(returned)]
        start = len(prompt) - 1
        scores = np.array(llm.scores[start:start + len(ids)], dtype=np.float64)
        del llm

    def lsm(x: np.ndarray) -> np.ndarray:
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    rows = np.arange(len(ids))
    at_t = lsm(scores / temperature)[rows, ids]
    raw = lsm(scores)[rows, ids]
    got = np.array(returned[:len(ids)], dtype=np.float64)
    return {"n_tokens": len(ids), "max_abs_vs_log_softmax_logits_over_T":
            float(np.abs(got - at_t).max()), "max_abs_vs_log_softmax_raw_logits":
            float(np.abs(got - raw).max()), "temperature": temperature}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--engines", default="hf,llamacpp")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--syncs", type=int, default=2)
    p.add_argument("--vllm-dtype", default="bfloat16", help="dtype vLLM samples in")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from gspo.data import format_prompt
    from gspo.models import load_model

    model, tokenizer = load_model(args.model)
    model.eval()
    prompts = [format_prompt(tokenizer, q, chat_template=True) for q in PROMPTS[:args.prompts]]
    rows = []
    for name in args.engines.split(","):
        try:
            rows.append(run_engine(name, model, tokenizer, prompts, args))
        except Exception as e:  # record why an engine could not run, exactly
            rows.append({"engine": name, "error": f"{type(e).__name__}: {e}"})
    extra: dict[str, Any] = {}
    if any(r["engine"] == "llamacpp" and "error" not in r for r in rows):
        extra["llamacpp_sync_split"] = llamacpp_split(model, tokenizer)
        extra["llamacpp_logprobs_check"] = llamacpp_logprobs_check(
            model, tokenizer, prompts[0], args.temperature)
    ref = next((r for r in rows if r["engine"] == "hf" and "error" not in r), None)
    md = ["| engine | precision | tok/s (batch 16) | vs hf fp32 | start-up s | sync s | "
          "token Δ mean / p50 / p99 / max | sequence Δ mean / p50 / p99 / max |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['engine']} | – | – | – | – | – | {r['error'][:200]} | |")
            continue
        t, s = r["mismatch"]["token"], r["mismatch"]["sequence"]
        speed = f"{r['tok_s'] / ref['tok_s']:.2f}×" if ref else "–"
        md.append(f"| {r['engine']} | {r['precision']} | {fmt(r['tok_s'], 1)} | {speed} | "
                  f"{fmt(r['startup_s'])} | {fmt(r['sync_s'])} | "
                  f"{t['mean']:.1e} / {t['p50_abs']:.1e} / {t['p99_abs']:.1e} / "
                  f"{t['max_abs']:.1e} | {s['mean']:.1e} / {s['p50_abs']:.1e} / "
                  f"{s['p99_abs']:.1e} / {s['max_abs']:.1e} |")
    if "llamacpp_sync_split" in extra:
        sp, ck = extra["llamacpp_sync_split"], extra["llamacpp_logprobs_check"]
        md += ["", f"llamacpp sync = export {sp['export_s']:.2f} s + load {sp['load_s']:.2f} s "
               f"(GGUF {sp['gguf_mb']:.0f} MiB). llama-cpp-python's own `logprobs` at T = "
               f"{ck['temperature']}: max |Δ| {ck['max_abs_vs_log_softmax_raw_logits']:.1e} vs "
               f"log_softmax(raw logits), {ck['max_abs_vs_log_softmax_logits_over_T']:.1e} vs "
               f"log_softmax(logits / T) ({ck['n_tokens']} tokens)."]
    cmd = ("OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m benchmarks.bench_engines "
           + " ".join(argv or sys.argv[1:])).strip()
    md += ["", f"{args.prompts} prompts × {args.group_size} samples × {args.max_new_tokens} "
           f"tokens, T = {args.temperature}, one thread; Δ = log π_fp32 − log π_engine on the "
           f"engine's own samples (p50/p99/max of |Δ|). `{cmd}`"]
    header = f"# Rollout engines vs gspo's fp32 sampler, `{args.model}`\n"
    write_result("_".join(["engines", *([args.tag] if args.tag else [])]),
                 {"settings": vars(args), "command": cmd, "machine": machine(), "rows": rows,
                  **extra}, header, md)
    print("\n".join(md))


if __name__ == "__main__":
    main()
