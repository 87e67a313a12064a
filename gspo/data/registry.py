"""``TASKS``: ``task.name`` -> a builder ``fn(cfg: TaskConfig, seed: int) -> Task``.

The built-in names are registered here; register your own with::

    from gspo.data import TASKS

    @TASKS.register("my_task")
    def my_task(cfg: TaskConfig, seed: int) -> Task: ...

and select it with ``task.name=my_task``. A builder may also declare how its held-out problems
are chosen, from the config alone, with :func:`declares_held_out` (:func:`held_out_kind` reads
it: ``gspo validate`` and ``gspo train`` refuse ``eval_every`` for a task that holds out nothing,
and ``gspo eval`` warns where the split depends on the seed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from gspo.config import TaskConfig
from gspo.data.base import DataError, DatasetTask, Task, held_out_task
from gspo.data.builtin import CountdownTask, gsm8k_mini_task
from gspo.data.datasets import load_jsonl
from gspo.data.hf import dataset_task
from gspo.data.reasoning_gym import ReasoningGymTask
from gspo.data.tasks import PROMPT_TEMPLATE, ArithmeticTask
from gspo.registry import Registry

TaskBuilder = Callable[[TaskConfig, int], Task]

TASKS: Registry[TaskBuilder] = Registry("task")

HeldOut = Literal["none", "hashed", "seeded", "separate"]
"""How a task chooses its held-out problems: ``none`` (it holds out nothing), ``hashed`` (by a
hash of each problem: no seed's training meets them), ``seeded`` (a seeded share of the rows: a
run with another seed trained on some of them) or ``separate`` (a file or split of their own,
whose prompts are left out of training)."""


def declares_held_out(kind: Callable[[TaskConfig], HeldOut]
                      ) -> Callable[[TaskBuilder], TaskBuilder]:
    """Decorator: ``kind(cfg)`` says how the builder's task holds out problems for ``cfg``
    (:data:`HeldOut`), without building it."""
    def mark(builder: TaskBuilder) -> TaskBuilder:
        builder.held_out = kind  # type: ignore[attr-defined]
        return builder
    return mark


def held_out_kind(cfg: TaskConfig) -> HeldOut | None:
    """How the task ``cfg.name`` holds out problems for ``cfg`` (:data:`HeldOut`), or None
    where its builder declares nothing (a task registered without :func:`declares_held_out`).

    Raises:
        DataError: for a name that is not registered.
    """
    kind = getattr(task_builder(cfg), "held_out", None)
    return kind(cfg) if kind is not None else None


def _by_hash(cfg: TaskConfig) -> HeldOut:
    return "hashed" if cfg.eval_size > 0 else "none"


def _by_seed(cfg: TaskConfig) -> HeldOut:
    return "seeded" if cfg.eval_size > 0 else "none"


def _own_file_or_seed(cfg: TaskConfig) -> HeldOut:
    return "separate" if cfg.eval_path or cfg.eval_split else _by_seed(cfg)


@TASKS.register("arithmetic")
@declares_held_out(_by_hash)
def arithmetic_task(cfg: TaskConfig, seed: int) -> ArithmeticTask:
    return ArithmeticTask(cfg.levels, cfg.level_weights, cfg.operations, cfg.eval_levels,
                          cfg.eval_size, seed, template=cfg.prompt_template or PROMPT_TEMPLATE)


@TASKS.register("countdown")
@declares_held_out(_by_hash)
def countdown_task(cfg: TaskConfig, seed: int) -> CountdownTask:
    return CountdownTask(cfg.countdown_numbers, cfg.eval_size, seed)


@TASKS.register("gsm8k_mini")
@declares_held_out(_by_seed)
def gsm8k_mini(cfg: TaskConfig, seed: int) -> DatasetTask:
    return gsm8k_mini_task(cfg.eval_size, seed)


@TASKS.register("jsonl")
@declares_held_out(_own_file_or_seed)
def jsonl_task(cfg: TaskConfig, seed: int) -> DatasetTask:
    """``task.path``, with ``task.eval_path`` as the held-out set (its prompts left out of
    training) or else ``task.eval_size`` held-out problems of ``task.path``."""
    rows = load_jsonl(cfg.path, cfg.prompt_field, cfg.answer_field)
    eval_rows = (load_jsonl(cfg.eval_path, cfg.prompt_field, cfg.answer_field)
                 if cfg.eval_path else None)
    return held_out_task(rows, eval_rows, eval_size=cfg.eval_size, seed=seed,
                         train_source=cfg.path, eval_source=cfg.eval_path)


TASKS.register("dataset")(declares_held_out(_own_file_or_seed)(dataset_task))


@TASKS.register("reasoning_gym")
@declares_held_out(_by_hash)
def reasoning_gym_task(cfg: TaskConfig, seed: int) -> ReasoningGymTask:
    """``task.subset`` of reasoning-gym with ``task.options``; score with its own verifier."""
    return ReasoningGymTask(cfg.subset, cfg.options, cfg.eval_size, seed)


def task_builder(cfg: TaskConfig) -> TaskBuilder:
    """The builder :data:`TASKS` holds for ``cfg.name``, without reading any rows (``gspo
    validate`` checks the name with it).

    Raises:
        DataError: for a name that is not registered (the message lists the registered ones).
    """
    if cfg.name not in TASKS:
        *rest, last = TASKS.names()
        choices = f"{', '.join(rest)} or {last}" if rest else last
        raise DataError(f"task.name: unknown task '{cfg.name}' (choose {choices})")
    return TASKS[cfg.name]


def build_task(cfg: TaskConfig, seed: int) -> Task:
    """Build the task named by ``cfg.name`` through :data:`TASKS`.

    Raises:
        DataError: for a name that is not registered (the message lists the registered ones),
            or whatever the builder raises for bad data.
    """
    return task_builder(cfg)(cfg, seed)
