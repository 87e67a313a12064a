"""The task registry: built-in names, unknown and duplicate names, a user-registered task."""

from __future__ import annotations

import pytest

import gspo.data.registry as task_registry
from gspo.config import TaskConfig
from gspo.data import (
    TASKS,
    DataError,
    DatasetTask,
    Example,
    Task,
    build_task,
    declares_held_out,
    held_out_kind,
)
from gspo.registry import Registry, UnknownNameError

BUILTIN = ["arithmetic", "countdown", "dataset", "gsm8k_mini", "jsonl", "reasoning_gym"]


@pytest.fixture
def tasks(monkeypatch: pytest.MonkeyPatch) -> Registry:
    """A fresh copy of TASKS that build_task reads, so registrations don't leak out."""
    fresh: Registry = Registry("task")
    for name, fn in TASKS.items():
        fresh.register(name)(fn)
    monkeypatch.setattr(task_registry, "TASKS", fresh)
    return fresh


def test_builtin_names():
    assert TASKS.names() == BUILTIN


@pytest.mark.parametrize("name", ["arithmetic", "countdown", "gsm8k_mini"])
def test_builtin_tasks_follow_the_task_protocol(name):
    task = build_task(TaskConfig(name=name, eval_size=4), seed=0)
    assert isinstance(task, Task)
    assert all(isinstance(ex, Example) for ex in task.sample(3))


def test_unknown_name_lists_the_registered_ones(tasks):
    tasks.register("mine")(lambda cfg, seed: DatasetTask([Example("p", "a")], [], seed))
    with pytest.raises(DataError) as info:
        build_task(TaskConfig(name="nope"), seed=0)
    assert str(info.value) == ("task.name: unknown task 'nope' (choose arithmetic, countdown, "
                               "dataset, gsm8k_mini, jsonl, mine or reasoning_gym)")
    with pytest.raises(UnknownNameError, match="unknown task 'nope'; choose one of: arithmetic"):
        TASKS["nope"]


def test_duplicate_name_raises(tasks):
    with pytest.raises(ValueError, match="task 'arithmetic' is already registered"):
        TASKS.register("arithmetic")(lambda cfg, seed: None)
    tasks.register("mine")(lambda cfg, seed: None)
    with pytest.raises(ValueError, match="already registered"):
        tasks.register("mine")(lambda cfg, seed: None)


def test_user_registered_task_is_built(tasks):
    rows = [Example(f"q{i}", str(i)) for i in range(6)]
    seen = []

    @tasks.register("mine")
    def mine(cfg: TaskConfig, seed: int) -> DatasetTask:
        seen.append((cfg.eval_size, seed))
        return DatasetTask(rows[1:], rows[:1], seed)

    task = build_task(TaskConfig(name="mine", eval_size=1), seed=7)
    assert seen == [(1, 7)]
    assert isinstance(task, DatasetTask) and task.eval_examples == rows[:1]
    assert "mine" not in TASKS  # the fixture's copy took it, not the global registry


@pytest.mark.parametrize(("name", "fields", "kind"), [
    ("arithmetic", {}, "hashed"),
    ("arithmetic", {"eval_size": 0}, "none"),
    ("countdown", {}, "hashed"),
    ("reasoning_gym", {"eval_size": 0}, "none"),
    ("reasoning_gym", {}, "hashed"),
    ("gsm8k_mini", {}, "seeded"),
    ("gsm8k_mini", {"eval_size": 0}, "none"),
    ("jsonl", {"path": "d.jsonl"}, "seeded"),
    ("jsonl", {"path": "d.jsonl", "eval_size": 0}, "none"),
    ("jsonl", {"path": "d.jsonl", "eval_path": "e.jsonl", "eval_size": 0}, "separate"),
    ("dataset", {"path": "d"}, "seeded"),
    ("dataset", {"path": "d", "eval_split": "test", "eval_size": 0}, "separate"),
])
def test_builtin_tasks_declare_how_they_hold_out(name, fields, kind):
    """Each built-in task says, from its config alone, how it holds out problems: what
    `gspo validate` (eval_every with nothing held out) and `gspo eval` (a seeded split) read."""
    assert held_out_kind(TaskConfig(name=name, **fields)) == kind


def test_a_user_task_declares_how_it_holds_out(tasks):
    """A user's task declares its held-out kind with @declares_held_out; one that declares
    nothing is None (not decidable from its config), and an unknown name is a DataError."""
    @tasks.register("mine")
    @declares_held_out(lambda cfg: "none" if cfg.eval_size == 0 else "separate")
    def mine(cfg: TaskConfig, seed: int) -> DatasetTask:
        return DatasetTask([Example("p", "a")], [], seed)

    tasks.register("silent")(lambda cfg, seed: DatasetTask([Example("p", "a")], [], seed))
    assert held_out_kind(TaskConfig(name="mine", eval_size=0)) == "none"
    assert held_out_kind(TaskConfig(name="mine", eval_size=3)) == "separate"
    assert held_out_kind(TaskConfig(name="silent", eval_size=0)) is None
    with pytest.raises(DataError, match="unknown task 'nope'"):
        held_out_kind(TaskConfig(name="nope"))


def test_validate_reads_a_user_tasks_declaration(tasks, capsys):
    """`gspo validate` refuses eval_every for a user's task that declares it holds out
    nothing, and leaves a task that declares nothing to `gspo train`."""
    from gspo.cli import main

    tasks.register("bare")(declares_held_out(lambda cfg: "none")(
        lambda cfg, seed: DatasetTask([Example("p", "a")], [], seed)))
    tasks.register("silent")(lambda cfg, seed: DatasetTask([Example("p", "a")], [], seed))
    args = ["validate", "model=tiny:llama", "eval_every=2", "eval_before=false"]
    assert main([*args, "task.name=bare"]) == 2
    assert "eval_every=2: there is no held-out set" in capsys.readouterr().err
    assert main([*args, "task.name=silent"]) == 0
