"""``gspo train | eval | validate`` — the command line."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from gspo import presets
from gspo.analysis.spec import is_compare_file, load_spec
from gspo.config import (
    ConfigError,
    MissingPackage,
    TrainConfig,
    check_engine_address,
    check_task_columns,
    describe_fields,
    load_config,
    read_yaml,
    resolve_path,
)

EXIT_USAGE = 2
EXIT_GUARD_STOP = 3  # the run's guard stopped it (see guard.on_fault); a checkpoint was written
# a path the user gave that is missing, taken, not a folder (or is one), or not theirs to
# write; an optional package a setting needs that is not installed
USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
    PermissionError, MissingPackage)


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


def _resumed_run_config(overrides: list[str]) -> str | None:
    """``RUN/config.yaml`` when the overrides hold ``resume=RUN`` and that file exists, else
    None: ``gspo train resume=RUN`` (what an interrupted run prints) continues the run with the
    settings it was started with, not with the defaults; later key=value overrides still
    apply on top of it."""
    from gspo.config import parse_override

    resume = ""
    for item in overrides:
        value = parse_override(item, TrainConfig).get("resume")
        if value is not None and not isinstance(value, dict):
            resume = str(value)
    saved = Path(resume) / "config.yaml" if resume else None
    return str(saved) if saved is not None and saved.is_file() else None


def _check_resume_folder(cfg: TrainConfig, overrides: list[str], *, runs_own: bool) -> None:
    """``resume=RUN`` continues the run in RUN: an ``output_dir``/``run_name`` naming another
    folder is a :class:`ConfigError`. When the config is RUN/config.yaml (``runs_own``), its
    output_dir and run_name say where the run was started, from the directory it was started
    in: a copy of the folder, or the run resumed from another directory, is no error, so only
    an output_dir or run_name given on the command line is checked then."""
    if not cfg.resume or not cfg.run_name:
        return
    if runs_own:
        from gspo.config import parse_override

        given = {key for item in overrides
                 for key in _keys_set(parse_override(item, TrainConfig), TrainConfig)}
        if not given & {"output_dir", "run_name"}:
            return
    named = Path(cfg.output_dir) / cfg.run_name
    if named.resolve() != Path(cfg.resume).resolve():
        raise ConfigError(
            f"resume={cfg.resume} continues the run in its own folder; output_dir and "
            f"run_name name another one ({named}): drop them (to fork a run, copy its "
            "folder and resume the copy)")


def cmd_train(args: list[str]) -> int:
    path, overrides = _split_args(args)
    runs_own = False  # whether the config is RUN/config.yaml
    if path is None:  # `gspo train resume=RUN [key=value ...]`: the run's own config
        path = _resumed_run_config(overrides)
        runs_own = path is not None
    cfg = load_config(path, overrides)
    _check_resume_folder(cfg, overrides, runs_own=runs_own)
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
    ckpt = Path(trainer.run_dir) / "checkpoints" / f"step_{trainer.step:06d}"
    # save_final=false writes no checkpoint of the last step: name none that is not there
    weights = (f"{ckpt} ({kind})" if ckpt.is_dir()
               else "no checkpoint of the last step (save_final=false)")
    print(f"weights: {weights}; metrics: {trainer.run_dir}/metrics.jsonl")
    return 0


# What `gspo eval` reads of a run config besides `model` (which --model gives): a key=value
# that is not one of these (or under one, "task": task.*) is an error, never silently ignored.
# A CONFIG.yaml (a preset, a run's config.yaml) describes a whole run: eval reads these keys of
# it and leaves the training ones (reward.overlong_buffer too: a penalty on the sampling
# budget, which evaluation leaves out, as the trainer's evaluation does).
EVAL_KEYS = ("seed", "device", "dtype", "num_threads", "task", "reward.functions",
             "reward.weights", "reward.timeout_s", "reward.isolate", "reward.memory_mb",
             "rollout.eval_max_new_tokens", "rollout.fast_decode", "rollout.decode_matmul",
             "rollout.max_turns", "rollout.env")


def _keys_set(data: Any, cls: type, prefix: str = "") -> list[str]:
    """The dotted leaf keys a (checked) YAML mapping or override sets, e.g. ``optim.lr``."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    keys: list[str] = []
    for key, value in (data or {}).items():
        tp = hints[key]
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            keys += _keys_set(value, tp, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def _listed(keys: tuple[str, ...]) -> str:
    return ", ".join("task.*" if k == "task" else k for k in keys)


def _eval_keys(overrides: list[str]) -> list[str]:
    """The dotted keys the key=value ``overrides`` set."""
    from gspo.config import parse_override

    return [key for item in overrides for key in _keys_set(parse_override(item), TrainConfig)]


def _check_eval_keys(overrides: list[str]) -> None:
    """A key=value the evaluation does not read, or ``model=`` next to --model: a
    ConfigError."""
    for key in _eval_keys(overrides):
        if key == "model":
            raise ConfigError("model: the model to evaluate is given by --model; drop model=")
        if not any(key == k or key.startswith(f"{k}.") for k in EVAL_KEYS):
            hint = {"rollout.max_new_tokens": " (responses are capped by "
                                              "rollout.eval_max_new_tokens)",
                    "reward.overlong_buffer": " (a penalty on training's sampling budget; "
                                              "evaluation scores the task)"}.get(key, "")
            raise ConfigError(f"{key} is not used by gspo eval{hint}; `gspo eval --help` "
                              "lists the keys it reads")


def _checkpoints_run_config(model: str) -> Path | None:
    """``RUN/config.yaml`` when ``model`` is a checkpoint a run wrote (``RUN/checkpoints/
    step_N``) and that file exists, else None."""
    folder = Path(model).expanduser()
    saved = folder.parent.parent / "config.yaml"
    return saved if folder.parent.name == "checkpoints" and saved.is_file() else None


def cmd_eval(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="gspo eval", description="greedy held-out accuracy; a run's checkpoint "
        "(RUN/checkpoints/step_N) is evaluated with RUN/config.yaml unless a CONFIG.yaml is "
        "given: the run's task, held-out split (its seed), rewards and response cap")
    p.add_argument("--model", required=True, help="model folder (or smollm2-135m-instruct)")
    p.add_argument("config", nargs="*", help="optional CONFIG.yaml and key=value overrides of "
                   f"the keys evaluation reads: {_listed(EVAL_KEYS)}")
    ns = p.parse_args(argv)
    path, overrides = _split_args(ns.config)
    if path is None and (saved := _checkpoints_run_config(ns.model)) is not None:
        path = str(saved)
        print(f"config: {saved} (the run's; key=value overrides apply on top)", flush=True)
    cfg = load_config(path, [*overrides, f"model={ns.model}"])
    _check_eval_keys(overrides)
    check_task_columns(cfg.task)
    from gspo.data import held_out_kind

    if path is None and held_out_kind(cfg.task) == "seeded" and "seed" not in _eval_keys(overrides):
        print(f"note: task.name={cfg.task.name} holds out rows drawn with the seed (seed="
              f"{cfg.seed} here); a model trained with another seed trained on some of them: "
              "give its run's config.yaml or seed=", flush=True)
    import torch

    from gspo.data import build_task
    from gspo.models import load_model
    from gspo.models.tokens import eos_ids
    from gspo.rewards import RewardScorer
    from gspo.rollout.multiturn import TurnLoop
    from gspo.trainer.distributed import resolve_device
    from gspo.trainer.evaluate import evaluate

    device = resolve_device(cfg.device)  # device=cuda without a GPU: before loading anything
    scorer = RewardScorer.from_specs(cfg.reward.functions, cfg.reward.weights)
    task = build_task(cfg.task, cfg.seed)
    if not task.eval_examples:
        raise ConfigError("task: no held-out examples to evaluate (task.eval_size=0?)")
    threads = torch.get_num_threads()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    try:  # as the trainer evaluates (gspo.trainer.Trainer.setup and .evaluate)
        torch.manual_seed(cfg.seed)
        model, tok = load_model(cfg.model, dtype=getattr(torch, cfg.dtype), seed=cfg.seed)
        model.to(device)
        scorer.timeout_s = cfg.reward.timeout_s
        if cfg.reward.isolate == "process":
            scorer.isolate(cfg.reward.functions, memory_mb=cfg.reward.memory_mb)
        res = evaluate(model, tok, task.eval_examples, scorer,
                       chat_template=cfg.task.chat_template, system_prompt=cfg.task.system_prompt,
                       max_new_tokens=cfg.rollout.eval_max_new_tokens, eos=eos_ids(model, tok),
                       pad_id=tok.pad_token_id, fast_decode=cfg.rollout.fast_decode,
                       decode_matmul=cfg.rollout.decode_matmul,
                       turns=TurnLoop.from_config(cfg.rollout, cfg.task, tok))
    finally:
        scorer.close()
        torch.set_num_threads(threads)
    print(f"accuracy {res['accuracy']:.1%}  reward_mean {res['reward_mean']:.3f}  "
          f"n {int(res['n'])}")
    return 0


def cmd_validate(args: list[str]) -> int:
    """Check a run config (or every arm of a ``gspo compare`` file, with the overrides as
    ``gspo compare`` applies them) as far as it goes without loading or training anything:
    the config's fields, the options the loss takes, the model's name, and the checks of
    ``gspo train``'s setup that the model's architecture, the registries and ``resume``
    decide (gspo.trainer.setup_checks); a last line says what only ``gspo train`` checks.
    ``resume=RUN`` without a config file checks RUN/config.yaml, as ``gspo train`` runs it."""
    path, overrides = _split_args(args)
    runs_own = False
    if path is None:  # `gspo validate resume=RUN`: the run's own config, as train reads it
        path = _resumed_run_config(overrides)
        runs_own = path is not None
    # these load torch: only when needed; gspo.trainer registers the sft: model source
    from gspo.data import DataError
    from gspo.models import ModelError
    from gspo.models.loading import check_model
    from gspo.objectives import UnknownNameError, objective_from_config
    from gspo.rewards import RewardError, RewardSpecError
    from gspo.trainer.setup_checks import NOT_CHECKED, check_before_loading, new_run_folder

    if path is not None and is_compare_file(path):
        # every arm's run config, as the file gives it and with its quick settings
        quick = (False, True) if (read_yaml(path) or {}).get("quick") else (False,)
        specs = [(load_spec(path, quick=q), " (quick)" if q else "") for q in quick]
        runs = [(f"{spec.path}: arm '{arm.name}'{how}: ",
                 spec.config(arm, spec.seeds[0], "runs", overrides))
                for spec, how in specs for arm in spec.arms]
    else:
        runs = [("", load_config(path, overrides))]
        if not runs[0][1].resume and runs[0][1].run_name:  # (compare files: finished arms)
            new_run_folder(runs[0][1], runs[0][1].run_name)
    notes: list[str] = []
    for where, cfg in runs:
        try:
            _check_resume_folder(cfg, overrides, runs_own=runs_own)
            check_task_columns(cfg.task)
            objective_from_config(cfg.objective)  # the options the loss takes
            check_model(cfg.model)
            notes += [f"{where}{n}" for n in check_before_loading(cfg)]
        except (ConfigError, ModelError, DataError, UnknownNameError, RewardError,
                RewardSpecError, FileNotFoundError) as e:
            raise ConfigError(f"{where}{e}") from None
    for note in dict.fromkeys(notes):
        print(f"not checked: {note}")
    print(NOT_CHECKED)
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
    if argv in (["-h"], ["--help"]):
        print("usage: gspo presets\n\nlist the presets shipped with gspo, one line each; run "
              "one by name: gspo train tiny_cpu, gspo compare moe/compare")
        return 0
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
    # a cached cold start's accuracies were measured on the eval_size it was built with
    built = info["config"].get("eval_size", cfg.eval_size)
    note = "" if built == cfg.eval_size else (
        f"; measured when it was built: eval_size={cfg.eval_size} applies to a rebuild (--force)")
    print(f"cold start: {folder} (held-out accuracy {info['accuracy_before']:.1%} -> "
          f"{info['accuracy_after']:.1%} on {info['n_eval']} problems{note}); train from it "
          f"with model={folder}")
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
                   help="seconds to wait for the trainer to join, for a weights version a "
                   "request names, and for the rest of each message; its next request and "
                   "its next weights come when they come (a dead trainer fails the wait)")
    ns = p.parse_args(argv)
    if not 0 < ns.timeout < float("inf"):
        p.error(f"--timeout must be a number > 0, got {ns.timeout}")
    check_engine_address(ns.address, "address")
    from gspo.rollout.remote_engine import serve

    try:
        serve(ns.address, device=ns.device, timeout_s=ns.timeout)  # no trainer: Unreachable
    except KeyboardInterrupt:
        # The engine's thread may be inside torch or gloo: exit without tearing the
        # interpreter down under it (that aborts: "terminate called without an active
        # exception"). The trainer's next message to this engine fails.
        print("gspo engine: interrupted", file=sys.stderr, flush=True)
        os._exit(130)
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


def entry() -> int:
    """The ``gspo`` command (and ``python -m gspo``): :func:`main` in a process whose string
    hashing is fixed. Without ``PYTHONHASHSEED`` in the environment it sets it to 0 and starts
    the same command again, so every process of a run (torchrun's ranks, a resumed run, each
    arm of a comparison, the engine processes, which inherit it) iterates sets of strings in
    one order: some reasoning-gym datasets draw their problems in that order, and drew other
    problems in every process. ``PYTHONHASHSEED=random`` (or any value) set by the user is
    kept."""
    if "PYTHONHASHSEED" not in os.environ and getattr(sys, "orig_argv", None):
        os.environ["PYTHONHASHSEED"] = "0"
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, sys.orig_argv)
    return main()


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
