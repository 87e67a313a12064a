"""How small a GSPO sequence ratio can be resolved: the log-ratio noise floor at fixed weights.

At identical weights every sequence ratio s_i should be exactly 1; whatever
|mean_t (log π_a − log π_b)| comes out is numerical noise, and it must sit well below the clip
range ε = 3e-4 for clipping to act on policy change rather than on noise (target ≤ 3e-5).
Measured per sequence (response tokens only) between:

- the trainer's pass over the whole rollout batch and the same rows in a random minibatch cut
  to its own width (what the update sees), and each row alone (no padding at all);
- the plain pass and the prompt-sharing pass (:mod:`gspo.models.packing`);
- the sampler's log-probs (KV-cached decoding) and the trainer's;
- the lean pass (:mod:`gspo.models.lean_forward`, the default where the model allows it) and
  ``forward``.

For the fp32 default and a bf16 variant (bf16 weights and activations, fp32 LM head as in
TRL's ``cast_lm_head_to_fp32``), with the variant's speed (CPU seconds, one thread).

    python -m benchmarks.bench_noise_floor --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from typing import Any

import torch

from benchmarks.common import PROMPTS, fmt, machine, median, result_name, write_result


def seq_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """|mean over response tokens of (a − b)| per sequence [N]."""
    return (((a - b) * mask).sum(-1) / mask.sum(-1).clamp(min=1)).abs()


def bf16_with_fp32_head(model: Any) -> Any:
    """A bf16 copy whose output layer keeps fp32 weights and runs on fp32 hidden states."""
    fp32_head = model.get_output_embeddings().weight.detach().clone()
    m = copy.deepcopy(model).to(torch.bfloat16)
    head = torch.nn.Linear(fp32_head.shape[1], fp32_head.shape[0], bias=False)
    head.weight = torch.nn.Parameter(fp32_head)
    head.register_forward_pre_hook(lambda _, args: (args[0].float(),))
    m.config.tie_word_embeddings = False
    m.set_output_embeddings(head)
    return m


def passes(model: Any, roll: Any, pad_id: int, temperature: float,
           seed: int = 0) -> dict[str, Any]:
    """Per-sequence gaps between trainer passes of different composition, and the sampler.
    The passes run as the trainer runs them: through the lean pass where the model allows it
    (``lean_forward``, the default), and ``lean_vs_forward`` compares it with ``forward``."""
    from gspo.models.lean_forward import lean_unsupported
    from gspo.models.logprobs import token_logprobs
    from gspo.models.packing import shared_prefix_logprobs
    from gspo.rollout import pad_batch

    b = pad_batch(roll.prompt_ids, roll.response_ids, pad_id, roll.logprobs)
    ids, att, mask = b["input_ids"], b["attention_mask"], b["response_mask"]
    lean = lean_unsupported(model) is None
    kw = {"temperature": temperature, "lean": lean}
    model.eval()
    with torch.no_grad():
        full, _ = token_logprobs(model, ids, att, mask, **kw)
        forward, _ = token_logprobs(model, ids, att, mask, temperature=temperature)
        packed, _ = shared_prefix_logprobs(model, ids, att, mask, **kw)
        alone = torch.zeros_like(full)
        for i in range(ids.shape[0]):
            w = int(att[i].sum())
            alone[i, :w] = token_logprobs(model, ids[i:i + 1, :w], att[i:i + 1, :w],
                                          mask[i:i + 1, :w], **kw)[0][0]
        idx = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(seed))
        idx = idx[: ids.shape[0] // 2].sort().values
        w = int(att[idx].sum(-1).max())
        minibatch, _ = token_logprobs(model, ids[idx, :w], att[idx, :w], mask[idx, :w], **kw)
    gaps = {"minibatch_vs_full": seq_gap(minibatch, full[idx, :w], mask[idx, :w]),
            "alone_vs_full": seq_gap(alone, full, mask),
            "packed_vs_plain": seq_gap(packed, full, mask),
            "sampler_vs_trainer": seq_gap(b["old_logprobs"], full, mask),
            "lean_vs_forward": seq_gap(full, forward, mask)}
    return {k: {"max": float(v.max()), "median": float(v.median())} for k, v in gaps.items()}


def speed(model: Any, roll: Any, pad_id: int, temperature: float) -> dict[str, float]:
    """CPU seconds: one no-grad pass over the batch, fwd+bwd over half of it; tokens/s sampling."""
    from gspo.models.lean_forward import lean_unsupported
    from gspo.models.logprobs import token_logprobs
    from gspo.rollout import pad_batch

    b = pad_batch(roll.prompt_ids, roll.response_ids, pad_id)
    ids, att, mask = b["input_ids"], b["attention_mask"], b["response_mask"]
    kw = {"temperature": temperature, "lean": lean_unsupported(model) is None}
    model.eval()
    c = time.process_time()
    with torch.no_grad():
        token_logprobs(model, ids, att, mask, **kw)
    fwd = time.process_time() - c
    half = ids.shape[0] // 2
    model.train()
    c = time.process_time()
    lp, _ = token_logprobs(model, ids[:half], att[:half], mask[:half], **kw)
    lp.sum().backward()
    fb = time.process_time() - c
    model.zero_grad(set_to_none=True)
    return {"logprob_pass_cpu_s": fwd, "fwd_bwd_half_batch_cpu_s": fb}


def sample(model: Any, prompts: list[list[int]], a: argparse.Namespace, eos: list[int],
           pad_id: int, seed: int) -> tuple[Any, float]:
    from gspo.rollout import SamplingParams, generate

    c = time.process_time()
    roll = generate(model, prompts, group_size=a.group_size, eos=eos, pad_id=pad_id,
                    params=SamplingParams(a.max_new_tokens, a.temperature, 1.0, 0),
                    generator=torch.Generator().manual_seed(seed))
    dt = time.process_time() - c
    return roll, sum(len(r) for r in roll.response_ids) / dt


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=2, help="timing repetitions per variant")
    p.add_argument("--target", type=float, default=3e-5)
    p.add_argument("--out", default=None)
    p.add_argument("--tag", default="")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    from gspo.data import format_prompt
    from gspo.models import load_model
    from gspo.models.tokens import eos_ids

    torch.set_num_threads(1)
    fp32, tok = load_model(a.model)
    eos, pad = eos_ids(fp32, tok), tok.pad_token_id
    prompts = [format_prompt(tok, x) for x in PROMPTS[: a.prompts]]
    variants = {"fp32": fp32, "bf16 (fp32 head)": bf16_with_fp32_head(fp32)}
    results: dict[str, Any] = {}
    for name, model in variants.items():
        roll, _ = sample(model, prompts, a, eos, pad, seed=0)
        results[name] = {"gaps": passes(model, roll, pad, a.temperature)}
        worst = max(g["max"] for g in results[name]["gaps"].values())
        results[name]["worst_gap"] = worst
        results[name]["ratio_meaningful"] = worst <= a.target
    timing: dict[str, dict[str, list[float]]] = {k: {} for k in variants}
    for r in range(a.reps):  # interleaved
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            roll, rate = sample(variants[name], prompts, a, eos, pad, seed=r + 1)
            t = speed(variants[name], roll, pad, a.temperature)
            t["sampler_tok_per_cpu_s"] = rate
            for k, v in t.items():
                timing[name].setdefault(k, []).append(v)
    for name in variants:
        results[name]["speed"] = {k: median(v) for k, v in timing[name].items()}
    with torch.no_grad():  # how far the bf16 policy is from the fp32 one it was cast from
        roll, _ = sample(fp32, prompts, a, eos, pad, seed=99)
        from gspo.models.logprobs import token_logprobs
        from gspo.rollout import pad_batch

        b = pad_batch(roll.prompt_ids, roll.response_ids, pad)
        args = (b["input_ids"], b["attention_mask"], b["response_mask"])
        d = seq_gap(token_logprobs(variants["bf16 (fp32 head)"], *args)[0],
                    token_logprobs(fp32, *args)[0], b["response_mask"])
    results["bf16_vs_fp32_policy"] = {"max": float(d.max()), "median": float(d.median())}
    data = {"config": vars(a), "machine": machine(), "results": results}
    header = ("| variant | minibatch vs full | alone vs full | packed vs plain "
              "| sampler vs trainer | lean vs forward | ≤ 3e-5? | sampler tok/CPU-s "
              "| log-prob pass CPU s | fwd+bwd (8 rows) CPU s |\n"
              "|---|---|---|---|---|---|---|---|---|---|")
    rows = []

    def cell(g: dict[str, Any], k: str) -> str:
        return f"{g[k]['max']:.1e} ({g[k]['median']:.0e})"

    for name in variants:
        g, s = results[name]["gaps"], results[name]["speed"]
        rows.append(f"| {a.model} {name} | {cell(g, 'minibatch_vs_full')} | "
                    f"{cell(g, 'alone_vs_full')} | {cell(g, 'packed_vs_plain')} | "
                    f"{cell(g, 'sampler_vs_trainer')} | {cell(g, 'lean_vs_forward')} | "
                    f"{'yes' if results[name]['ratio_meaningful'] else 'NO'} | "
                    f"{fmt(s['sampler_tok_per_cpu_s'], 1)} | {fmt(s['logprob_pass_cpu_s'])} | "
                    f"{fmt(s['fwd_bwd_half_batch_cpu_s'])} |")
    bf = results["bf16_vs_fp32_policy"]
    rows.append(f"| bf16 policy vs the fp32 policy it was cast from | | | | "
                f"{bf['max']:.1e} ({bf['median']:.0e}) | | | | | |")
    name = result_name("noise_floor", a.model, a.tag)
    write_result(name, data, header, rows, a.out)
    print("\n".join([header, *rows]))
    return data


if __name__ == "__main__":
    main()
