"""Your own data and reward functions, from Python: teach a model world capitals.

    python examples/custom_reward.py                        # SmolLM2-135M-Instruct
    python examples/custom_reward.py --data my.jsonl task.answer_field=label
    python examples/custom_reward.py --smoke                # tiny random model, 2 steps

The JSONL file has the columns question, city and country. ``task.prompt_field`` and
``task.answer_field`` name the prompt and reference columns; every other column (country) is
passed to each reward function as a keyword argument, one value per response.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gspo import Trainer, load_config

SMOKE = ["model=tiny:llama", "steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
         "rollout.max_new_tokens=4", "rollout.eval_max_new_tokens=4",
         "objective.num_minibatches=2", "progress=false", "num_threads=1"]
DATA = Path(__file__).parent / "data" / "capitals.jsonl"


def correct_city(prompts: list[str], completions: list[str], *, answer: list[str],
                 country: list[str], **_) -> list[float]:
    """1.0 when the response's first word is the capital; ``country`` is unused here, it only
    shows that extra columns arrive as keyword arguments."""
    out = []
    for completion, city in zip(completions, answer):
        words = completion.split()
        out.append(float(bool(words) and words[0].strip(".,!").lower() == city.lower()))
    return out


def brevity(prompts: list[str], completions: list[str], **_) -> list[float]:
    """1.0 for a one-word answer, 1/n for n words (0 for an empty response)."""
    return [1.0 / len(c.split()) if c.split() else 0.0 for c in completions]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(DATA), help="JSONL file (default: capitals)")
    p.add_argument("--smoke", action="store_true", help="tiny random model, 2 steps")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = p.parse_args(argv)
    cfg = load_config(None, ["task.prompt_field=question", "task.answer_field=city",
                             "task.eval_size=4", "rollout.max_new_tokens=8",
                             *(SMOKE if args.smoke else []), *args.overrides])
    cfg.reward.weights = [1.0, 0.2]  # one per reward function; each is logged as reward/<name>

    from datasets import load_dataset  # a list of dicts works too

    data = load_dataset("json", data_files=args.data, split="train")
    trainer = Trainer(cfg, reward_fns=[correct_city, brevity], train_dataset=data).setup()
    result = trainer.train()
    print(f"run folder: {result['run_dir']}")
    return result


if __name__ == "__main__":
    main()
