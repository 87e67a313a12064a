"""Resume exactness of the synchronous loop beyond the crash tests of test_crash_resume.py: a
reward that draws from Python's and NumPy's global RNGs, and a kill while a step's checkpoint
is written a second time (a run stopped at its last step, resumed, finishing)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import gspo.trainer.checkpoint as checkpoint
from gspo.config import load_config
from gspo.trainer import Trainer
from gspo.trainer.checkpoint import latest_checkpoint, save_checkpoint

from .test_crash_resume import _Saves

FAST = ["model=tiny:llama", "progress=false", "tensorboard=false", "num_threads=1", "seed=3",
        "rollout.max_new_tokens=4", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "rollout.temperature=1.0", "objective.num_minibatches=2", "task.eval_size=0",
        "eval_before=false", "optim.lr=3e-3", "steps=3", "save_every=2"]
TIMING = ("time/", "perf/")


def noisy(prompts, completions, **_):
    """A reward with noise from the global RNGs (an LLM judge's sampling, random tie-breaks)."""
    return [float(ord(c[0]) % 3) + random.random() + float(np.random.rand()) if c else 0.0
            for c in completions]


class _Killed(BaseException):
    pass


def _run(tmp_path: Path, name: str, *extra: str, kill_at: int | None = None,
         monkeypatch=None) -> Path:
    random.seed(len(name))  # whatever the global RNGs held before: the run's seed decides
    np.random.seed(len(name))
    cfg = load_config(None, [*FAST, f"output_dir={tmp_path}", f"run_name={name}", *extra])
    trainer = Trainer(cfg, reward_fns=[noisy]).setup()
    if kill_at is not None:
        real = trainer._step

        def step(bar):
            if trainer.step == kill_at:
                raise _Killed
            real(bar)

        monkeypatch.setattr(trainer, "_step", step)
    try:
        trainer.train()
    except _Killed:
        pass
    finally:
        trainer.cleanup()
    return tmp_path / name


def _rows(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(TIMING)}
            for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_reward_drawing_from_the_global_rngs_resumes_exactly(tmp_path, monkeypatch):
    """The run's seed seeds Python's and NumPy's RNGs as it seeds torch's: two runs of one seed
    score alike, and a run killed after its step-2 checkpoint and resumed ends on the
    uninterrupted run's metrics and weights (the checkpoint restores those RNGs; unseeded, the
    runs differed from the first step)."""
    ref = _run(tmp_path, "ref")
    killed = _run(tmp_path, "killed", kill_at=2, monkeypatch=monkeypatch)
    assert [r["step"] for r in _rows(killed)] == [1, 2]
    _run(tmp_path, "killed", f"resume={killed}")
    assert _rows(killed) == _rows(ref)
    want = load_file(ref / "checkpoints" / "step_000003" / "model.safetensors")
    got = load_file(killed / "checkpoints" / "step_000003" / "model.safetensors")
    assert all(torch.equal(want[k], got[k]) for k in want)



def _save(root: Path, step: int, note: str, fail: bool = False) -> Path:
    return save_checkpoint(root, step, _Saves("model.safetensors"), _Saves("tokenizer.json", fail),
                           {"optimizer": {}}, {"step": step, "note": note}, 1)


def _note(path: Path | None) -> str:
    assert path is not None, "no checkpoint to resume from"
    return json.loads((path / "state.json").read_text())["note"]


def test_a_kill_while_a_step_is_saved_again_keeps_a_checkpoint(tmp_path, monkeypatch):
    """A run stopped (SIGTERM) in its last step checkpoints that step; resumed, it evaluates and
    writes the same step again. Killed after the old folder was set aside and before the new
    one was in place, it left no checkpoint at all (the old one was deleted first):
    ``resume: no complete checkpoint``. The old folder stays the checkpoint until then, also
    through a later write that fails."""
    _save(tmp_path, 3, "first")
    real = os.replace

    def replace(src, dst):
        real(src, dst)
        if Path(dst).name == ".old-step_000003":
            raise KeyboardInterrupt  # the kill, between the two renames

    monkeypatch.setattr(checkpoint.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 3, "again")
    monkeypatch.undo()
    assert _note(latest_checkpoint(tmp_path)) == "first"
    with pytest.raises(OSError, match="disk full"):  # the next write fails midway
        _save(tmp_path, 3, "again", fail=True)
    assert _note(latest_checkpoint(tmp_path)) == "first"
    _save(tmp_path, 3, "again")
    assert _note(latest_checkpoint(tmp_path)) == "again"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000003"]


@pytest.mark.parametrize("resume_step", [3, 2])
def test_a_kill_while_a_resumed_run_opens_its_metrics_log_loses_no_line(tmp_path, monkeypatch,
                                                                         resume_step):
    """A resumed run's metrics logger drops the lines past its checkpoint. It rewrote the file
    in place on every resume, so a kill between opening it for writing and writing it emptied
    the run's log (the steps before the checkpoint were lost for good). Now the file is left
    alone when no line goes (3), and else replaced whole (2)."""
    import builtins
    import io

    from gspo.trainer.metrics import MetricsLogger

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in (1, 2, 3)))
    real = builtins.open

    def killed_on_write(file, mode="r", *args, **kwargs):
        handle = real(file, mode, *args, **kwargs)
        if "w" in mode:  # the kill, right after the file was opened (and emptied) for writing
            handle.close()
            raise KeyboardInterrupt
        return handle

    monkeypatch.setattr(builtins, "open", killed_on_write)
    monkeypatch.setattr(io, "open", killed_on_write)
    try:
        MetricsLogger(tmp_path, tensorboard=False, resume_step=resume_step)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]
    MetricsLogger(tmp_path, tensorboard=False, resume_step=resume_step)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == \
        list(range(1, resume_step + 1))


def test_a_run_resumed_after_its_final_checkpoint_prunes_what_that_write_did_not(tmp_path,
                                                                                 monkeypatch):
    """Killed after the final checkpoint is in place and ``latest`` points at it, before the
    older ones are pruned: the resumed run has nothing left to train, evaluate or save, and
    ``keep_checkpoints`` held no longer (step_000001 and step_000002 stayed beside step_000003)."""
    def pause(name, step):
        if (name, step) == ("pointed", 3):
            raise _Killed

    monkeypatch.setattr(checkpoint, "_phase", pause)
    run = _run(tmp_path, "run", "save_every=1", "keep_checkpoints=1")
    monkeypatch.undo()
    assert latest_checkpoint(run / "checkpoints").name == "step_000003"
    assert not (run / "final_eval.json").exists()
    _run(tmp_path, "run", "save_every=1", "keep_checkpoints=1", f"resume={run}")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000003"]
    assert json.loads((run / "final_eval.json").read_text())["steps"] == 3
