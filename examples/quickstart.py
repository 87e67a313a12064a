"""The shortest complete run: SmolLM2-135M-Instruct learns small sums with GSPO.

    python examples/quickstart.py                  # the default recipe (same as `gspo train`)
    python examples/quickstart.py --smoke          # tiny random model, 2 steps (a test runs this)
    python examples/quickstart.py steps=100 objective.name=grpo   # any config key=value

Metrics go to RUN/metrics.jsonl and RUN/tensorboard; `gspo plot RUN` draws them.
"""

from __future__ import annotations

import argparse

from gspo import Trainer, load_config

# A tiny random model and a handful of short rollouts: checks the program, learns nothing.
SMOKE = ["model=tiny:llama", "steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
         "rollout.max_new_tokens=4", "rollout.eval_max_new_tokens=4", "task.eval_size=2",
         "objective.num_minibatches=2", "progress=false", "num_threads=1"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny random model, 2 steps")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = p.parse_args(argv)
    cfg = load_config(None, [*(SMOKE if args.smoke else []), *args.overrides])

    result = Trainer(cfg).setup().train()

    before, after = result["before"], result["after"]
    if before and after:
        print(f"held-out accuracy {before['accuracy']:.1%} -> {after['accuracy']:.1%}")
    print(f"run folder: {result['run_dir']}")
    return result


if __name__ == "__main__":
    main()
