"""Update-phase FLOP/s against this machine's fp32 matmul peak, and log-prob-step memory.

1. Peak: ``torch.mm`` on the update's own matmul shapes (and 2048²), measured in this run.
2. Update phase = the π_old pass (no grad, with entropy; rows outside the first minibatch, as
   the trainer runs it) + gspo's ``policy_update`` (GSPO, ``minibatches`` AdamW steps, the
   first one's forward supplying π_old for its rows) on one rollout batch (B prompts × G
   responses), through the plain :func:`token_logprobs` and through
   :func:`gspo.models.packing.shared_prefix_logprobs` (``logprob_packing``, the default),
   interleaved, both on the lean pass as the trainer runs them (``lean_forward``). FLOPs are
   counted by :func:`benchmarks.bench_async.flops_mode` (matrix products and attention, forward
   and backward, on the lean path that is timed). Until 2026-12-07 ``FlopCounterMode`` counted
   them: its module hooks sent the counted pass through ``forward`` (the same products) and it
   has no formula for the CPU's attention kernels, which it left out.
3. Memory: the log-prob step alone (fp32 head V × H, T positions) in a child process per
   variant: gspo's ``token_logprobs`` (chunked head with a hand-written backward), autograd with
   each chunk checkpointed, and a naive ``log_softmax`` over the full [T, V] fp32 logits;
   peak = VmHWM − RSS before the step; with the head weight's gradient, without it (the step's
   own tensors), and without autograd (see :func:`memory_child`).

With one thread, times are CPU seconds of the process (robust to other load on the machine).

    python -m benchmarks.bench_update --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    PROMPTS,
    child_main,
    fmt,
    machine,
    median,
    now,
    result_name,
    run_child,
    write_result,
)


def _clock(threads: int) -> int:
    return 1 if threads == 1 else 0  # index into now(): CPU seconds with one thread, else wall


# ----------------------------------------------------------------------------- 1. peak
def matmul_peak(shapes: list[tuple[int, int, int]], threads: int, reps: int = 5,
                gflop: float = 2.0, onednn: bool = False) -> dict[str, float]:
    """Median GFLOP/s of ``torch.mm`` [m, k] × [k, n] for each shape (~``gflop`` per timing);
    ``onednn``: of the same product through oneDNN (:func:`gspo.models.onednn.mm`)."""
    from gspo.models.onednn import mm

    out = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        bt = b.t()  # [n, k]: the weight oneDNN's linear takes
        inner = max(1, int(gflop * 1e9 / (2 * m * k * n)))
        times = []
        for _ in range(reps + 1):
            t0 = now()[_clock(threads)]
            for _ in range(inner):
                if onednn:
                    mm(a, bt, None)
                else:
                    torch.mm(a, b)
            times.append((now()[_clock(threads)] - t0) / inner)
        out[f"{m}x{k}x{n}"] = 2 * m * k * n / median(times[1:]) / 1e9
    return out


# ----------------------------------------------------------------------------- 2. update
def logprob_path(model: Any, packed: bool) -> Any:
    """The log-prob function of the trainer's passes: ``logprob_packing`` on or off, through
    the lean pass where the model allows it (``lean_forward``, the default)."""
    import functools

    from gspo.models.lean_forward import lean_unsupported
    from gspo.models.logprobs import token_logprobs
    from gspo.models.packing import shared_prefix_logprobs

    return functools.partial(shared_prefix_logprobs if packed else token_logprobs,
                             lean=lean_unsupported(model) is None)


def rollout_batch(tok: Any, prompts: int, group: int, response_len: int,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    from gspo.data import format_prompt
    from gspo.rollout import pad_batch

    g = torch.Generator().manual_seed(seed)
    ids = [format_prompt(tok, p) for p in PROMPTS[:prompts]]
    rows = [p for p in ids for _ in range(group)]
    resp = [torch.randint(100, len(tok) - 1, (response_len,), generator=g).tolist() for _ in rows]
    return pad_batch(rows, resp, tok.pad_token_id)


def update_phase(model: Any, optimizer: Any, batch: dict[str, torch.Tensor], *, packed: bool,
                 minibatches: int, seed: int) -> None:
    """π_old pass + policy_update, as Trainer.train_step runs them (fp32, GSPO, β = 0): the
    π_old pass covers the rows outside the first minibatch, whose own forward gives the rest."""
    from gspo.config import ObjectiveConfig
    from gspo.models.lean_forward import inference_safe, no_autograd
    from gspo.objectives import objective_from_config
    from gspo.trainer.update import UpdateBatch, plan_update, policy_update

    logprobs_fn = logprob_path(model, packed)
    inference = logprobs_fn.keywords["lean"] and inference_safe(model)  # as the trainer
    n = batch["input_ids"].shape[0]
    plan = plan_update(n, num_minibatches=minibatches, epochs=1,
                       generator=torch.Generator().manual_seed(seed), old_from_first=True)
    rest = plan.old_pass_rows(n)
    old = torch.zeros(batch["input_ids"].shape)
    width = int(batch["attention_mask"][rest].sum(-1).max())
    cols = [batch[k][rest, :width] for k in ("input_ids", "attention_mask", "response_mask")]
    model.eval()
    with no_autograd(inference):
        lp, _ = logprobs_fn(model, *cols, with_entropy=True)
    old[rest, :width] = lp
    adv = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    policy_update(model, optimizer, scheduler,
                  UpdateBatch(batch["input_ids"], batch["attention_mask"],
                              batch["response_mask"], old, adv), plan,
                  objective=objective_from_config(ObjectiveConfig(num_minibatches=minibatches)),
                  temperature=1.0, chunk=256, grad_clip=1.0, logprob_fn=logprobs_fn)


def count_flops(fn: Any) -> float:
    """FLOPs of the matrix products and attention ``fn`` runs, on the path it takes unobserved
    (:func:`benchmarks.bench_async.flops_mode`: no module hooks; the CPU's attention kernels
    counted)."""
    from benchmarks.bench_async import flops_mode

    with flops_mode() as mode:
        fn()
    return float(mode.total)


# ----------------------------------------------------------------------------- 3. memory
def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def memory_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Peak extra memory of one log-prob step at V × H, T positions.

    ``mode``: ``grad`` (forward + backward, the V × H head/embedding weight trainable, so the
    peak includes its gradient, which any training step holds), ``activations`` (forward +
    backward with that weight frozen: only the step's own tensors) or ``no_grad`` (the π_old
    pass).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.common import peak_rss_mb
    from gspo.models.logprobs import token_logprobs

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["hidden"], num_hidden_layers=0,
                      num_attention_heads=8, num_key_value_heads=8, intermediate_size=64,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)  # zero layers: embedding, final norm, fp32 head only
    if spec["mode"] == "activations":  # gradient reaches the hidden states via the norm only
        model.get_output_embeddings().weight.requires_grad_(False)
    ids = torch.randint(0, spec["vocab"], (1, spec["T"]))
    mask = torch.ones_like(ids)
    target = mask.clone()
    target[:, 0] = 0
    before = _rss_mb()
    with torch.set_grad_enabled(spec["mode"] != "no_grad"):
        if spec["variant"] == "gspo":
            lp, _ = token_logprobs(model, ids, mask, target, chunk=spec["chunk"])
            value = (lp * target).sum()
        elif spec["variant"] == "checkpoint":  # autograd, each chunk checkpointed
            from torch.utils.checkpoint import checkpoint

            from gspo.models.logprobs import _chunk_logprobs

            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[0, :-1]
            w, c, y = model.get_output_embeddings().weight, spec["chunk"], ids[0, 1:]
            value = sum(checkpoint(_chunk_logprobs, hidden[s:s + c], w, None, y[s:s + c], 1.0,
                                   use_reentrant=False)[0].sum()
                        for s in range(0, hidden.shape[0], c))
        else:  # naive: the full [T, V] fp32 logits and their log_softmax
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            value = lp.sum()
        if spec["mode"] != "no_grad":
            value.backward()
    return {"variant": spec["variant"], "mode": spec["mode"],
            "extra_peak_mb": peak_rss_mb() - before, "value": float(value.detach())}


# ----------------------------------------------------------------------------- driver
def run_update(a: argparse.Namespace) -> dict[str, Any]:
    from gspo.models import load_model
    from gspo.trainer.host import keep_freed_memory

    keep_freed_memory()  # as the trainer (keep_freed_memory=true)
    model, tok = load_model(a.model)
    batch = rollout_batch(tok, a.prompts, a.group_size, a.response_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=True)  # as the trainer
    flops = {}
    for packed in (False, True):
        flops[packed] = count_flops(lambda p=packed: update_phase(
            model, optimizer, batch, packed=p, minibatches=a.minibatches, seed=0))
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(a.reps):
        for packed in ((False, True) if r % 2 == 0 else (True, False)):
            t0 = now()[_clock(a.threads)]
            update_phase(model, optimizer, batch, packed=packed, minibatches=a.minibatches,
                         seed=r)
            times[packed].append(now()[_clock(a.threads)] - t0)
    m = a.group_size * a.prompts // a.minibatches * int(batch["attention_mask"].sum(1).max())
    hidden = model.config.hidden_size
    inter = getattr(model.config, "intermediate_size", 4 * hidden)
    vocab = model.config.vocab_size
    shapes = [(m, hidden, inter), (m, inter, hidden), (m, hidden, hidden), (512, hidden, vocab)]
    shapes += [(a.square, a.square, a.square)] if a.square else []
    peak = matmul_peak(shapes, a.threads, gflop=a.peak_gflop)
    best = max(peak.values())
    out = {"tokens": int(batch["attention_mask"].sum()), "matmul_gflops": peak,
           "matmul_peak_gflops": best}
    for packed, name in ((False, "plain"), (True, "packed")):
        s = median(times[packed])
        out[name] = {"s": s, "all_s": times[packed], "gflop": flops[packed] / 1e9,
                     "gflops": flops[packed] / s / 1e9,
                     "frac_of_peak": flops[packed] / s / 1e9 / best,
                     "effective_gflops": flops[False] / s / 1e9}
    out["packed_speedup"] = median(times[False]) / median(times[True])
    return out


MEMORY_MODES = ("grad", "activations", "no_grad")
# token_logprobs (hand-written chunked head backward), per-chunk autograd checkpointing, naive
MEMORY_VARIANTS = ("gspo", "checkpoint", "naive")


def run_memory(a: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"logits_mb": a.mem_T * a.mem_vocab * 4 / 2**20,
                           "head_weight_mb": a.mem_vocab * a.mem_hidden * 4 / 2**20}
    for mode in MEMORY_MODES:
        r = {variant: run_child("benchmarks.bench_update", {
            "variant": variant, "mode": mode, "vocab": a.mem_vocab, "hidden": a.mem_hidden,
            "T": a.mem_T, "chunk": a.mem_chunk}) for variant in MEMORY_VARIANTS}
        for v in ("gspo", "checkpoint"):
            r[f"ratio_{v}_over_naive"] = r[v]["extra_peak_mb"] / r["naive"]["extra_peak_mb"]
        res[mode] = r
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--response-len", type=int, default=32)
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--square", type=int, default=2048, help="also time a square mm (0: no)")
    p.add_argument("--peak-gflop", type=float, default=2.0, help="work per matmul timing")
    p.add_argument("--mem-vocab", type=int, default=49152)
    p.add_argument("--mem-hidden", type=int, default=576)
    p.add_argument("--mem-T", type=int, default=1024)
    p.add_argument("--mem-chunk", type=int, default=256, help="gspo's logprob_chunk")
    p.add_argument("--skip", default="", help="comma list of parts to skip: update,memory")
    p.add_argument("--out", default=None)
    p.add_argument("--tag", default="")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(a.threads)
    skip = set(filter(None, a.skip.split(",")))
    data: dict[str, Any] = {"config": vars(a), "machine": machine()}
    rows = []
    if "update" not in skip:
        u = data["update"] = run_update(a)
        for name in ("plain", "packed"):
            x = u[name]
            rows.append(f"| update phase, {name} log-probs | {a.model}, {a.threads} thr | "
                        f"{fmt(x['s'])} s | {fmt(x['gflops'], 1)} GFLOP/s executed "
                        f"({fmt(100 * x['frac_of_peak'], 0)}% of {fmt(u['matmul_peak_gflops'], 1)}"
                        f" peak); {fmt(x['effective_gflops'], 1)} GFLOP/s plain-equivalent |")
    if "memory" not in skip:
        m = data["memory"] = run_memory(a)
        for mode in MEMORY_MODES:
            x = m[mode]
            rows.append(f"| log-prob step peak memory, V={a.mem_vocab} T={a.mem_T}, {mode} | "
                        f"chunk {a.mem_chunk} | token_logprobs "
                        f"{fmt(x['gspo']['extra_peak_mb'], 0)} MiB, checkpointed chunks "
                        f"{fmt(x['checkpoint']['extra_peak_mb'], 0)} MiB, naive "
                        f"{fmt(x['naive']['extra_peak_mb'], 0)} MiB | ratios "
                        f"{fmt(x['ratio_gspo_over_naive'], 2)} / "
                        f"{fmt(x['ratio_checkpoint_over_naive'], 2)} |")
    name = result_name("update", a.model, a.tag)
    header = "| measurement | setting | result | detail |\n|---|---|---|---|"
    write_result(name, data, header, rows, a.out)
    print("\n".join([header, *rows]))
    return data


if __name__ == "__main__":
    if not child_main(sys.argv[1:], memory_child):
        main()
