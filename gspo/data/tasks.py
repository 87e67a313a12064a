"""Prompt datasets: what the trainer samples prompts from and evaluates on.

A task yields :class:`Example` rows: a user message, a reference answer and extra columns that
are passed to reward functions as keyword arguments.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gspo.data.datasets import DataError, load_jsonl

if TYPE_CHECKING:
    from gspo.data.builtin import CountdownTask

# (low, high) operand ranges per difficulty level, both inclusive.
LEVELS: dict[int, tuple[tuple[int, int], tuple[int, int]]] = {
    1: ((0, 9), (0, 9)),
    2: ((10, 99), (0, 9)),
    3: ((10, 99), (10, 99)),
    4: ((100, 999), (10, 99)),
}
EVAL_SHARE = 5  # one problem in EVAL_SHARE is held out (by a hash of the problem, not by seed)


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    columns: dict[str, Any] = field(default_factory=dict)


def _key(op: str, a: int, b: int) -> str:
    """Canonical form of a problem: a+b and b+a (and a-b, b-a) are the same problem."""
    hi, lo = max(a, b), min(a, b)
    return f"{op}{hi},{lo}"


def _is_held_out(key: str) -> bool:
    digest = hashlib.sha256(key.encode()).digest()
    return digest[0] % EVAL_SHARE == 0


class ArithmeticTask:
    """Procedural integer arithmetic with a verifiable answer.

    Problem ``(op, a, b)`` belongs to the held-out split iff a hash of it falls in one fifth of
    the hash space, so train and eval never share a problem whatever the seed; the seed only
    orders the draws. Prompt: ``"What is {a}{op}{b}? Answer with a number."``; the reward reads
    the last number in the response (see :func:`gspo.rewards.numeric_match`).
    """

    def __init__(self, levels: list[int], level_weights: list[float], operations: list[str],
                 eval_levels: list[int], eval_size: int, seed: int) -> None:
        self.levels, self.operations = list(levels), list(operations)
        self.weights = list(level_weights) or [1.0] * len(levels)
        self.rng = random.Random(seed)
        self.eval_examples = self._eval_set(eval_levels or levels, eval_size, seed)

    @staticmethod
    def make(op: str, a: int, b: int, level: int) -> Example:
        if op == "-" and b > a:
            a, b = b, a
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Example(f"What is {a}{op}{b}? Answer with a number.", str(value),
                       {"level": level})

    def _draw(self, rng: random.Random, level: int, held_out: bool) -> Example:
        (lo_a, hi_a), (lo_b, hi_b) = LEVELS[level]
        while True:
            op = rng.choice(self.operations)
            a, b = rng.randint(lo_a, hi_a), rng.randint(lo_b, hi_b)
            if _is_held_out(_key(op, a, b)) == held_out:
                return self.make(op, a, b, level)

    def _eval_set(self, levels: list[int], size: int, seed: int) -> list[Example]:
        rng = random.Random(f"eval-{seed}")
        out: list[Example] = []
        seen: set[str] = set()
        per_level = [size // len(levels) + (i < size % len(levels)) for i in range(len(levels))]
        for level, n in zip(levels, per_level):
            # Small levels have few held-out problems: stop when no new one turns up.
            misses, count = 0, 0
            while count < n and misses < 2000:
                ex = self._draw(rng, level, held_out=True)
                if ex.prompt in seen:
                    misses += 1
                    continue
                seen.add(ex.prompt)
                out.append(ex)
                count += 1
        return out

    def sample(self, n: int) -> list[Example]:
        levels = self.rng.choices(self.levels, weights=self.weights, k=n)
        return [self._draw(self.rng, lv, held_out=False) for lv in levels]

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.setstate(_to_tuple(state["rng"]))


def _to_tuple(x: Any) -> Any:
    return tuple(_to_tuple(v) for v in x) if isinstance(x, list) else x


class DatasetTask:
    """Prompts from a JSONL file, drawn in a seeded shuffled order, epoch after epoch."""

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


def build_task(cfg: Any, seed: int) -> ArithmeticTask | DatasetTask | CountdownTask:
    """Build the task named by a :class:`gspo.config.TaskConfig`."""
    if cfg.name == "arithmetic":
        return ArithmeticTask(cfg.levels, cfg.level_weights, cfg.operations, cfg.eval_levels,
                              cfg.eval_size, seed)
    if cfg.name == "jsonl":
        rows = load_jsonl(cfg.path, cfg.prompt_field, cfg.answer_field)
        if cfg.eval_path:
            eval_rows = load_jsonl(cfg.eval_path, cfg.prompt_field, cfg.answer_field)
        else:
            order = list(range(len(rows)))
            random.Random(f"split-{seed}").shuffle(order)
            n_eval = min(cfg.eval_size, len(rows) // 5)
            eval_rows = [rows[i] for i in order[:n_eval]]
            rows = [rows[i] for i in order[n_eval:]]
        return DatasetTask(rows, eval_rows, seed)
    if cfg.name == "dataset":
        from gspo.data.hf import dataset_task

        return dataset_task(cfg, seed)
    if cfg.name == "countdown":
        from gspo.data.builtin import CountdownTask

        return CountdownTask(cfg.countdown_numbers, cfg.eval_size, seed)
    if cfg.name == "gsm8k_mini":
        from gspo.data.builtin import gsm8k_mini_task

        return gsm8k_mini_task(cfg.eval_size, seed)
    raise DataError(f"task.name: unknown task '{cfg.name}' "
                    "(choose arithmetic, countdown, gsm8k_mini, jsonl or dataset)")
