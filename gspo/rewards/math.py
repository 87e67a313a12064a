"""Math rewards: symbolic answer checking (math-verify), a \\boxed{} format check, Countdown.

All follow the reward contract ``fn(prompts, completions, **columns) -> list[float | None]``
and are registered in :mod:`gspo.rewards.functions` as ``math_verify``, ``boxed_format`` and
``countdown``.
"""

from __future__ import annotations

import ast
import threading
from collections import Counter
from fractions import Fraction
from typing import Any

MAX_EXPRESSION_CHARS = 200  # longer "expressions" score 0 without being parsed


# ----------------------------------------------------------------------------- \boxed{}


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1:j]
        start = text.rfind("\\boxed{", 0, start)  # unbalanced: try an earlier one
    return None


def boxed_format_reward(prompts: list[str], completions: list[str],
                        **_: Any) -> list[float | None]:
    """1.0 when the response contains a closed, non-empty ``\\boxed{...}``, else 0.0."""
    return [float(bool((last_boxed(c) or "").strip())) for c in completions]


# ----------------------------------------------------------------------------- math-verify


def _gold_text(answer: Any) -> str:
    """GSM8K references end in ``#### 72``: keep what follows the marker."""
    text = str(answer)
    return text.rsplit("####", 1)[1].strip() if "####" in text else text.strip()


def math_verify_reward(prompts: list[str], completions: list[str], *, answer: list[Any],
                       **_: Any) -> list[float | None]:
    """1.0 when math-verify finds the response's final answer equal to the reference.

    Equality is symbolic/numeric: ``\\boxed{3/4}``, ``0.75`` and ``\\frac{3}{4}`` all match a
    reference of ``0.75``. The response's ``\\boxed{}`` answer is preferred; otherwise the last
    expression is read. A reference math-verify cannot parse makes that row unscorable (None).
    Needs ``pip install math-verify``.
    """
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError("the math_verify reward needs the math-verify package: "
                          "pip install math-verify") from None
    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    out: list[float | None] = []
    for completion, ref in zip(completions, answer):
        gold = parse(_gold_text(ref), parsing_timeout=timeout)
        if not gold:
            out.append(None)
            continue
        pred = parse(completion, parsing_timeout=timeout)
        out.append(float(bool(pred) and verify(gold, pred, timeout_seconds=timeout)))
    return out


# ----------------------------------------------------------------------------- Countdown

_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def evaluate_expression(text: str) -> tuple[Fraction, list[int]] | None:
    """Exact value of an arithmetic expression and the integers it uses; None if not allowed.

    Only integer literals, ``+ - * /`` and parentheses are accepted (no unary minus, powers,
    names or calls), read with :mod:`ast` and evaluated with fractions: nothing is ever eval'd.
    """
    text = text.strip()
    if not text or len(text) > MAX_EXPRESSION_CHARS:
        return None
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    used: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div):
                if b == 0:
                    raise ZeroDivisionError
                return a / b
            return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}[type(node.op)]
        raise ValueError(f"not allowed: {type(node).__name__}")

    try:
        return walk(tree.body), used
    except (ValueError, ZeroDivisionError, RecursionError):
        return None


def _candidates(completion: str) -> list[str]:
    """Expressions the response may be giving: its ``<answer>``/``\\boxed{}`` content, else its
    last non-empty line; each side of an ``=`` is a candidate ("3*7+12 = 33")."""
    text = completion
    if "<answer>" in text:
        text = text.rsplit("<answer>", 1)[1].split("</answer>", 1)[0]
    elif (boxed := last_boxed(text)) is not None:
        text = boxed
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    return [part.strip().rstrip(".") for part in last.split("=")]


def countdown_score(completion: str, numbers: list[int], target: int) -> float:
    """1.0 when an expression in the response uses each given number at most once (a number
    given twice may be used twice) and equals ``target`` exactly, else 0.0."""
    allowed = Counter(int(n) for n in numbers)
    for cand in _candidates(completion):
        result = evaluate_expression(cand)
        if result is None:
            continue
        value, used = result
        if not Counter(used) - allowed and value == int(target):
            return 1.0
    return 0.0


def countdown_reward(prompts: list[str], completions: list[str], *, numbers: list[Any],
                     target: list[Any], **_: Any) -> list[float | None]:
    """Countdown: the response's expression must reach ``target`` with the given ``numbers``."""
    return [countdown_score(c, n, t) for c, n, t in zip(completions, numbers, target)]
