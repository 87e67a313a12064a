"""Prompt sources: built-in tasks, JSONL files and `datasets` sources, plus chat formatting.

``build_task(cfg.task, seed)`` builds the task named by ``task.name`` through :data:`TASKS`;
register your own with ``@TASKS.register("name")`` (a builder ``fn(cfg, seed) -> Task``).
"""

from gspo.data.base import DataError, DatasetTask, Example, Task
from gspo.data.datasets import load_jsonl
from gspo.data.prompts import format_prompt
from gspo.data.registry import TASKS, TaskBuilder, build_task, task_builder
from gspo.data.tasks import ArithmeticTask

__all__ = [
    "TASKS",
    "ArithmeticTask",
    "DataError",
    "DatasetTask",
    "Example",
    "Task",
    "TaskBuilder",
    "build_task",
    "format_prompt",
    "load_jsonl",
    "task_builder",
]
