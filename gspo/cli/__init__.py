"""``gspo train | eval | validate`` — the command line."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from gspo import presets
from gspo.analysis.spec import is_compare_file, load_spec
from gspo.config import (
    ConfigError,
    TrainConfig,
    check_engine_address,
    describe_fields,
    load_config,
    resolve_path,
)

EXIT_USAGE = 2
EXIT_GUARD_STOP = 3  # the run's guard stopped it (see guard.on_fault); a checkpoint was written
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, FileNotFoundError, FileExistsError)


def _user_errors() -> tuple[type[BaseException], ...]:
    from gspo.data import DataError
    from gspo.models import ModelError
    from gspo.objectives import UnknownNameError
    from gspo.rewards import RewardError, RewardSpecError
    from gspo.rollout.remote_engine import Unreachable

    return (*USER_ERRORS, DataError, ModelError, UnknownNameError, RewardError,
            RewardSpecError, Unreachable)


def _split_args(args: list[str]) -> tuple[str | None, list[str]]:
    """(config file or preset name resolved to its file, overrides)."""
    path = None
    if args and "=" not in args[0]:
        path, args = str(resolve_path(args[0])), args[1:]
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
    trainer = Trainer(cfg)
    finished = False
    try:  # under torchrun every rank runs this; only rank 0 prints the summary
        trainer.setup()
        main = trainer.dist.is_main
        if main:
            print(f"run folder: {trainer.run_dir}", flush=True)
        result = trainer.train()
        finished = True
    finally:  # after an error, skip the barrier: the other ranks may be stuck in a collective
        trainer.cleanup(barrier=finished)
    if result.get("interrupted") or not main:  # interrupted: the trainer printed how to resume
        return 0
    wall = time.time() - start
    before, after = result["before"], result["after"]
    if after:
        b = f"{before['accuracy']:.1%} -> " if before else ""
        print(f"held-out accuracy: {b}{after['accuracy']:.1%} "
              f"({int(after['n'])} problems, greedy); wall time {wall / 60:.1f} min")
    kind = ("LoRA adapter (merge: gspo export RUN_DIR --merged OUT)" if cfg.lora.r
            else "from_pretrained-loadable")
    print(f"weights: {trainer.run_dir}/checkpoints/step_{trainer.step:06d} "
          f"({kind}); metrics: {trainer.run_dir}/metrics.jsonl")
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
    from gspo.models.tokens import eos_ids
    from gspo.rewards import RewardScorer
    from gspo.trainer.evaluate import evaluate

    scorer = RewardScorer.from_specs(cfg.reward.functions, cfg.reward.weights)
    task = build_task(cfg.task, cfg.seed)
    model, tok = load_model(cfg.model)
    res = evaluate(model, tok, task.eval_examples, scorer, chat_template=cfg.task.chat_template,
                   system_prompt=cfg.task.system_prompt,
                   max_new_tokens=cfg.rollout.eval_max_new_tokens, eos=eos_ids(model, tok),
                   pad_id=tok.pad_token_id, fast_decode=cfg.rollout.fast_decode,
                   decode_matmul=cfg.rollout.decode_matmul)
    print(f"accuracy {res['accuracy']:.1%}  reward_mean {res['reward_mean']:.3f}  "
          f"n {int(res['n'])}")
    return 0


def cmd_validate(args: list[str]) -> int:
    path, overrides = _split_args(args)
    if path is not None and is_compare_file(path) and not overrides:
        load_spec(path)  # a gspo compare file: checks every arm's run config
    else:
        from gspo.objectives import objective_from_config  # loads torch: only when needed

        objective_from_config(load_config(path, overrides).objective)  # options the loss takes
    print(f"{path or 'defaults'}: ok")
    return 0


def cmd_plot(argv: list[str]) -> int:
    from gspo.cli.plot import cmd_plot as run

    return run(argv)


def cmd_export(argv: list[str]) -> int:
    from gspo.cli.export import cmd_export as run

    return run(argv)


def cmd_compare(argv: list[str]) -> int:
    from gspo.cli.compare import cmd_compare as run

    return run(argv)


def cmd_presets(argv: list[str]) -> int:
    if argv:
        raise ConfigError(f"gspo presets takes no arguments, got '{argv[0]}'")
    print(presets.listing())
    return 0


def cmd_sft(argv: list[str]) -> int:
    from gspo.config import SFTConfig, load_sft_config

    if any(a in ("-h", "--help") for a in argv):
        rows = describe_fields(SFTConfig)
        print("usage: gspo sft [SFT.yaml] [key=value ...] [--force]\n\nsft keys:\n" + "\n".join(
            f"  {k:<14}  {h} [default: {d}]" for k, d, h in rows))
        return 0
    path, overrides = _split_args([a for a in argv if a != "--force"])
    cfg = load_sft_config(path, overrides)
    from gspo.trainer.sft import cold_start, read_info

    folder = cold_start(cfg, force="--force" in argv)
    info = read_info(folder)
    print(f"cold start: {folder} (held-out accuracy {info['accuracy_before']:.1%} -> "
          f"{info['accuracy_after']:.1%}); train from it with model={folder}")
    return 0


def cmd_engine(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="gspo engine", description="serve a trainer's asynchronous rollouts from this "
        "machine: the trainer runs with rollout.async_steps=k rollout.async_address=ADDRESS")
    p.add_argument("address", help="the trainer's rollout.async_address (tcp://HOST:PORT or "
                   "file:///shared/path); a trainer under torchrun: the address of one rank, "
                   "one engine per rank")
    p.add_argument("--device", default="cpu", help="where to sample (cpu, cuda, cuda:N)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds to wait for the trainer and for each of its messages")
    ns = p.parse_args(argv)
    check_engine_address(ns.address, "address")
    from gspo.rollout.remote_engine import serve

    serve(ns.address, device=ns.device, timeout_s=ns.timeout)  # no trainer: Unreachable
    return 0


COMMANDS: dict[str, Any] = {"train": cmd_train, "eval": cmd_eval, "validate": cmd_validate,
                            "plot": cmd_plot, "export": cmd_export, "compare": cmd_compare,
                            "sft": cmd_sft, "presets": cmd_presets, "engine": cmd_engine}
USAGE = """usage: gspo COMMAND [CONFIG.yaml | PRESET] [key=value ...]

commands:
  train     RL-train a model (no arguments: SmolLM2-135M-Instruct on the arithmetic task)
  eval      greedy held-out accuracy of a model folder: gspo eval --model DIR
  validate  build a config without training: gspo validate CONFIG.yaml [key=value ...]
  plot      PNG figures comparing runs: gspo plot RUN_DIR [RUN_DIR ...] [--out DIR]
  export    merge a LoRA run into full weights: gspo export RUN_DIR --merged OUT
  sft       cold-start a tiny model on arithmetic (cached): gspo sft [key=value ...]
  compare   run the arms of a comparison file and report: gspo compare [FILE.yaml] [--quick]
  presets   list the presets shipped with gspo (gspo train tiny_cpu, gspo compare moe/compare)
  engine    sample a trainer's async rollouts here: gspo engine tcp://TRAINER_HOST:PORT

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
    except RuntimeError as e:
        from gspo.analysis.compare import RunFailed
        from gspo.trainer.guard import GuardStop

        if isinstance(e, RunFailed):  # runs of `compare --jobs`: each names its log
            print(f"gspo {cmd}: error: {e}", file=sys.stderr)
            return 1
        if not isinstance(e, GuardStop):
            raise
        print(f"gspo {cmd}: {e}", file=sys.stderr)
        return EXIT_GUARD_STOP


if __name__ == "__main__":
    sys.exit(main())
