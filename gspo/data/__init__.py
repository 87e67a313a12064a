"""Prompt sources: the built-in arithmetic task and JSONL datasets, plus chat formatting."""

from gspo.data.datasets import DataError, load_jsonl
from gspo.data.prompts import format_prompt
from gspo.data.tasks import ArithmeticTask, Example, build_task

__all__ = [
    "ArithmeticTask", "DataError", "Example", "build_task", "format_prompt", "load_jsonl",
]
