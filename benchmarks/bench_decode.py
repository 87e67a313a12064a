"""What bounds a decode step: its time against the model's own matmuls at decode and at large batch.

A decode step of B rows runs every linear layer once on B rows, reading all the weights. This
script times, on one thread:

1. one KV-cached decode step of the model at batch B (context ``--context`` tokens), median,
   through ``forward`` and through gspo's :class:`gspo.models.decode.DenseDecoder` (the
   sampler's default for Llama-family models: the same arithmetic without ``forward``'s
   per-call overhead, in inference mode);
2. each linear layer's ``F.linear`` on B rows and on 256 rows, in model order, so that the
   weights stream from memory as they do in a step (sum of times, GFLOP/s, weight bytes/s);
3. the output layer alone at B rows.

If (2) at B rows takes most of (1) and runs far below its 256-row GFLOP/s, the step is bound
by reading the weights, which any engine decoding the same batch in the same precision pays.

    python -m benchmarks.bench_decode --model smollm2-135m-instruct
    python -m benchmarks.bench_decode --model tiny:llama
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from benchmarks.common import fmt, machine, median, median_time, result_name, write_result


@torch.no_grad()
def decode_step_s(model: Any, batch: int, context: int, reps: int) -> float:
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (batch, context))
    mask = torch.ones_like(ids)
    out = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
    key = "cache" if "cache" in out else "past_key_values"
    cache, tok = out[key], torch.randint(3, vocab, (batch, 1))
    times = []
    for step in range(reps + 1):
        mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype)], dim=1)
        t0 = time.process_time()
        model(input_ids=tok, attention_mask=mask,
              position_ids=torch.full((batch, 1), context + step), **{key: cache},
              use_cache=True)
        times.append(time.process_time() - t0)
    return median(times[1:])


@torch.no_grad()
def lean_step_s(model: Any, batch: int, context: int, reps: int) -> float | None:
    """The same step through :class:`DenseDecoder` as the sampler runs it (cache with room
    reserved, inference mode where safe); None for models it does not cover."""
    from gspo.models.decode import DenseDecoder, unsupported
    from gspo.models.lean_forward import inference_safe, no_autograd
    from gspo.rollout.sampler import _reserve

    if unsupported(model) is not None:
        return None
    with no_autograd(inference_safe(model)):
        ids = torch.randint(3, model.config.vocab_size, (batch, context))
        mask = torch.ones_like(ids)
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        _reserve(out["cache"], reps + 1)
        decoder = DenseDecoder(model, out["cache"], mask, reps + 1)
        tok = torch.randint(3, model.config.vocab_size, (batch,))
        times = []
        for step in range(reps + 1):
            t0 = time.process_time()
            decoder.step(tok, torch.full((batch,), context + step))
            times.append(time.process_time() - t0)
    return median(times[1:])


@torch.no_grad()
def linear_pass(layers: list[torch.Tensor], rows: int, reps: int) -> dict[str, float]:
    """All the model's linear layers once, in order, on ``rows`` rows (weights [out, in])."""
    xs = [torch.randn(rows, w.shape[1]) for w in layers]

    def run() -> None:
        for x, w in zip(xs, layers):
            torch.nn.functional.linear(x, w)

    s = median_time(run, reps, time.process_time)
    flop = sum(2 * rows * w.numel() for w in layers)
    nbytes = sum(w.numel() * w.element_size() for w in layers)
    return {"s": s, "gflops": flop / s / 1e9, "weight_gb_s": nbytes / s / 1e9}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=56)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--out", default=None)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    from gspo.models import load_model

    torch.set_num_threads(1)
    model, _ = load_model(a.model)
    model.eval()
    head = model.get_output_embeddings()
    body = [m.weight.detach() for m in model.modules()
            if isinstance(m, torch.nn.Linear) and m is not head]
    head = head.weight.detach()
    layers = [*body, head]
    step = decode_step_s(model, a.batch, a.context, a.reps)
    lean = lean_step_s(model, a.batch, a.context, a.reps)
    at_b = linear_pass(layers, a.batch, a.reps)
    at_256 = linear_pass(layers, 256, max(2, a.reps // 4))
    head_b = linear_pass([head], a.batch, a.reps)
    data = {"config": vars(a), "machine": machine(), "decode_step_s": step,
            "dense_decoder_step_s": lean,
            "linears_at_batch": at_b, "linears_at_256": at_256, "head_at_batch": head_b,
            "weight_mb": sum(w.numel() * 4 for w in layers) / 2**20,
            "linear_share_of_step": at_b["s"] / step}
    header = ("| model | batch | decode step via forward (CPU s) | via DenseDecoder "
              "| its linears at this batch "
              "| share of the step | the same linears at 256 rows | output layer at this batch |\n"
              "|---|---|---|---|---|---|---|---|")
    lean_cell = "—" if lean is None else f"{fmt(lean, 4)} ({fmt(step / lean)}× faster)"
    row = (f"| {a.model} | {a.batch} | {fmt(step, 4)} | {lean_cell} | {fmt(at_b['s'], 4)} s, "
           f"{fmt(at_b['gflops'], 1)} GFLOP/s, {fmt(at_b['weight_gb_s'], 1)} GB/s of weights "
           f"({fmt(data['weight_mb'], 1)} MiB) | {fmt(data['linear_share_of_step'])} | "
           f"{fmt(at_256['gflops'], 1)} GFLOP/s | {fmt(head_b['gflops'], 1)} GFLOP/s |")
    name = result_name("decode", a.model)
    write_result(name, data, header, [row], a.out)
    print("\n".join([header, row]))
    return data


if __name__ == "__main__":
    main()
