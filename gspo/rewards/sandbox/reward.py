"""The ``code`` reward: extract the code from each completion, run it against its row's tests in
the sandbox, score the fraction of tests passed."""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gspo.rewards.sandbox.limits import _make_limits
from gspo.rewards.sandbox.runner import _execute

_MAX_WORKERS = 2
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_OPEN_FENCE = re.compile(r"```[ \t]*(?:python3?|py3?)[ \t]*\n", re.IGNORECASE)
_PY_LANGS = {"python", "python3", "py", "py3"}


def extract_code(text: str) -> str:
    """The last ```` ```python ```` block, else the last untagged ```` ``` ```` block, else an
    unterminated ```` ```python ```` block at the end (a cut-off response), else the text."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    for wanted in (lambda lang: lang in _PY_LANGS, lambda lang: lang == ""):
        chosen = [body for lang, body in blocks if wanted(lang)]
        if chosen:
            return chosen[-1]
    opening = list(_OPEN_FENCE.finditer(text))
    if opening:
        return text[opening[-1].end():]
    return text


def _row_tests(tests: Any, i: int) -> list[str] | None:
    """Row ``i`` of the ``tests`` column as a list of test snippets, or None when unusable.

    A string is one test program, except JSON (how some datasets store tests): a JSON list of
    strings is that list, a JSON string that program, and any other JSON value (APPS's
    ``{"inputs": [...], "outputs": [...]}`` stdin/stdout cases, a number) unusable: run as
    Python, such a literal would be a no-op that always "passes".
    """
    try:
        row = tests[i]
    except (IndexError, KeyError, TypeError):
        return None
    if isinstance(row, str):
        with contextlib.suppress(ValueError, RecursionError):
            row = json.loads(row)
        if isinstance(row, str):
            return [row] if row.strip() else None
    if isinstance(row, (str, bytes, Mapping)):
        return None
    try:
        items = list(row)
    except TypeError:
        return None
    if items and all(isinstance(t, str) for t in items):
        return items
    return None


def make_code_reward(*, workers: int = _MAX_WORKERS,
                     **limits: Any) -> Callable[..., list[float | None]]:
    """A ``code_reward`` with other :func:`run_python` limits or pool size (1 or 2)."""
    workers = max(1, min(_MAX_WORKERS, int(workers)))
    checked = _make_limits(**limits)  # invalid limits fail here, at configuration time

    def reward(prompts: list[str], completions: list[str], *, tests: list,
               **_: Any) -> list[float | None]:
        def score(i: int) -> float | None:
            row = _row_tests(tests, i)
            if row is None:
                return None  # no tests: unscorable, not a program failure
            try:
                completion = completions[i]
                if not isinstance(completion, str):
                    return 0.0
                result = _execute(extract_code(completion), row, checked)
                if not result.program_ran:
                    return None  # the sandbox failed, not the program: unscorable
                value = result.fraction
                return value if math.isfinite(value) else 0.0
            except Exception:
                return 0.0

        n = len(completions)
        if workers == 1 or n <= 1:
            return [score(i) for i in range(n)]
        with ThreadPoolExecutor(max_workers=min(workers, n)) as pool:
            return list(pool.map(score, range(n)))

    reward.__name__ = "code_reward"
    return reward


def code_reward(prompts: list[str], completions: list[str], *, tests: list,
                **columns: Any) -> list[float | None]:
    """Fraction of each row's tests passed by the code in its completion.

    ``tests`` is a dataset column: per row, a list of test snippets (usually ``assert``
    statements), a JSON list of them, or one test program (other JSON, such as APPS's
    stdin/stdout cases, makes the row unscorable: None). Code is taken from the last
    ```` ```python ```` block (see :func:`extract_code`). Anything that goes wrong (no code,
    syntax error, exception, timeout, sandbox violation, ...) scores 0.0; a row without tests is
    None (unscorable). A row whose sandbox could not even be set up is None as well, so that a
    broken host shows up as unscorable rows rather than as a silent reward of 0. Never raises.
    Rows run on a pool of two workers, each in its own sandbox.
    """
    return _DEFAULT_REWARD(prompts, completions, tests=tests, **columns)


_DEFAULT_REWARD = make_code_reward()
