"""What every prompt source shares: the row type, the error type, the held-out split, the
:class:`Task` contract and :class:`DatasetTask` (rows served in a seeded shuffled order).

Every other module of :mod:`gspo.data` imports from here, never the other way round.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

EVAL_SHARE = 5  # one problem in EVAL_SHARE is held out (by a hash of the problem, not by seed)


class DataError(ValueError):
    """A dataset problem; the message is one line naming the file and row."""


@dataclass(frozen=True)
class Example:
    """One prompt: the user message, its reference answer (rewards get it as ``answer``), and
    the other columns, passed to reward functions as keyword arguments under their own names
    (the answer column too, when it is not called ``answer``: see :func:`reward_columns`)."""

    prompt: str
    answer: str
    columns: dict[str, Any] = field(default_factory=dict)


# The reward call's own arguments: a column with one of these names would collide with them.
REWARD_ARGUMENTS = ("prompts", "completions")


def reward_columns(row: Any, prompt_field: str, answer_field: str,
                   where: str) -> dict[str, Any]:
    """The columns of ``row`` that reward functions receive as keyword arguments.

    Every column except the prompt keeps its own name and value (TRL's convention: a reward
    ``score(prompts, completions, larger, **kw)`` gets the ``larger`` column). The reference
    answer also arrives as ``answer`` (a string; :class:`Example` holds it), the name the
    built-in rewards read, so with ``answer_field`` other than ``answer`` a column called
    ``answer`` would be ambiguous and is a :class:`DataError`, as is a column named after a
    reward argument (``prompts``, ``completions``).
    """
    if answer_field != "answer" and "answer" in row:
        raise DataError(f"{where}: a column is named 'answer' but task.answer_field="
                        f"'{answer_field}'; rewards get the answer field as `answer` too, "
                        "so rename one of them")
    for name in REWARD_ARGUMENTS:
        if name in row and name != prompt_field:
            raise DataError(f"{where}: column '{name}' collides with the reward argument of "
                            "that name; rename it")
    return {k: v for k, v in row.items() if k not in (prompt_field, "answer")}


def same_columns(rows: list[Example]) -> list[Example]:
    """``rows`` with every column that any of them has, ``None`` where a row lacks it (as
    ``datasets`` fills an absent column): a batch's columns are those of its first row, so a
    column that only some rows of a JSONL file or a list of dicts have would otherwise reach
    the rewards in some batches and not in others."""
    names = list(dict.fromkeys(k for ex in rows for k in ex.columns))
    if all(len(ex.columns) == len(names) for ex in rows):
        return rows
    return [Example(ex.prompt, ex.answer, {k: ex.columns.get(k) for k in names}) for ex in rows]


@runtime_checkable
class Task(Protocol):
    """What the trainer and evaluation use of a task (every entry of ``TASKS`` builds one).

    ``sample`` draws training prompts; ``eval_examples`` is the fixed held-out set; the state
    dict goes into checkpoints (JSON: tuples come back as lists) so a resumed run continues
    the same sequence of draws.
    """

    eval_examples: list[Example]

    def sample(self, n: int) -> list[Example]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def is_held_out(key: str) -> bool:
    """Whether the problem with canonical form ``key`` belongs to the held-out split.

    A hash, not the seed, decides, so train and eval never share a problem whatever the seed.
    """
    digest = hashlib.sha256(key.encode()).digest()
    return digest[0] % EVAL_SHARE == 0


def to_tuple(x: Any) -> Any:
    """Nested lists -> nested tuples: a ``random.Random`` state after a JSON round trip."""
    return tuple(to_tuple(v) for v in x) if isinstance(x, list) else x


def hold_out(rows: list[Example], eval_size: int, seed: int
             ) -> tuple[list[Example], list[Example]]:
    """(train, eval): a seeded ``min(eval_size, problems // 5)`` problems are held out.

    A problem is a distinct prompt: every row of a held-out prompt goes to the eval side, so
    a prompt that the source repeats is never both trained on and evaluated. (With distinct
    prompts this is the row split it always was: the same seed gives the same split.)
    """
    groups: dict[str, list[Example]] = {}
    for row in rows:
        groups.setdefault(row.prompt, []).append(row)
    problems = list(groups.values())
    order = list(range(len(problems)))
    random.Random(f"split-{seed}").shuffle(order)
    n_eval = min(eval_size, len(problems) // 5)
    return ([row for i in order[n_eval:] for row in problems[i]],
            [row for i in order[:n_eval] for row in problems[i]])


def without_held_out(rows: list[Example], eval_rows: list[Example], train_source: str,
                     eval_source: str) -> list[Example]:
    """``rows`` less those whose prompt is in the separate held-out set ``eval_rows``.

    The rows left out are counted in one printed line; leaving out every row is a
    :class:`DataError`.
    """
    held = {ex.prompt for ex in eval_rows}
    kept = [ex for ex in rows if ex.prompt not in held]
    left_out = len(rows) - len(kept)
    if left_out and not kept:
        raise DataError(f"{train_source}: every one of its {len(rows)} rows has a prompt that is "
                        f"also in the held-out set ({eval_source}); nothing is left to train on")
    if left_out:
        print(f"{train_source}: left out {left_out} of {len(rows)} training rows whose prompt "
              f"is also in the held-out set ({eval_source})", flush=True)
    return kept


def held_out_task(rows: list[Example], eval_rows: list[Example] | None, *, eval_size: int,
                  seed: int, train_source: str, eval_source: str) -> DatasetTask:
    """A :class:`DatasetTask` of ``rows`` and a separate held-out set ``eval_rows`` (its prompts
    left out of training, :func:`without_held_out`), or without one ``eval_size`` problems held
    out of ``rows`` (:func:`hold_out`)."""
    if eval_rows is None:
        train, held = hold_out(rows, eval_size, seed)
    else:
        train, held = without_held_out(rows, eval_rows, train_source, eval_source), eval_rows
    return DatasetTask(train, distinct_rows(held, train_source if eval_rows is None
                                            else eval_source), seed)


def distinct_rows(rows: list[Example], source: str) -> list[Example]:
    """``rows`` with each exact duplicate (same prompt, answer and columns) kept once, in
    order: held-out accuracy counts a problem once however often the source repeats it. The
    rows dropped are counted in one printed line."""
    seen: set[str] = set()
    kept = []
    for ex in rows:
        key = json.dumps([ex.prompt, ex.answer, ex.columns], sort_keys=True, default=repr)
        if key not in seen:
            seen.add(key)
            kept.append(ex)
    if len(kept) < len(rows):
        print(f"{source}: held-out set: {len(rows) - len(kept)} of {len(rows)} rows repeat an "
              "earlier row exactly and are evaluated once", flush=True)
    return kept


class DatasetTask:
    """Prompts from a fixed list of rows, drawn in a seeded shuffled order, epoch after epoch."""

    def __init__(self, rows: list[Example], eval_rows: list[Example], seed: int) -> None:
        if not rows:
            raise DataError("the training dataset is empty")
        self.rows, self.eval_examples, self.seed = rows, eval_rows, seed
        self.position, self.epoch = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(f"{self.seed}-{self.epoch}").shuffle(order)
        return order

    def sample(self, n: int) -> list[Example]:
        out = []
        for _ in range(n):
            if self.position >= len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffle()
            out.append(self.rows[self._order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position, self.epoch = int(state["position"]), int(state["epoch"])
        self._order = self._shuffle()
