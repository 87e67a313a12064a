"""LoRA on a local Hugging Face model folder, on the bundled grade-school word problems.

    python examples/lora_local_model.py --model /path/to/Qwen2.5-0.5B-Instruct --out merged/
    python examples/lora_local_model.py --model DIR --smoke     # 2 steps (a test runs this)

Only a rank-16 adapter trains; the base weights stay frozen, checkpoints hold the adapter
alone, and with ``objective.beta > 0`` the KL reference is the same model with the adapter
switched off (no second copy). At the end the adapter is merged into full weights at --out,
which ``AutoModelForCausalLM.from_pretrained(out)`` loads (``gspo export RUN --merged OUT``
does the same from the shell). With ``pip install math-verify``, use
``reward.functions=[math_verify,boxed_format]`` for symbolic answer checking.
"""

from __future__ import annotations

import argparse

from gspo import Trainer, export_merged, load_config

SMOKE = ["steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
         "rollout.max_new_tokens=4", "rollout.eval_max_new_tokens=4", "task.eval_size=2",
         "objective.num_minibatches=2", "progress=false", "num_threads=1"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="local Hugging Face causal-LM folder")
    p.add_argument("--out", default="", help="merged model folder (default: RUN/merged)")
    p.add_argument("--smoke", action="store_true", help="2 short steps")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = p.parse_args(argv)
    cfg = load_config(None, [
        f"model={args.model}", "task.name=gsm8k_mini", "lora.r=16", "lora.alpha=32",
        "reward.functions=[numeric_match,boxed_format]", "reward.weights=[1.0,0.1]",
        "rollout.max_new_tokens=256", "rollout.eval_max_new_tokens=256", "optim.lr=1e-5",
        *(SMOKE if args.smoke else []), *args.overrides])

    trainer = Trainer(cfg).setup()
    result = trainer.train()

    out = export_merged(trainer.run_dir, args.out or trainer.run_dir / "merged")
    print(f"merged model: {out}")
    return {**result, "merged": str(out)}


if __name__ == "__main__":
    main()
