"""gspo's KV-cached sampler vs Hugging Face ``model.generate`` on the same batch, interleaved.

Both sample B prompts × G responses in fp32 with the same settings (temperature, top_k=0,
top_p=1, max_new_tokens, the same EOS ids). HF gets ``num_return_sequences=G``, which is how
TRL calls it (every row prefilled); gspo prefills each prompt once. Response tokens count up to
and including the first EOS. A greedy pass checks that both decode the same tokens.
With one thread (the default) times are CPU seconds of the process, robust to other load.

    python -m benchmarks.bench_rollout --model smollm2-135m-instruct
    python -m benchmarks.bench_rollout --model tiny:llama --reps 5
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from benchmarks.common import PROMPT_SETS, fmt, machine, median, now, result_name, write_result


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def _until_eos(rows: list[list[int]], eos: list[int]) -> list[list[int]]:
    out = []
    for row in rows:
        cut = next((j + 1 for j, x in enumerate(row) if x in eos), len(row))
        out.append(row[:cut])
    return out


@torch.no_grad()
def hf_generate(model: Any, prompts: list[list[int]], *, group_size: int, max_new_tokens: int,
                temperature: float, eos: list[int], pad_id: int,
                greedy: bool = False) -> list[list[int]]:
    """``model.generate`` with the policy's own distribution (top_k=0, top_p=1)."""
    ids, mask = _left_pad(prompts, pad_id)
    sampling = {} if greedy else {"temperature": temperature, "top_k": 0, "top_p": 1.0}
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=not greedy,
                         max_new_tokens=max_new_tokens, num_return_sequences=group_size,
                         eos_token_id=eos, pad_token_id=pad_id, **sampling)
    return _until_eos(out[:, ids.shape[1]:].tolist(), eos)


def gspo_generate(model: Any, prompts: list[list[int]], *, group_size: int, max_new_tokens: int,
                  temperature: float, eos: list[int], pad_id: int, greedy: bool = False,
                  seed: int = 0) -> list[list[int]]:
    from gspo.rollout import SamplingParams, generate

    roll = generate(model, prompts, group_size=group_size, eos=eos, pad_id=pad_id,
                    params=SamplingParams(max_new_tokens, temperature, 1.0, 0),
                    generator=torch.Generator().manual_seed(seed), greedy=greedy)
    return roll.response_ids


def greedy_check(model: Any, prompts: list[list[int]], *, max_new_tokens: int, eos: list[int],
                 pad_id: int) -> dict[str, Any]:
    """Greedy decoding of every prompt in one batch: gspo vs HF token ids."""
    kw = {"group_size": 1, "max_new_tokens": max_new_tokens, "temperature": 1.0, "eos": eos,
          "pad_id": pad_id, "greedy": True}
    a, b = gspo_generate(model, prompts, **kw), hf_generate(model, prompts, **kw)
    equal = [x == y for x, y in zip(a, b)]
    return {"rows": len(equal), "rows_equal": sum(equal), "all_equal": all(equal)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--prompts", choices=sorted(PROMPT_SETS), default="story",
                   help="story: every response runs to max_new_tokens; arithmetic: short "
                        "answers (EOS at different steps); fewshot: arithmetic after 8 examples")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1,
                   help="1: times are CPU seconds of the process (robust to other load)")
    p.add_argument("--greedy-prompts", type=int, default=16)
    p.add_argument("--out", default=None)
    p.add_argument("--tag", default="")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    from gspo.data import format_prompt
    from gspo.models import load_model
    from gspo.models.tokens import eos_ids

    torch.set_num_threads(a.threads)
    model, tok = load_model(a.model)
    model.eval()
    eos, pad = eos_ids(model, tok), tok.pad_token_id
    texts, system = PROMPT_SETS[a.prompts]
    prompts = [format_prompt(tok, x, system_prompt=system) for x in texts[: a.prompts_per_step]]
    kw = {"group_size": a.group_size, "max_new_tokens": a.max_new_tokens,
          "temperature": a.temperature, "eos": eos, "pad_id": pad}
    arms = {"gspo": lambda r: gspo_generate(model, prompts, seed=r, **kw),
            "hf": lambda r: (torch.manual_seed(r), hf_generate(model, prompts, **kw))[1]}
    for f in arms.values():  # warm-up
        f(0)
    times: dict[str, list[float]] = {k: [] for k in arms}
    rates: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(a.reps):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            clock = 1 if a.threads == 1 else 0  # CPU seconds with one thread, else wall
            t0 = now()[clock]
            rows = arms[name](r + 1)
            dt = now()[clock] - t0
            times[name].append(dt)
            rates[name].append(sum(len(x) for x in rows) / dt)
    pair = [g / h for g, h in zip(rates["gspo"], rates["hf"])]
    check = greedy_check(model, [format_prompt(tok, x, system_prompt=system)
                                 for x in texts[: a.greedy_prompts]],
                         max_new_tokens=a.max_new_tokens, eos=eos, pad_id=pad)
    summary = {k: {"tok_s": median(rates[k]), "s": median(times[k])} for k in arms}
    data = {"config": vars(a), "machine": machine(), "summary": summary,
            "clock": "cpu" if a.threads == 1 else "wall",
            "ratio_gspo_over_hf": median(pair), "paired_ratios": pair, "raw_tok_s": rates,
            "greedy_check": check}
    name = result_name("rollout", a.model, a.prompts, a.tag)
    header = ("| model | prompts (mean tokens) | threads | batch | gspo tok/s | HF generate tok/s "
              "| gspo/HF | greedy equal |\n|---|---|---|---|---|---|---|---|")
    mean_len = sum(len(x) for x in prompts) / len(prompts)
    rows = [f"| {a.model} | {a.prompts} ({mean_len:.0f}) | {a.threads} | "
            f"{a.prompts_per_step}×{a.group_size}×{a.max_new_tokens}"
            f" | {fmt(summary['gspo']['tok_s'], 1)} | {fmt(summary['hf']['tok_s'], 1)} | "
            f"{fmt(median(pair))}× | {check['rows_equal']}/{check['rows']} |"]
    write_result(name, data, header, rows, a.out)
    print("\n".join([header, *rows]))
    return data


if __name__ == "__main__":
    main()
