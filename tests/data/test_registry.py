"""The task registry: built-in names, unknown and duplicate names, a user-registered task."""

from __future__ import annotations

import pytest

import gspo.data.registry as task_registry
from gspo.config import TaskConfig
from gspo.data import TASKS, DataError, DatasetTask, Example, Task, build_task
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
