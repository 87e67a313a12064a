"""Prompt datasets through Hugging Face ``datasets``: local files, folders, Hub names, objects.

Every source ends up as a list of :class:`~gspo.data.base.Example` rows served by
:class:`~gspo.data.base.DatasetTask`, which shuffles with the run's seed and resumes where it
stopped. Problems are reported as a one-line :class:`DataError` naming the source and column.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gspo.config import TaskConfig
from gspo.data.base import (
    DataError,
    DatasetTask,
    Example,
    held_out_task,
    reward_columns,
    same_columns,
)

# File suffix -> the `datasets` builder that reads it.
BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _is_empty(value: Any) -> bool:
    """A missing cell: ``None`` (``datasets`` fills absent columns and null cells with it) or
    NaN (pandas' missing value)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _answer_text(value: Any, float_column: bool) -> str:
    """The reference answer as text. In a float column (``datasets`` widens a CSV or JSON
    column of integers and decimals to float) an integer-valued answer keeps its integer
    spelling, ``4`` rather than ``4.0``."""
    if float_column and isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)


def records_to_examples(records: Iterable[Mapping[str, Any]], *, prompt_field: str = "prompt",
                        answer_field: str = "answer", source: str = "dataset") -> list[Example]:
    """Rows (dicts, or a ``datasets.Dataset``) -> Examples; other columns go to the rewards
    (``None`` for a row without one).

    A row whose prompt or answer is missing, null or NaN is a :class:`DataError`.
    """
    columns = getattr(records, "column_names", None)  # a datasets.Dataset: check once, up front
    float_answers, empty_hint = False, " (missing or null)"
    if columns is not None:
        for name in (prompt_field, answer_field):
            if name not in columns:
                raise DataError(f"{source}: column '{name}' not found "
                                f"(columns: {', '.join(columns)})")
        feature = getattr(records, "features", {}).get(answer_field)
        float_answers = str(getattr(feature, "dtype", "")).startswith("float")
        info = getattr(records, "info", None)
        if getattr(info, "builder_name", None) == "csv":
            empty_hint = " (blank, or a cell pandas reads as missing: NA, null, None, nan)"
    rows: list[Example] = []
    for i, row in enumerate(records):
        if not isinstance(row, Mapping):
            raise DataError(f"{source}: row {i} is a {type(row).__name__}, expected a mapping")
        for name in (prompt_field, answer_field):
            if name not in row:
                raise DataError(f"{source}: row {i} has no column '{name}' "
                                f"(columns: {', '.join(map(str, row))})")
            if _is_empty(row[name]):
                raise DataError(f"{source}: row {i}: column '{name}' is empty{empty_hint}")
        prompt = row[prompt_field]
        if not isinstance(prompt, str) or not prompt.strip():
            raise DataError(f"{source}: row {i}: column '{prompt_field}' must be a non-empty "
                            "string")
        extra = reward_columns(row, prompt_field, answer_field, f"{source}: row {i}")
        rows.append(Example(prompt, _answer_text(row[answer_field], float_answers), extra))
    return same_columns(rows)


def load_split(path: str, split: str, *, subset: str = "") -> Any:
    """One split of a local file, a local folder or a Hub dataset, as a ``datasets.Dataset``.

    A single local file has one split, ``train``, and no configurations (``subset`` set is a
    :class:`DataError`). A folder uses ``datasets``' file-name conventions (``train.jsonl``,
    ``test.parquet``, ``data/train-*.csv``, ...) or the configurations its ``README.md``
    declares (a local copy of a Hub dataset), of which ``subset`` picks one, as on the Hub.
    """
    try:
        import datasets
    except ImportError:
        raise DataError("task.name=dataset needs the `datasets` package: "
                        "pip install datasets") from None
    datasets.disable_progress_bars()
    p = Path(path).expanduser()
    if p.is_file():
        builder = BUILDERS.get("".join(p.suffixes[-1:]).lower())
        if builder is None:
            raise DataError(f"{p}: unsupported file type (use {', '.join(sorted(BUILDERS))})")
        if p.stat().st_size == 0:
            raise DataError(f"{p}: dataset is empty")
        if subset:
            raise DataError(f"{p}: task.subset='{subset}' names a configuration of a folder or "
                            "Hub dataset; a single file has none")
        args: tuple[Any, ...] = (builder,)
        kwargs: dict[str, Any] = {"data_files": {"train": str(p)}}
    elif p.is_dir():
        args, kwargs = (str(p), *([subset] if subset else [])), {}
    elif path.startswith((".", "/", "~")) or p.suffix.lower() in BUILDERS:
        raise DataError(f"dataset not found: {path}")
    else:
        args, kwargs = (path, *([subset] if subset else [])), {}
    try:
        splits = datasets.load_dataset(*args, **kwargs)
    except Exception as e:  # offline hub, bad files, unknown names: one line, naming the source
        if "corresponds to no data" in str(e):  # `datasets`' words for a split without rows
            raise DataError(f"{path}: split '{split}' is empty") from None
        hint = ""
        if not p.exists():
            hint = " (not a local path; loading from the Hugging Face Hub needs network access)"
        raise DataError(f"dataset '{path}' cannot be loaded{hint}: {_first_line(e)}") from None
    if split not in splits:
        raise DataError(f"dataset '{path}': no split '{split}' "
                        f"(splits: {', '.join(splits) or 'none'})")
    return splits[split]


def dataset_task(cfg: TaskConfig, seed: int) -> DatasetTask:
    """The task for ``task.name=dataset`` (see :class:`gspo.config.TaskConfig`)."""
    def examples(split: str) -> list[Example]:
        rows = records_to_examples(load_split(cfg.path, split, subset=cfg.subset),
                                   prompt_field=cfg.prompt_field, answer_field=cfg.answer_field,
                                   source=f"{cfg.path} [{split}]")
        if not rows:
            raise DataError(f"{cfg.path}: split '{split}' is empty")
        return rows

    return held_out_task(examples(cfg.split),
                         examples(cfg.eval_split) if cfg.eval_split else None,
                         eval_size=cfg.eval_size, seed=seed,
                         train_source=f"{cfg.path} [{cfg.split}]",
                         eval_source=f"{cfg.path} [{cfg.eval_split}]")


def task_from_records(train: Any, eval_records: Any, cfg: TaskConfig, seed: int) -> DatasetTask:
    """A task from in-memory rows (``Trainer(train_dataset=...)``): a ``datasets.Dataset`` or a
    list of dicts with the ``task.prompt_field`` / ``task.answer_field`` columns. Training
    leaves out the rows whose prompt is in ``eval_records``; without them, ``task.eval_size``
    problems (distinct prompts, every row of each) are held out."""
    fields = {"prompt_field": cfg.prompt_field, "answer_field": cfg.answer_field}
    rows = records_to_examples(train, **fields, source="train_dataset")
    if not rows:
        raise DataError("train_dataset is empty")
    held = (None if eval_records is None
            else records_to_examples(eval_records, **fields, source="eval_dataset"))
    return held_out_task(rows, held, eval_size=cfg.eval_size, seed=seed,
                         train_source="train_dataset", eval_source="eval_dataset")
