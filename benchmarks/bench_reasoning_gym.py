"""Which reasoning-gym datasets give SmolLM2-135M-Instruct any reward before training?

For each dataset (``task.name=reasoning_gym task.subset=<name>``, default difficulty unless
``--options`` says otherwise), the first ``--prompts`` held-out problems, formatted as the
trainer formats them (chat template, the default system prompt), answered greedily and with
``--samples`` samples each at ``--temperature`` (top_k 0, top_p 1: the policy's own
distribution), scored by the ``reasoning_gym`` reward (the dataset's own verifier). A dataset
is worth RL from this model when sampled groups have reward variance, i.e. some non-zero
rewards.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m benchmarks.bench_reasoning_gym
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from benchmarks.common import fmt, machine, result_name, write_result

DATASETS = ["chain_sum", "basic_arithmetic", "leg_counting", "letter_counting", "spell_backward"]


def measure(model: Any, tokenizer: Any, name: str, options: dict[str, Any],
            args: argparse.Namespace) -> dict[str, Any]:
    from gspo.config import TaskConfig
    from gspo.data import build_task, format_prompt
    from gspo.models.tokens import eos_ids
    from gspo.rewards import RewardScorer
    from gspo.rollout import SamplingParams, generate, greedy_generate

    task = build_task(TaskConfig(name="reasoning_gym", subset=name, options=options,
                                 eval_size=args.prompts), seed=0)
    examples = task.eval_examples[:args.prompts]
    prompts = [format_prompt(tokenizer, ex.prompt, chat_template=True,
                             system_prompt=TaskConfig().system_prompt) for ex in examples]
    eos, pad = eos_ids(model, tokenizer), tokenizer.pad_token_id
    scorer = RewardScorer.from_specs(["reasoning_gym"])
    t0 = time.perf_counter()
    greedy = tokenizer.batch_decode(greedy_generate(
        model, prompts, max_new_tokens=args.max_new_tokens, eos=eos, pad_id=pad),
        skip_special_tokens=True)
    roll = generate(model, prompts, group_size=args.samples,
                    params=SamplingParams(args.max_new_tokens, args.temperature),
                    eos=eos, pad_id=pad,
                    generator=[torch.Generator().manual_seed(i) for i in range(len(prompts))])
    sampled = tokenizer.batch_decode(roll.response_ids, skip_special_tokens=True)
    seconds = time.perf_counter() - t0

    def score(texts: list[str], reps: int) -> list[float]:
        rows = [ex for ex in examples for _ in range(reps)]
        columns = {"answer": [ex.answer for ex in rows]}
        columns |= {k: [ex.columns[k] for ex in rows] for k in rows[0].columns}
        total, _ = scorer([ex.prompt for ex in rows], texts, columns)
        return [0.0 if r != r else r for r in total]

    g, s = score(greedy, 1), score(sampled, args.samples)
    groups = [s[i:i + args.samples] for i in range(0, len(s), args.samples)]
    return {"dataset": name, "options": options, "n_prompts": len(examples),
            "greedy_reward_mean": sum(g) / len(g),
            "greedy_solved": sum(r >= 1 for r in g) / len(g),
            "sampled_reward_mean": sum(s) / len(s),
            "sampled_nonzero": sum(r > 0 for r in s) / len(s),
            "sampled_solved": sum(r >= 1 for r in s) / len(s),
            "groups_with_variance": sum(max(x) > min(x) for x in groups) / len(groups),
            "answer_tags": sum("<answer>" in t for t in greedy + sampled) / len(greedy + sampled),
            "seconds": seconds,
            "example": {"question": examples[0].prompt, "reference": examples[0].answer,
                        "greedy": greedy[0]}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--datasets", default=",".join(DATASETS))
    p.add_argument("--options", default="{}",
                   help='JSON: dataset -> options, e.g. {"chain_sum": {"max_terms": 2}}')
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args(argv)
    from gspo.models import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    model.eval()
    options = json.loads(args.options)
    rows = [measure(model, tokenizer, name, options.get(name, {}), args)
            for name in args.datasets.split(",")]
    md = ["| dataset | greedy reward | greedy solved | sampled reward | sampled > 0 | "
          "sampled solved | groups with variance | `<answer>` tags |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        opts = f" `{json.dumps(r['options'])}`" if r["options"] else ""
        md.append(f"| {r['dataset']}{opts} | {fmt(r['greedy_reward_mean'])} | "
                  f"{100 * r['greedy_solved']:.0f}% | {fmt(r['sampled_reward_mean'])} | "
                  f"{100 * r['sampled_nonzero']:.0f}% | {100 * r['sampled_solved']:.0f}% | "
                  f"{100 * r['groups_with_variance']:.0f}% | {100 * r['answer_tags']:.0f}% |")
    cmd = "OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m benchmarks.bench_reasoning_gym " + \
        " ".join(argv or sys.argv[1:])
    md += ["", f"{args.prompts} held-out prompts per dataset, greedy and {args.samples} samples "
           f"at temperature {args.temperature}, {args.max_new_tokens} new tokens. "
           f"`{cmd.strip()}`"]
    header = f"# reasoning-gym datasets: reward of `{args.model}` before training\n"
    write_result(result_name("reasoning_gym", args.model),
                 {"settings": vars(args), "command": cmd.strip(), "machine": machine(),
                  "rows": rows}, header, md)
    print("\n".join(md))


if __name__ == "__main__":
    main()
