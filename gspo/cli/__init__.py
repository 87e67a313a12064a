"""``gspo train | eval | validate`` — the command line."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from gspo.config import ConfigError, TrainConfig, describe_fields, load_config

EXIT_USAGE = 2
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, FileNotFoundError, FileExistsError)


def _user_errors() -> tuple[type[BaseException], ...]:
    from gspo.data import DataError
    from gspo.models import ModelError
    from gspo.objectives import UnknownNameError
    from gspo.rewards import RewardError, RewardSpecError

    return (*USER_ERRORS, DataError, ModelError, UnknownNameError, RewardError,
            RewardSpecError)


def _split_args(args: list[str]) -> tuple[str | None, list[str]]:
    path = None
    if args and "=" not in args[0]:
        path, args = args[0], args[1:]
    for a in args:
        if "=" not in a:
            raise ConfigError(f"expected key=value after the config file, got '{a}'")
    return path, args


def _config_help() -> str:
    rows = describe_fields(TrainConfig)
    width = max(len(k) for k, _, _ in rows)
    return "config keys (set as key=value):\n" + "\n".join(
        f"  {k:<{width}}  {h} [default: {d}]" for k, d, h in rows)


def cmd_train(args: list[str]) -> int:
    path, overrides = _split_args(args)
    cfg = load_config(path, overrides)
    from gspo.trainer import Trainer

    start = time.time()
    trainer = Trainer(cfg).setup()
    print(f"run folder: {trainer.run_dir}", flush=True)
    result = trainer.train()
    wall = time.time() - start
    before, after = result["before"], result["after"]
    if after:
        b = f"{before['accuracy']:.1%} -> " if before else ""
        print(f"held-out accuracy: {b}{after['accuracy']:.1%} "
              f"({int(after['n'])} problems, greedy); wall time {wall / 60:.1f} min")
    print(f"weights: {trainer.run_dir}/checkpoints/step_{trainer.step:06d} "
          f"(from_pretrained-loadable); metrics: {trainer.run_dir}/metrics.jsonl")
    return 0


def cmd_eval(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gspo eval", description="greedy held-out accuracy")
    p.add_argument("--model", required=True, help="model folder (or smollm2-135m-instruct)")
    p.add_argument("config", nargs="*", help="optional CONFIG.yaml and key=value overrides")
    ns = p.parse_args(argv)
    path, overrides = _split_args(ns.config)
    cfg = load_config(path, [*overrides, f"model={ns.model}"])
    from gspo.data import build_task
    from gspo.models import load_model
    from gspo.rewards import RewardScorer
    from gspo.rollout.sampler import eos_ids
    from gspo.trainer.evaluate import evaluate

    scorer = RewardScorer.from_specs(cfg.reward.functions, cfg.reward.weights)
    task = build_task(cfg.task, cfg.seed)
    model, tok = load_model(cfg.model)
    res = evaluate(model, tok, task.eval_examples, scorer, chat_template=cfg.task.chat_template,
                   system_prompt=cfg.task.system_prompt,
                   max_new_tokens=cfg.rollout.eval_max_new_tokens, eos=eos_ids(model, tok),
                   pad_id=tok.pad_token_id)
    print(f"accuracy {res['accuracy']:.1%}  reward_mean {res['reward_mean']:.3f}  "
          f"n {int(res['n'])}")
    return 0


def cmd_validate(args: list[str]) -> int:
    path, overrides = _split_args(args)
    load_config(path, overrides)
    print(f"{path or 'defaults'}: ok")
    return 0


COMMANDS: dict[str, Any] = {"train": cmd_train, "eval": cmd_eval, "validate": cmd_validate}
USAGE = """usage: gspo COMMAND [CONFIG.yaml] [key=value ...]

commands:
  train     RL-train a model (no arguments: SmolLM2-135M-Instruct on the arithmetic task)
  eval      greedy held-out accuracy of a model folder: gspo eval --model DIR
  validate  build a config without training: gspo validate CONFIG.yaml [key=value ...]

`gspo train --help` lists every config key."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        if not argv:
            argv = ["train"]
        else:
            print(USAGE)
            return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"gspo: unknown command '{cmd}' (choose: {', '.join(COMMANDS)})", file=sys.stderr)
        return EXIT_USAGE
    if cmd in ("train", "validate") and any(a in ("-h", "--help") for a in rest):
        print(USAGE + "\n\n" + _config_help())
        return 0
    try:
        return COMMANDS[cmd](rest)
    except _user_errors() as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"gspo {cmd}: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"gspo {cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
