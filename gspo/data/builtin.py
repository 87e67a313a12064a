"""Built-in reasoning tasks: procedural Countdown and a small bundled GSM8K-style set.

``countdown``: reach a target with + - * / over given numbers, each used at most once (the
TinyZero setting); scored by :func:`gspo.rewards.math.countdown_reward`.
``gsm8k_mini``: 40 short grade-school word problems with integer answers, written for this
package (``gspo/data/files/gsm8k_mini.jsonl``); scored by ``numeric_match`` or ``math_verify``.
"""

from __future__ import annotations

import random
from fractions import Fraction
from pathlib import Path
from typing import Any

from gspo.data.base import DatasetTask, Example, hold_out, is_held_out, to_tuple
from gspo.data.datasets import load_jsonl

GSM8K_MINI = Path(__file__).parent / "files" / "gsm8k_mini.jsonl"
BOXED_INSTRUCTION = " Put the final answer in \\boxed{}."
NUMBER_RANGE = (1, 25)
TARGET_RANGE = (1, 100)
_OPS = ("+", "-", "*", "/")


def _apply(op: str, a: Fraction, b: Fraction) -> Fraction | None:
    if op == "/":
        return a / b if b != 0 else None
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def _random_expression(rng: random.Random, numbers: list[int]) -> tuple[str, Fraction] | None:
    """Combine ``numbers`` (all of them, in a random tree) into an expression and its value."""
    terms = [(str(n), Fraction(n)) for n in numbers]
    while len(terms) > 1:
        (ea, va), (eb, vb) = terms.pop(rng.randrange(len(terms))), terms.pop(
            rng.randrange(len(terms)))
        op = rng.choice(_OPS)
        value = _apply(op, va, vb)
        if value is None:
            return None
        terms.append((f"({ea} {op} {eb})", value))
    expr, value = terms[0]
    return expr[1:-1] if expr.startswith("(") else expr, value


class CountdownTask:
    """Countdown problems: ``n`` numbers in 1..25 and a reachable integer target in 1..100.

    Each problem is built backwards from a random expression over a random subset (at least
    two) of its numbers, so it has a solution, kept in ``answer``; the reward accepts any
    correct expression. Held-out problems are picked by a hash of (sorted numbers, target),
    as in the arithmetic task, so the split does not depend on the seed.
    """

    def __init__(self, n_numbers: int, eval_size: int, seed: int) -> None:
        self.n = n_numbers
        self.rng = random.Random(seed)
        eval_rng = random.Random(f"countdown-eval-{seed}")
        seen: set[str] = set()
        self.eval_examples: list[Example] = []
        for _ in range(eval_size * 50):
            if len(self.eval_examples) >= eval_size:
                break
            ex = self._draw(eval_rng, held_out=True)
            if ex.prompt not in seen:
                seen.add(ex.prompt)
                self.eval_examples.append(ex)

    @staticmethod
    def make(numbers: list[int], target: int, solution: str) -> Example:
        listed = ", ".join(map(str, numbers))
        prompt = (f"Using the numbers {listed}, write an expression that equals {target}. "
                  "Use + - * / and parentheses, each number at most once. "
                  "Answer with the expression only.")
        return Example(prompt, solution, {"numbers": list(numbers), "target": target})

    def _draw(self, rng: random.Random, held_out: bool) -> Example:
        while True:
            numbers = [rng.randint(*NUMBER_RANGE) for _ in range(self.n)]
            used = rng.sample(numbers, rng.randint(2, self.n))
            built = _random_expression(rng, used)
            if built is None:
                continue
            expr, value = built
            if value.denominator != 1 or not TARGET_RANGE[0] <= value <= TARGET_RANGE[1]:
                continue
            target = int(value)
            key = f"countdown{sorted(numbers)}={target}"
            if is_held_out(key) == held_out:
                return self.make(numbers, target, expr)

    def sample(self, n: int) -> list[Example]:
        return [self._draw(self.rng, held_out=False) for _ in range(n)]

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.setstate(to_tuple(state["rng"]))


def gsm8k_mini_task(eval_size: int, seed: int) -> DatasetTask:
    """The bundled word problems, each asking for a ``\\boxed{}`` final answer."""
    rows = [Example(ex.prompt + BOXED_INSTRUCTION, ex.answer, ex.columns)
            for ex in load_jsonl(str(GSM8K_MINI))]
    train, held = hold_out(rows, eval_size, seed)
    return DatasetTask(train, held, seed)
