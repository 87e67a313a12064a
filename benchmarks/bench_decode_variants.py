"""Decode-step variants tried against gspo's default and not built (SmolLM2, 1 and 2 threads).

Each thread count runs in its own child process; every row is the median of ``--reps``
timings, the variants alternating within the child.

1. ``fuse``: the packed (oneDNN) decode with q/k/v and gate/up as one product each
   (:class:`gspo.models.decode.DenseDecoder` ``fuse=True``: the weights concatenated, then
   packed, once per rollout) against one product per projection (the default for SmolLM2):
   a whole rollout of 2 prompts × 8 samples × 32 tokens through
   :func:`gspo.rollout.sampler.generate`, and the decoder's construction (packing) alone.
2. ``attention``: one layer's decode attention for 16 rows (9 query heads over 3 key/value
   heads, head size 64) over 45 and 75 cached positions, written out as the decode step does
   (two batched products and a softmax) against ``F.scaled_dot_product_attention``.
3. ``layout``: one decode step's layer products (30 layers × q, k, v, o, gate, up, down at 16
   rows) on weights packed for oneDNN against the same oneDNN call on the weights as they are
   (no per-rollout reorder), and the reorder itself; the same for the output layer.

    HF_HUB_OFFLINE=1 python -m benchmarks.bench_decode_variants [--reps 7] [--tag T]  # ~2 min
"""

from __future__ import annotations

import sys
import time
from typing import Any

from benchmarks.common import child_main, median, median_time, report, thread_children

MODEL = "smollm2-135m-instruct"
LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def _fuse(reps: int) -> dict[str, Any]:
    import torch

    import gspo.rollout.sampler as sampler
    from gspo.models import load_model

    model, tok = load_model(MODEL)
    model.eval()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"What is {a}+{b}?"}],
                                       add_generation_prompt=True) for a, b in ((12, 34), (56, 7))]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    params = sampler.SamplingParams(max_new_tokens=32, temperature=1.0, top_p=1.0, top_k=0)
    real = sampler.DenseDecoder
    built: dict[bool, list[float]] = {False: [], True: []}
    rollout: dict[bool, list[float]] = {False: [], True: []}
    try:
        for rep in range(reps + 1):
            for fuse in (False, True):
                def timed(*a: Any, fuse: bool = fuse, **k: Any) -> Any:
                    t0 = time.perf_counter()
                    decoder = real(*a, fuse=fuse, **k)
                    built[fuse].append(time.perf_counter() - t0)
                    return decoder

                sampler.DenseDecoder = timed  # type: ignore[misc]
                t0 = time.perf_counter()
                sampler.generate(model, prompts, group_size=8, params=params, eos=[-1],
                                 pad_id=0, generator=torch.Generator().manual_seed(rep))
                if rep:  # the first of each is a warm-up
                    rollout[fuse].append(time.perf_counter() - t0)
    finally:
        sampler.DenseDecoder = real  # type: ignore[misc]
    return {name: {"rollout_s": median(rollout[f]), "build_s": median(built[f][1:])}
            for name, f in (("separate", False), ("fused", True))}


def _attention(reps: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    n, heads, kv, d, width = 16, 9, 3, 64, 80
    g, scale = heads // kv, d ** -0.5
    keys, values = torch.randn(n, kv, width, d), torch.randn(n, kv, width, d)
    bias = torch.zeros(n, 1, 1, width)
    bias[:3, ..., :5] = float("-inf")  # left padding in three rows
    q = torch.randn(n, heads, 1, d)

    def written(s: int) -> Any:  # as gspo.models.decode.DenseDecoder.step
        k, v = keys[:, :, :s], values[:, :, :s]
        scores = torch.matmul(q.view(n, -1, g, d), k.transpose(-1, -2))
        w = torch.softmax(scores.mul_(scale).add_(bias[..., :s]), dim=-1, dtype=torch.float32)
        return torch.matmul(w, v).reshape(n, -1)

    def sdpa(s: int) -> Any:
        return F.scaled_dot_product_attention(
            q, keys[:, :, :s], values[:, :, :s], attn_mask=bias[..., :s], scale=scale,
            enable_gqa=True).reshape(n, -1)

    calls, out = 100, {}  # calls per timing
    for s in (45, 75):
        out[str(s)] = {
            "written_us": median_time(lambda s=s: [written(s) for _ in range(calls)], reps)
            / calls * 1e6,
            "sdpa_us": median_time(lambda s=s: [sdpa(s) for _ in range(calls)], reps) / calls * 1e6,
            "max_abs_diff": float((written(s) - sdpa(s)).abs().max())}
    return out


def _layout(reps: int) -> dict[str, Any]:
    import torch

    pointwise, reorder = torch.ops.mkldnn._linear_pointwise, torch.ops.mkldnn._reorder_linear_weight
    weights = [torch.randn(n, k) * 0.02 for n, k in LAYER * 30]
    inputs = {576: torch.randn(16, 576), 1536: torch.randn(16, 1536)}
    packed = [reorder(w, 16) for w in weights]
    head = torch.randn(49152, 576) * 0.02
    head_packed = reorder(head, 16)

    def layers(ws: list[Any]) -> None:
        for w, raw in zip(ws, weights):
            pointwise(inputs[raw.shape[1]], w, None, "none", [], "")

    return {
        "layers_packed_ms": median_time(lambda: layers(packed), reps) * 1e3,
        "layers_plain_ms": median_time(lambda: layers(weights), reps) * 1e3,
        "layers_reorder_s": median_time(lambda: [reorder(w, 16) for w in weights], reps),
        "head_packed_ms": median_time(
            lambda: pointwise(inputs[576], head_packed, None, "none", [], ""), reps) * 1e3,
        "head_plain_ms": median_time(
            lambda: pointwise(inputs[576], head, None, "none", [], ""), reps) * 1e3,
        "head_reorder_s": median_time(lambda: reorder(head, 16), reps)}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    return {"threads": spec["threads"], "fuse": _fuse(spec["reps"]),
            "attention": _attention(spec["reps"]), "layout": _layout(spec["reps"])}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a, res = thread_children("benchmarks.bench_decode_variants", __doc__,
                             sys.argv[1:] if argv is None else argv, reps=7)
    rows = []
    for name in ("separate", "fused"):
        r1, r2 = res[1]["fuse"][name], res[2]["fuse"][name]
        rows.append(f"| rollout, q/k/v and gate/up {name} | {r1['rollout_s']:.3f} s "
                    f"(packing {r1['build_s']:.3f}) | {r2['rollout_s']:.3f} s "
                    f"(packing {r2['build_s']:.3f}) |")
    for s in ("45", "75"):
        r1, r2 = res[1]["attention"][s], res[2]["attention"][s]
        rows.append(f"| decode attention over {s} positions, written out / SDPA | "
                    f"{r1['written_us']:.1f} / {r1['sdpa_us']:.1f} µs | "
                    f"{r2['written_us']:.1f} / {r2['sdpa_us']:.1f} µs (max abs diff "
                    f"{r2['max_abs_diff']:.1e}) |")
    l1, l2 = res[1]["layout"], res[2]["layout"]
    rows.append(f"| one decode step's layer products, packed / plain layout; reorder of all "
                f"layers | {l1['layers_packed_ms']:.1f} / {l1['layers_plain_ms']:.1f} ms; "
                f"{l1['layers_reorder_s']:.3f} s | {l2['layers_packed_ms']:.1f} / "
                f"{l2['layers_plain_ms']:.1f} ms; {l2['layers_reorder_s']:.3f} s |")
    rows.append(f"| output layer at 16 rows, packed / plain layout; its reorder | "
                f"{l1['head_packed_ms']:.2f} / {l1['head_plain_ms']:.2f} ms; "
                f"{l1['head_reorder_s']:.3f} s | {l2['head_packed_ms']:.2f} / "
                f"{l2['head_plain_ms']:.2f} ms; {l2['head_reorder_s']:.3f} s |")
    header = "| variant | 1 thread | 2 threads |\n|---|---|---|"
    report(a, "decode_variants", res, header, rows)
    return res


if __name__ == "__main__":
    if not child_main(sys.argv[1:], run):
        main()
