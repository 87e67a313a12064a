"""``gspo compare``: run named arms on the same seeds, prompts and compute budget; report them.

The arms come from a comparison file (:mod:`gspo.analysis.spec`). Each (arm, seed) is one
:class:`gspo.trainer.Trainer` run in ``RUNS/<arm>_s<seed>``. A finished run whose config is
unchanged is reused, so an interrupted comparison resumes and a new arm only costs its own runs.
A run folder that compare started (its ``compare.started`` marker) but did not finish is deleted
and run again; a folder it did not start is never deleted: the comparison refuses to start.
For MoE policies a probe per seed also measures how many expert choices change after exactly
one optimizer step from the initial policy (:func:`first_update_probe`). With ``jobs`` > 1 the
runs go ``jobs`` at a time, each in its own process (:func:`run_side_by_side`). The table and
plots are written by :mod:`gspo.analysis.report`.
"""

from __future__ import annotations

import dataclasses
import fcntl
import gc
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from gspo.analysis.report import DONE, read_done, summarize, write_report
from gspo.analysis.spec import CompareSpec
from gspo.config import (
    ConfigError,
    MissingPackage,
    RolloutConfig,
    TrainConfig,
    check_task_columns,
    to_dict,
    validate,
)
from gspo.data import DataError
from gspo.models import ModelError
from gspo.models.loading import check_model
from gspo.models.moe import expert_change, routing_change
from gspo.objectives import UnknownNameError, objective_from_config
from gspo.rewards import RewardError, RewardSpecError
from gspo.trainer import Trainer
from gspo.trainer.checkpoint import atomic_write_text
from gspo.trainer.setup_checks import check_before_loading
from gspo.trainer.update import UpdatePlan, policy_update

# written into a run folder before its run starts: only such a folder may compare delete
STARTED = "compare.started"


class RunFailed(RuntimeError):
    """A run of a side-by-side comparison exited with an error (its log names the cause)."""


def _differs(saved: Any, current: Any) -> bool:
    """Whether two config dicts differ on a key both have (keys added to or removed from
    TrainConfig since the run was saved do not count)."""
    if isinstance(saved, dict) and isinstance(current, dict):
        return any(_differs(saved[k], current[k]) for k in saved.keys() & current.keys())
    return saved != current


def _check_folder(run_dir: Path, cfg: TrainConfig) -> bool:
    """Whether ``run_dir`` holds a finished run of ``cfg`` (a readable ``DONE``). A finished run
    of another config is an error, and so is a folder with files that compare did not start
    (no :data:`STARTED` marker: a ``gspo train`` run, say): compare never deletes those. Deletes
    nothing itself."""
    if read_done(run_dir) is not None:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
        if _differs(saved, to_dict(cfg)):
            raise ConfigError(f"{run_dir} holds a finished run of another config; delete it "
                              "or pass --runs DIR")
        return True
    if (run_dir.is_dir() and not (run_dir / STARTED).is_file()
            and any(run_dir.iterdir())):
        raise ConfigError(f"{run_dir} holds files that gspo compare did not start (no {STARTED}"
                          f" nor {DONE}); move it away or pass --runs DIR")
    return False


def _reusable(run_dir: Path, cfg: TrainConfig, log: Callable[[str], None]) -> bool:
    """True for a finished run of ``cfg`` (:func:`_check_folder`); an unfinished one that
    compare started (interrupted: no readable ``DONE``) is deleted, with a line to ``log``, so
    it can start again."""
    if _check_folder(run_dir, cfg):
        return True
    if (run_dir / STARTED).is_file():
        log(f"{cfg.run_name}: deleting the unfinished run that gspo compare started in {run_dir}"
            f" (it starts again)")
        shutil.rmtree(run_dir)
    return False


def _mark_started(run_dir: Path) -> None:
    """Create ``run_dir`` with its :data:`STARTED` marker, before anything else goes in."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / STARTED).write_text("this run folder was started by gspo compare, which may "
                                   "delete it while it has no compare.json\n")


def run_one(cfg: TrainConfig, info: dict[str, Any], log: Callable[[str], None]) -> Path:
    """Train one run (or reuse it); write its wall time and final evaluation to ``DONE``."""
    run_dir = Path(cfg.output_dir) / cfg.run_name
    if _reusable(run_dir, cfg, log):
        log(f"{cfg.run_name}: finished earlier, reusing {run_dir}")
        return run_dir
    _mark_started(run_dir)
    start = time.perf_counter()
    trainer = Trainer(cfg).setup()
    result = trainer.train()
    _release(trainer)
    if result.get("interrupted"):
        raise KeyboardInterrupt
    wall = time.perf_counter() - start
    done = {**info, "wall_s": wall, "before": result.get("before"), "after": result.get("after")}
    atomic_write_text(run_dir / DONE, json.dumps(done, indent=2))
    after = result.get("after") or {}
    acc = f", held-out accuracy after {after['accuracy']:.1%}" if "accuracy" in after else ""
    log(f"{cfg.run_name}: {wall:.0f} s{acc}")
    return run_dir


def first_update_probe(cfg: TrainConfig) -> dict[str, Any]:
    """Routing drift after exactly one optimizer step from the initial policy.

    One rollout batch; π_old's expert choices are recorded on all of it; one AdamW step is
    taken on one minibatch (``1/num_minibatches`` of the rows, no replay, no KL); the routing
    of the whole batch is recorded again. At that first step every ratio is 1, so GSPO,
    GSPO-token and GRPO take the same step: one probe per seed serves every arm.
    """
    trainer = Trainer(cfg).setup()
    if not trainer.hooks.active:  # a dense policy: nothing to measure
        _release(trainer)  # its engine, reward processes and logs: the arms' runs follow
        return {}
    o = cfg.objective
    examples, roll = trainer.rollout()
    rewards, _ = trainer.score(examples, roll)
    adv = trainer.advantages(rewards, roll)
    every_row = UpdatePlan([[torch.arange(len(roll))]])  # the π_old pass over the whole batch
    batch, _ = trainer.update_batch(roll, adv, every_row)
    routing, mask = batch.routing, batch.response_mask
    gen = torch.Generator().manual_seed(cfg.seed)
    rows = torch.randperm(len(roll), generator=gen)[: len(roll) // o.num_minibatches]
    # one AdamW step on one minibatch, no replay (the default hooks), no KL
    policy_update(trainer.model, trainer.optimizer, trainer.scheduler,
                  dataclasses.replace(batch, ref_logprobs=None), UpdatePlan([[rows.sort().values]]),
                  objective=objective_from_config(dataclasses.replace(o, beta=0.0)),
                  temperature=cfg.rollout.temperature, chunk=cfg.logprob_chunk,
                  grad_clip=cfg.optim.grad_clip, dist=trainer.dist)
    padded = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
              "response_mask": mask}
    _, _, after = trainer.old_logprobs(padded)
    tokens = routing_change(routing, after, mask.reshape(-1))
    experts = expert_change(routing, after, mask)
    _release(trainer)  # the arms' runs follow in this process: give the GPU memory back
    return {"token_change": float(tokens["overall"]),
            "token_change_per_layer": [float(v) for v in tokens["per_layer"]],
            "expert_change": float(experts.mean()),
            "expert_change_per_layer": [float(v) for v in experts],
            "n_tokens": float(mask.sum()), "top_k": int(routing[0].shape[-1])}


def _release(trainer: Trainer) -> None:
    """Close ``trainer``'s engine and return the memory its policy held on a GPU to the device
    (torch's caching allocator keeps freed blocks otherwise)."""
    trainer.cleanup()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def probe_config(spec: CompareSpec, seed: int, runs_dir: Path, extra: list[str]
                 ) -> TrainConfig:
    """The routing probe's config: the first arm's, synchronous. One update from the initial
    policy on a batch it sampled itself: no engine process even when the arm runs one
    (``rollout.async_steps``), whose pipeline would hold no batch; so none of the options
    that only the pipeline uses either."""
    cfg = spec.config(spec.probe_arm, seed, runs_dir, extra)
    sync = dataclasses.replace(cfg.rollout, async_steps=0, async_threads=1, async_engines=1,
                               async_address="", async_lend_threads=False,
                               async_timeout_s=RolloutConfig.async_timeout_s)
    cfg = dataclasses.replace(cfg, run_name=f"probe_s{seed}", steps=0, eval_before=False,
                              rollout=sync)
    validate(cfg)
    return cfg


def run_probe(spec: CompareSpec, seed: int, runs_dir: Path, extra: list[str],
              log: Callable[[str], None]) -> dict[str, Any]:
    """The routing probe of ``seed`` (:func:`first_update_probe`), run once per runs folder.

    It runs with the config of the file's first arm (``spec.probe_arm``) whichever arms this
    process runs, and under an exclusive lock on ``probe_s<seed>.lock``: subsets of a
    comparison started side by side into one runs folder (``--arms``) wait for the first one's
    probe and reuse it instead of deleting it as unfinished or refusing it as another config.
    """
    cfg = probe_config(spec, seed, runs_dir, extra)
    run_dir = Path(cfg.output_dir) / cfg.run_name
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(run_dir.parent / f"{cfg.run_name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or the process dies)
        if _reusable(run_dir, cfg, log):
            return read_done(run_dir) or {}
        _mark_started(run_dir)
        res = first_update_probe(cfg)
        atomic_write_text(run_dir / DONE, json.dumps(res, indent=2))
    if res:
        log(f"probe seed {seed}: after one update {res['token_change']:.1%} of (token, layer) "
            f"changed expert set, {res['expert_change']:.1%} of chosen experts changed")
    return res


def _child() -> None:
    """One run of :func:`run_side_by_side`, in its own Python process: ``(config, info)``
    pickled on stdin; output (and a traceback, if it fails) to the log on stdout/stderr."""
    cfg, info = pickle.load(sys.stdin.buffer)
    run_one(cfg, info, lambda line: print(line, flush=True))


def run_side_by_side(todo: list[tuple[TrainConfig, dict[str, Any]]], jobs: int,
                     log: Callable[[str], None] = print, poll_s: float = 0.5) -> None:
    """Train each ``(config, info)`` of ``todo`` with :func:`run_one` in its own Python
    process, at most ``jobs`` at a time, in order. A run's output goes to ``<run folder>.log``
    beside it.

    The processes are started afresh (``python -c``, not forked: the parent may hold torch
    threads), so each can start its own engine process (``rollout.async_steps``). Runs that
    fail do not stop the others; once all have ended, :class:`RunFailed` names every one that
    failed and its log. Interrupted (Ctrl-C, or SIGTERM to this process), the parent
    terminates the runs it started and waits for them; a further SIGTERM meanwhile is passed on
    to them (a run's second signal stops it at once).
    """
    queue = list(todo)
    running: list[tuple[subprocess.Popen[bytes], str, Path]] = []
    failed: list[str] = []
    terminated = False

    def on_sigterm(signum: int, frame: Any) -> None:
        nonlocal terminated
        if not terminated:
            terminated = True
            raise KeyboardInterrupt("SIGTERM")
        for proc, _, _ in running:  # already stopping: pass it on
            if proc.returncode is None:
                try:
                    os.kill(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if main_thread else None
    try:
        while queue or running:
            while queue and len(running) < jobs:
                cfg, info = queue.pop(0)
                log_path = Path(cfg.output_dir) / f"{cfg.run_name}.log"
                log_path.parent.mkdir(parents=True, exist_ok=True)
                with open(log_path, "wb") as out:
                    proc = subprocess.Popen(
                        [sys.executable, "-c", "from gspo.analysis.compare import _child; "
                         "_child()"], stdin=subprocess.PIPE, stdout=out,
                        stderr=subprocess.STDOUT)
                running.append((proc, cfg.run_name, log_path))  # terminated if interrupted
                assert proc.stdin is not None
                try:
                    proc.stdin.write(pickle.dumps((cfg, info)))
                    proc.stdin.close()
                except BrokenPipeError:  # it died at start: reported below with its log
                    pass
                log(f"{cfg.run_name}: started (log {log_path})")
            time.sleep(poll_s)
            for item in [r for r in running if r[0].poll() is not None]:
                running.remove(item)
                proc, name, log_path = item
                if proc.returncode == 0:
                    lines = log_path.read_text(errors="replace").strip().splitlines()
                    log(lines[-1] if lines else f"{name}: finished")
                else:
                    failed.append(f"{name} (exit code {proc.returncode}; log {log_path})")
                    log(f"{name}: failed with exit code {proc.returncode}, see {log_path}")
    except BaseException:
        for proc, _, _ in running:
            proc.terminate()
        for proc, _, _ in running:
            proc.wait()
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if failed:
        raise RunFailed(f"{len(failed)} of {len(todo)} runs failed: {', '.join(failed)}")


def _check_writable(folder: Path, what: str) -> None:
    """``folder`` exists as a writable folder, or can be made: its nearest existing ancestor is
    a writable folder (a one-line error otherwise, before anything runs)."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{what} {folder}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {folder}: {existing} is not writable")


def check_arms(spec: CompareSpec, runs_dir: Path, extra: list[str]) -> None:
    """The checks ``gspo validate`` makes on a run config (the loss's options, the model's
    name, the task's columns and the setup checks that need no weights:
    :func:`gspo.trainer.setup_checks.check_before_loading`) on every arm's config and the
    routing probe's, so that a typo in the last arm (an unknown reward, objective, task or
    model) is a one-line :class:`ConfigError` naming the arm before the first run, not after
    the runs of the arms before it."""
    seed = spec.seeds[0]
    for arm in [spec.probe_arm, *(a for a in spec.arms if a is not spec.probe_arm)]:
        cfg = spec.config(arm, seed, runs_dir, extra)
        try:
            check_task_columns(cfg.task)
            objective_from_config(cfg.objective)
            check_model(cfg.model)
            check_before_loading(cfg)
        except (ConfigError, ModelError, DataError, UnknownNameError, RewardError,
                RewardSpecError, MissingPackage, FileNotFoundError) as e:
            raise ConfigError(f"{spec.path}: arm '{arm.name}': {e}") from None


def run_compare(spec: CompareSpec, runs_dir: str | Path, out_dir: str | Path,
                extra: list[str] | None = None, log: Callable[[str], None] = print,
                command: str = "", jobs: int = 1) -> dict[str, Any]:
    """Run every (arm, seed), then write ``results.md``, ``summary.json`` and PNGs to out_dir.

    ``jobs`` > 1 runs that many (arm, seed) runs side by side, each in its own process
    (:func:`run_side_by_side`; the probes run first, in this one). Every arm must then set
    ``num_threads`` (≥ 1): torch's default, all cores per run, would put ``jobs`` times the
    cores' threads on them."""
    if jobs < 1:
        raise ConfigError(f"--jobs: expected a positive number of runs at a time, got {jobs}")
    runs_dir, out_dir, extra = Path(runs_dir), Path(out_dir), list(extra or [])
    _check_writable(runs_dir, "--runs")  # before any run, not after all of them
    _check_writable(out_dir, "--out")
    start = time.perf_counter()
    # seed-major: a partial comparison still covers every arm
    plan = [(arm, seed, spec.config(arm, seed, runs_dir, extra))
            for seed in spec.seeds for arm in spec.arms]
    if jobs > 1:
        unset = sorted({arm.name for arm, _, cfg in plan if cfg.num_threads < 1})
        if unset:
            raise ConfigError(f"--jobs {jobs}: arm(s) {', '.join(unset)} leave num_threads at "
                              f"0 (torch's default: every core in every run); set num_threads, "
                              f"e.g. num_threads={max(1, (os.cpu_count() or 1) // jobs)}")
    check_arms(spec, runs_dir, extra)  # a typo in any arm: before the first run
    # a folder in the way (another config's finished run, a run compare did not start) stops
    # the comparison before its first run, not at that run's turn
    for _, _, cfg in plan:
        _check_folder(Path(cfg.output_dir) / cfg.run_name, cfg)
    for seed in spec.seeds:
        cfg = probe_config(spec, seed, runs_dir, extra)
        _check_folder(Path(cfg.output_dir) / cfg.run_name, cfg)
    probes = {seed: run_probe(spec, seed, runs_dir, extra, log) for seed in spec.seeds}
    info = {(arm.name, seed): {"arm": arm.name, "label": arm.label, "seed": seed}
            for arm, seed, _ in plan}
    made: set[str] = set()  # runs trained side by side just now
    if jobs > 1:
        todo = [(cfg, info[arm.name, seed]) for arm, seed, cfg in plan
                if not _reusable(Path(cfg.output_dir) / cfg.run_name, cfg, log)]
        run_side_by_side(todo, jobs, log)
        made = {cfg.run_name for cfg, _ in todo}
    runs: dict[str, dict[int, Path]] = {}
    for arm, seed, cfg in plan:  # each run is finished now, or made here when jobs is 1
        quiet = (lambda _: None) if cfg.run_name in made else log
        runs.setdefault(arm.name, {})[seed] = run_one(cfg, info[arm.name, seed], quiet)
    summary = summarize(spec, runs, probes)
    summary["total_wall_s"] = time.perf_counter() - start
    summary["command"] = command
    write_report(summary, runs, out_dir)
    return summary
