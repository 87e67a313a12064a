"""The built-in arithmetic task: procedural integer problems with a verifiable answer.

A task yields :class:`~gspo.data.base.Example` rows: a user message, a reference answer and
extra columns that are passed to reward functions as keyword arguments.
"""

from __future__ import annotations

import random
from typing import Any

from gspo.data.base import Example, is_held_out, to_tuple

# (low, high) operand ranges per difficulty level, both inclusive.
LEVELS: dict[int, tuple[tuple[int, int], tuple[int, int]]] = {
    1: ((0, 9), (0, 9)),
    2: ((10, 99), (0, 9)),
    3: ((10, 99), (10, 99)),
    4: ((100, 999), (10, 99)),
}


def _key(op: str, a: int, b: int) -> str:
    """Canonical form of a problem: a+b and b+a (and a-b, b-a) are the same problem."""
    hi, lo = max(a, b), min(a, b)
    return f"{op}{hi},{lo}"


PROMPT_TEMPLATE = "What is {problem}? Answer with a number."
"""The arithmetic task's default prompt (``task.prompt_template`` replaces it)."""


class ArithmeticTask:
    """Procedural integer arithmetic with a verifiable answer.

    Problem ``(op, a, b)`` belongs to the held-out split iff a hash of it falls in one fifth of
    the hash space, so train and eval never share a problem whatever the seed; the seed only
    orders the draws. Prompt: ``"What is {a}{op}{b}? Answer with a number."``; the reward reads
    the last number in the response (see :func:`gspo.rewards.numeric_match`).
    """

    def __init__(self, levels: list[int], level_weights: list[float], operations: list[str],
                 eval_levels: list[int], eval_size: int, seed: int, *,
                 template: str = PROMPT_TEMPLATE) -> None:
        self.levels, self.operations = list(levels), list(operations)
        self.template = template
        self.weights = list(level_weights) or [1.0] * len(levels)
        self.rng = random.Random(seed)
        self.eval_examples = self._eval_set(eval_levels or levels, eval_size, seed)

    @staticmethod
    def make(op: str, a: int, b: int, level: int, *, template: str = PROMPT_TEMPLATE) -> Example:
        """Problem ``a op b`` (a - b with a ≥ b), its prompt ``template`` with ``{problem}``
        replaced by e.g. ``12*34``."""
        if op == "-" and b > a:
            a, b = b, a
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Example(template.replace("{problem}", f"{a}{op}{b}"), str(value),
                       {"level": level})

    def _draw(self, rng: random.Random, level: int, held_out: bool) -> Example:
        (lo_a, hi_a), (lo_b, hi_b) = LEVELS[level]
        while True:
            op = rng.choice(self.operations)
            a, b = rng.randint(lo_a, hi_a), rng.randint(lo_b, hi_b)
            if is_held_out(_key(op, a, b)) == held_out:
                return self.make(op, a, b, level, template=self.template)

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
        self.rng.setstate(to_tuple(state["rng"]))
