"""gspo.trainer.checkpoint on its own, with a real tiny model and no trainer: a save reads back
bit for bit, a write interrupted at any phase leaves the previous checkpoint the latest (or the
new one, once complete and pointed at), pruning keeps the newest and the protected folders, and
``atomic_write_text`` never leaves a half-written file. The SIGKILL version of the crash tests,
through the real CLI, is in test_crash_resume.py (slow lane)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gspo.models.tiny import build_tiny
from gspo.trainer import checkpoint
from gspo.trainer.checkpoint import (
    LATEST,
    PAUSE_ENV,
    PHASES,
    atomic_write_text,
    latest_checkpoint,
    load_checkpoint_state,
    load_weights,
    save_checkpoint,
)


class _Killed(BaseException):
    """Stands in for a SIGKILL: nothing in the writer catches a BaseException."""


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    return build_tiny("llama", seed=0)


@pytest.fixture(scope="module")
def target() -> Any:
    """Another tiny model (other weights) to load checkpoints into."""
    return build_tiny("llama", seed=1)[0]


def _trained_state(model: Any) -> tuple[torch.optim.Optimizer, Any]:
    """An optimizer and scheduler after one real step, so that their state is not empty."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    ids = torch.tensor([[3, 40, 41, 42, 1]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return optimizer, scheduler


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    """Nested dicts / lists / tensors equal, tensors bit for bit (dtype included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _weights(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _complete(folder: Path) -> bool:
    names = {p.name for p in folder.iterdir()}
    return {"model.safetensors", "tokenizer.json", "optimizer.pt", "state.json"} <= names


def _save(root: Path, step: int, tiny: tuple[Any, Any], keep: int = 2,
          protect: tuple[str, ...] = ()) -> Path:
    model, tokenizer = tiny
    return save_checkpoint(root, step, model, tokenizer, {"optimizer": {"step": step}},
                           {"step": step}, keep, protect)


def _step_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))


# ------------------------------------------------------------------------------- round trip
def test_save_then_load_round_trips_weights_optimizer_scheduler_and_state(tmp_path):
    model, tokenizer = build_tiny("llama", seed=0)
    optimizer, scheduler = _trained_state(model)
    optim_state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                   "torch_rng": torch.get_rng_state(), "cuda_rng": None}
    state = {"step": 7, "task": {"position": 5, "epoch": 1}, "history": [{"loss": 0.25}],
             "guard": None, "rng": {"python": [3, [1, 2], None]}}
    root = tmp_path / "checkpoints"
    path = save_checkpoint(root, 7, model, tokenizer, optim_state, state, keep=2)
    assert path == root / "step_000007" and _complete(path)
    assert (root / LATEST).read_text() == "step_000007"
    assert latest_checkpoint(root) == path

    got_optim, got_state = load_checkpoint_state(path)
    assert got_state == state
    _assert_same(optim_state, got_optim)
    restored = torch.optim.AdamW(model.parameters(), lr=1e-2)
    restored.load_state_dict(got_optim["optimizer"])  # what a resume does with it
    _assert_same(optimizer.state_dict(), restored.state_dict())

    other, _ = build_tiny("llama", seed=1)
    want = _weights(model)
    assert all(not torch.equal(v, want[k]) for k, v in other.state_dict().items()
               if k.endswith("proj.weight"))
    load_weights(other, path)
    _assert_same(want, _weights(other))  # the tied output layer included


def test_an_explicit_state_dict_is_what_gets_saved(tmp_path, tiny, target):
    model, tokenizer = tiny
    override = {k: v + 1.0 for k, v in model.state_dict().items()}  # e.g. gathered FSDP weights
    # save_pretrained drops the tied copy from the dict it is given: hand it a copy
    path = save_checkpoint(tmp_path, 1, model, tokenizer, {}, {"step": 1}, keep=1,
                           state_dict=dict(override))
    load_weights(target, path)
    _assert_same(override, _weights(target))


# ------------------------------------------------------------------------- interrupted writes
@pytest.mark.parametrize("phase", PHASES)
def test_a_write_killed_at_any_phase_keeps_a_complete_latest(tmp_path, tiny, target,
                                                              monkeypatch, capsys, phase):
    first = _save(tmp_path, 1, tiny, keep=1)
    old_weights = {k: v.clone() for k, v in tiny[0].state_dict().items()}

    def killed(seconds: float) -> None:  # the pause would wait for the test's SIGKILL
        raise _Killed

    monkeypatch.setenv(PAUSE_ENV, f"{phase}:2")
    monkeypatch.setattr(checkpoint.time, "sleep", killed)
    with pytest.raises(_Killed):
        _save(tmp_path, 2, tiny, keep=1)
    assert f"[checkpoint] {phase} step_000002" in capsys.readouterr().err

    latest = latest_checkpoint(tmp_path)
    pointed = PHASES.index(phase) >= PHASES.index("pointed")
    assert latest == tmp_path / ("step_000002" if pointed else "step_000001")
    # every step_* folder is complete: a half-written one is never under that name
    assert all(_complete(tmp_path / name) for name in _step_dirs(tmp_path))
    assert _step_dirs(tmp_path) == (["step_000001", "step_000002"]
                                    if PHASES.index(phase) >= PHASES.index("renamed")
                                    else ["step_000001"])
    # the previous checkpoint is untouched: pruning only ever runs after the pointer moved
    assert load_checkpoint_state(first) == ({"optimizer": {"step": 1}}, {"step": 1})
    load_weights(target, first)
    _assert_same(old_weights, _weights(target))

    monkeypatch.delenv(PAUSE_ENV)
    _save(tmp_path, 3, tiny, keep=1)  # the next write clears what the killed one left
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_000003"]


def test_latest_falls_back_to_the_newest_complete_folder(tmp_path, tiny, monkeypatch):
    _save(tmp_path, 1, tiny)

    def killed(seconds: float) -> None:
        raise _Killed

    monkeypatch.setenv(PAUSE_ENV, "complete:2")  # a complete folder, still under its tmp name
    monkeypatch.setattr(checkpoint.time, "sleep", killed)
    with pytest.raises(_Killed):
        _save(tmp_path, 2, tiny)
    (tmp_path / LATEST).unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000001"  # .tmp-step_000002 ignored
    atomic_write_text(tmp_path / LATEST, "step_000009")  # names a folder that is not there
    (tmp_path / "step_000005").mkdir()  # no state.json: not a checkpoint
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000001"
    assert latest_checkpoint(tmp_path / "nothing") is None
    with pytest.raises(_Killed):  # the very first write, killed: there is no checkpoint yet
        _save(tmp_path / "first", 2, tiny)
    assert latest_checkpoint(tmp_path / "first") is None


def test_a_killed_resave_of_the_same_step_keeps_the_old_folder(tmp_path, tiny, monkeypatch):
    model, tokenizer = tiny
    save_checkpoint(tmp_path, 4, model, tokenizer, {}, {"note": "first"}, keep=2)

    def killed(seconds: float) -> None:
        raise _Killed

    monkeypatch.setenv(PAUSE_ENV, "complete:4")
    monkeypatch.setattr(checkpoint.time, "sleep", killed)
    with pytest.raises(_Killed):
        save_checkpoint(tmp_path, 4, model, tokenizer, {}, {"note": "second"}, keep=2)
    assert load_checkpoint_state(latest_checkpoint(tmp_path))[1] == {"note": "first"}
    monkeypatch.delenv(PAUSE_ENV)
    save_checkpoint(tmp_path, 4, model, tokenizer, {}, {"note": "third"}, keep=2)
    assert load_checkpoint_state(latest_checkpoint(tmp_path))[1] == {"note": "third"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_000004"]


def test_the_pause_hook_is_inert_for_other_phases_and_steps(tmp_path, tiny, monkeypatch):
    def killed(seconds: float) -> None:
        raise _Killed

    monkeypatch.setattr(checkpoint.time, "sleep", killed)
    monkeypatch.setenv(PAUSE_ENV, "renamed:3")
    _save(tmp_path, 2, tiny)  # another step: no pause
    monkeypatch.setenv(PAUSE_ENV, "bogus:2")
    _save(tmp_path, 2, tiny)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000002"


# ------------------------------------------------------------------------------------ pruning
def test_pruning_keeps_the_newest_in_step_order(tmp_path, tiny):
    for step in (8, 9, 10, 11):  # zero-padded names: step 10 sorts after step 9
        _save(tmp_path, step, tiny, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_000010", "step_000011"]
    _save(tmp_path, 12, tiny, keep=3)
    assert _step_dirs(tmp_path) == ["step_000010", "step_000011", "step_000012"]


def test_pruning_spares_the_protected_folders(tmp_path, tiny):
    for step in range(1, 5):
        _save(tmp_path, step, tiny, keep=1, protect=("step_000002",))
    assert _step_dirs(tmp_path) == ["step_000002", "step_000004"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000004"
    _save(tmp_path, 5, tiny, keep=1)  # no longer protected: it goes with the rest
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_000005"]


# --------------------------------------------------------------------------- atomic_write_text
def test_atomic_write_text_replaces_whole_or_not_at_all(tmp_path, monkeypatch):
    target = tmp_path / "latest"
    atomic_write_text(target, "step_000001")
    atomic_write_text(target, "step_000002")
    assert target.read_text() == "step_000002"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]  # no temporary file left

    def disk_died(fd: int) -> None:
        raise OSError("I/O error")

    monkeypatch.setattr(checkpoint.os, "fsync", disk_died)
    with pytest.raises(OSError, match="I/O error"):
        atomic_write_text(target, "step_000003")
    assert target.read_text() == "step_000002"  # the old content, never a partial new one
    monkeypatch.undo()
    atomic_write_text(target, json.dumps({"k": 1}))  # the failed write left nothing in the way
    assert json.loads(target.read_text()) == {"k": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


def test_steps_past_six_digits_are_ordered_by_number(tmp_path, tiny):
    """``step_1000000`` sorts before ``step_999999`` by name: pruning kept the older one and
    the newest complete checkpoint (without the pointer) was the older one."""
    _save(tmp_path, 999_999, tiny, keep=1)
    _save(tmp_path, 1_000_000, tiny, keep=1)
    assert _step_dirs(tmp_path) == ["step_1000000"]
    _save(tmp_path, 999_998, tiny, keep=2)  # an older step written later (a rollback)
    (tmp_path / LATEST).unlink()
    assert latest_checkpoint(tmp_path).name == "step_1000000"
