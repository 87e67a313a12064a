"""JSONL prompt files: one JSON object per line with a prompt and a reference answer."""

from __future__ import annotations

import json
from pathlib import Path

from gspo.data.base import DataError, Example, reward_columns, same_columns


def load_jsonl(path: str, prompt_field: str = "prompt",
               answer_field: str = "answer") -> list[Example]:
    """Read ``path``; every other column is passed to reward functions under its own name
    (``None`` for a row without it).

    A row without the prompt or answer field, or with it ``null``, is a :class:`DataError`.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"dataset not found: {p}")
    rows: list[Example] = []
    try:
        # Only "\n" ends a row: str.splitlines() would also split at U+2028 etc. inside strings.
        lines = p.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError:
        raise DataError(f"{p}: not UTF-8 text") from None
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{p}:{i}: invalid JSON ({e.msg})") from None
        except (ValueError, RecursionError) as e:  # over-long integers, too-deep nesting
            raise DataError(f"{p}:{i}: invalid JSON ({type(e).__name__})") from None
        if not isinstance(row, dict):
            raise DataError(f"{p}:{i}: expected a JSON object, got {type(row).__name__}")
        for name in (prompt_field, answer_field):
            if name not in row:
                raise DataError(f"{p}:{i}: missing field '{name}'")
            if row[name] is None:
                raise DataError(f"{p}:{i}: column '{name}' is empty (null)")
        if not isinstance(row[prompt_field], str) or not row[prompt_field].strip():
            raise DataError(f"{p}:{i}: field '{prompt_field}' must be a non-empty string")
        extra = reward_columns(row, prompt_field, answer_field, f"{p}:{i}")
        rows.append(Example(row[prompt_field], str(row[answer_field]), extra))
    if not rows:
        raise DataError(f"{p}: dataset is empty")
    return same_columns(rows)
