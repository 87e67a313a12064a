"""Prompt sources: built-in tasks, JSONL files and `datasets` sources, plus chat formatting.

``build_task(cfg.task, seed)`` builds the task named by ``task.name`` through :data:`TASKS`;
register your own with ``@TASKS.register("name")`` (a builder ``fn(cfg, seed) -> Task``), and
say how it holds out problems with ``@declares_held_out``.
"""

from gspo.data.base import DataError, DatasetTask, Example, Task
from gspo.data.datasets import load_jsonl
from gspo.data.prompts import format_prompt
from gspo.data.registry import (
    TASKS,
    HeldOut,
    TaskBuilder,
    build_task,
    declares_held_out,
    held_out_kind,
    task_builder,
)
from gspo.data.tasks import ArithmeticTask

__all__ = [
    "TASKS",
    "ArithmeticTask",
    "DataError",
    "DatasetTask",
    "Example",
    "HeldOut",
    "Task",
    "TaskBuilder",
    "build_task",
    "declares_held_out",
    "format_prompt",
    "held_out_kind",
    "load_jsonl",
    "task_builder",
]
