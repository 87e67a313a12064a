"""Math rewards: symbolic answer checking (math-verify), a \\boxed{} format check, Countdown.

All follow the reward contract ``fn(prompts, completions, **columns) -> list[float | None]``
and are registered in :mod:`gspo.rewards.functions` as ``math_verify``, ``boxed_format`` and
``countdown``.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import math
import numbers
import re
import threading
from collections import Counter
from decimal import Decimal
from fractions import Fraction
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gspo.rewards.isolation import RewardProcess

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
#
# math-verify (sympy) computes exactly: "10^{10^{10}}" is an integer of 10^10 digits, "(10^{10})!"
# or "\binom{10^{10}}{5 \cdot 10^9}" worse. In the scorer's worker thread math-verify's own
# timeouts are off (SIGALRM is the main thread's), and the C code computing holds the GIL, so
# the scorer's thread timeout cannot regain control either: the trainer hangs. Two layers:
#
# 1. value_bits() bounds, on the parsed sympy tree (every LaTeX spelling of a power parses to
#    the same Pow), how many bits evaluating an expression could take; a response past
#    MAX_VALUE_BITS scores 0.0 and a reference past it makes the row unscorable (None), before
#    verify() runs. Answers of up to ~40,000 digits (2^{100}, 10^{6}, 2^{2^{16}}) still compare.
# 2. latex2sympy evaluates some things while *parsing* (\gcd, \binom, \Gamma, \det,
#    \operatorname{eye}, ...), before any guard can look. So the reward runs parse + verify in a
#    helper process (gspo.rewards.isolation.RewardProcess, one per reward call), one response
#    at a time: past ROW_TIMEOUT_S seconds or HELPER_MEMORY_MB of memory the helper is killed,
#    that response scores 0.0 and a fresh helper takes the next one. No response can hang the
#    reward.

MAX_VALUE_BITS = 1 << 17  # bound on the size of any (sub)expression verify() may evaluate
ROW_TIMEOUT_S = 10.0  # parse + verify of one response, in the helper; then it is killed
HELPER_MEMORY_MB = 2048  # the helper's resident memory limit; then it is killed
HELPER_START_S = 60.0  # a (re)started helper's first, warm-up check (imports sympy)
_MAX_EXPONENT_LOG2 = 64  # |exponent| >= 2^64: past any bound whatever the base
_MAX_COUNT_LOG2 = 24  # factorial/binomial argument or Sum/Product length >= 2^24: too big


class _TooBig(Exception):
    """An expression whose evaluation could exceed MAX_VALUE_BITS."""


@functools.cache
def _combinatorial_types() -> tuple[type, ...]:
    """sympy functions whose exact value grows like n! (or 2^n) in their argument n."""
    import sympy

    names = ("factorial", "factorial2", "subfactorial", "binomial", "RisingFactorial",
             "FallingFactorial", "gamma", "loggamma", "uppergamma", "lowergamma", "polygamma",
             "fibonacci", "lucas", "tribonacci", "catalan", "harmonic", "bell", "bernoulli",
             "euler", "genocchi", "partition")
    return tuple(t for n in names if isinstance(t := getattr(sympy, n, None), type))


def value_bits(expr: Any) -> float:
    """An upper bound on the bits that evaluating sympy ``expr`` exactly could produce.

    Structural, so no evaluation: a number counts its own size; ``+``/``*`` add sizes; ``b^e``
    multiplies the base's size by a bound on ``|e|`` (so towers, huge exponents and
    ``1.5\\cdot10^{10^{10}}`` alike blow up); factorial-like functions, ``exp`` and the length of
    sums and products count as such. Raises :class:`_TooBig` past :data:`MAX_VALUE_BITS` (also
    for trees too deep to walk).
    """
    import sympy
    from sympy.concrete.expr_with_limits import ExprWithLimits
    from sympy.matrices import MatrixBase

    combinatorial = _combinatorial_types()

    def check(size: float, mag: float) -> tuple[float, float]:
        if size > MAX_VALUE_BITS or mag > MAX_VALUE_BITS:
            raise _TooBig
        return size, mag

    def power_bound(mag: float) -> float:  # |x| <= 2^mag
        if mag >= _MAX_EXPONENT_LOG2:
            raise _TooBig
        return 2.0 ** mag

    def walk(node: Any, env: dict[Any, tuple[float, float]]) -> tuple[float, float]:
        """(size, mag): bits to write the value exactly, and log2 of a bound on |value|."""
        if isinstance(node, sympy.Rational):  # also Integer
            p, q = abs(int(node.p)), int(node.q)
            mag = max(0.0, (math.log2(p) if p > 1 else 0.0) - math.log2(q))
            return check(max(1.0, math.log2(p) if p else 0.0, math.log2(q)), mag)
        if isinstance(node, sympy.Float):
            _, man, exp, bc = node._mpf_
            if not man:
                return 1.0, 0.0  # zero, inf, nan
            return check(max(1.0, float(bc), float(abs(exp) + bc)), max(0.0, float(exp + bc)))
        if isinstance(node, MatrixBase):  # entries add up; a matrix power is a power
            parts = [walk(e, env) for e in node]
            return check(sum(s for s, _ in parts) + 1, sum(m for _, m in parts)
                         + math.log2(max(1, len(parts))))
        if not isinstance(node, sympy.Basic):
            return 1.0, 0.0  # strings and such inside some sympy objects
        if node in env:  # a summation / product variable: as large as its bounds
            return env[node]
        if node.is_Atom:  # symbols, pi, E, I, oo, nan...
            return 2.0, 2.0
        if isinstance(node, (sympy.Pow, sympy.MatPow)):
            base, exponent = node.args
            if base in (sympy.S.Zero, sympy.S.One, sympy.S.NegativeOne):
                walk(exponent, env)
                return 1.0, 0.0
            bsize, bmag = walk(base, env)
            bound = power_bound(walk(exponent, env)[1])
            return check(bsize * bound, bmag * bound)
        if isinstance(node, sympy.exp):
            bound = power_bound(walk(node.args[0], env)[1])
            return check(1.5 * bound, 1.5 * bound)
        if isinstance(node, combinatorial):
            n = power_bound(max(walk(a, env)[1] for a in node.args))
            if n >= 2 ** _MAX_COUNT_LOG2:
                raise _TooBig
            bits = max(1.0, n * math.log2(max(n, 2.0)))  # log2(n!) <= n log2 n; 2^n too
            return check(bits, bits)
        if isinstance(node, sympy.Derivative):  # differentiated n times: n steps
            for _, times in node.variable_count:
                if power_bound(walk(times, env)[1]) >= 2 ** _MAX_COUNT_LOG2:
                    raise _TooBig
        if isinstance(node, ExprWithLimits):  # Sum, Product, Integral
            inner = dict(env)
            count = 1.0
            for limit in node.limits:
                if len(limit) == 3:
                    lo, hi = walk(limit[1], env), walk(limit[2], env)
                    span = power_bound(lo[1]) + power_bound(hi[1]) + 1
                    if span >= 2 ** _MAX_COUNT_LOG2:
                        raise _TooBig
                    count *= span
                    inner[limit[0]] = (max(lo[0], hi[0]), max(lo[1], hi[1]))
            size, mag = walk(node.function, inner)
            if isinstance(node, sympy.Product):
                return check(size * count, mag * count)
            return check(size * count, mag + math.log2(count))  # a sum's denominators multiply
        parts = [walk(a, env) for a in node.args]
        return check(sum(s for s, _ in parts) + len(parts), sum(m for _, m in parts) + 1)

    try:
        return walk(expr, {})[0]
    except RecursionError:
        raise _TooBig from None


def _small_enough(parsed: list[Any]) -> bool:
    """False when any sympy value math-verify parsed could take more than MAX_VALUE_BITS."""
    try:
        for item in parsed:
            if not isinstance(item, str):
                value_bits(item)
    except _TooBig:
        return False
    return True


def _gold_text(answer: Any) -> str:
    """GSM8K references end in ``#### 72``: keep what follows the marker. A number (a numeric
    column) is written out in full: ``str(0.00001)`` is ``1e-05``, which reads as e - 5."""
    if isinstance(answer, numbers.Real) and not isinstance(answer, bool):
        with contextlib.suppress(ArithmeticError, ValueError):
            return format(Decimal(str(answer)), "f")
    text = str(answer)
    return text.rsplit("####", 1)[1].strip() if "####" in text else text.strip()


# A reference math-verify finds LaTeX in by itself, and one that is prose ("18 dollars"; a word
# of three letters not after a backslash: not \sqrt, \text{cm} or x^2): read as it is.
_DELIMITED = re.compile(r"\\boxed|(?<!\\)\$")
_PROSE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")


def _parse_gold(parse: Any, text: str, timeout: int | None) -> list[Any]:
    """The reference as math-verify parses it. A bare LaTeX reference (MATH's ``3\\sqrt{13}``,
    ``[1, 3]``, ``\\frac{\\pi}{2}``) is read inside ``\\boxed{}``, as verl does: math-verify
    reads LaTeX only in ``\\boxed{}`` or ``$...$``, so bare ``3\\sqrt{13}`` would be its number
    3, ``[1, 3]`` and ``2, 3`` would be 3, and ``\\sqrt{2}`` or ``x^2+1`` nothing. A reference
    with its own ``\\boxed{}`` or ``$...$``, prose, or one the boxed form gives nothing for is
    parsed as it is."""
    if not _DELIMITED.search(text) and not _PROSE.search(text):
        gold = parse(f"\\boxed{{{text}}}", parsing_timeout=timeout)
        if gold:
            return gold
    return parse(text, parsing_timeout=timeout)


MATH_VERIFY = ("math_verify", "reward.functions: the math_verify reward",
               "the math_verify package (pip install math-verify)")


def _import_math_verify() -> tuple[Any, Any]:
    from gspo.config import import_optional

    module = import_optional(*MATH_VERIFY)
    return module.parse, module.verify


def math_verify_scores(completions: list[str], answers: list[Any]) -> list[float | None]:
    """:func:`math_verify_reward`'s values computed in this process: with the size guard
    (:func:`value_bits`) but no hard time limit, as parsing can evaluate (see above)."""
    parse, verify = _import_math_verify()
    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    out: list[float | None] = []
    for completion, ref in zip(completions, answers):
        gold = _parse_gold(parse, _gold_text(ref), timeout)
        if not gold or not _small_enough(gold):
            out.append(None)
            continue
        pred = parse(completion, parsing_timeout=timeout)
        if not pred or not _small_enough(pred):
            out.append(0.0)
            continue
        out.append(float(verify(gold, pred, timeout_seconds=timeout)))
    return out


def _helper_rows(prompts: list[str], completions: list[str], *, answer: list[Any],
                 **_: Any) -> list[float | None]:
    """What the helper process serves (reached as ``gspo.rewards.math:_helper_rows``)."""
    return math_verify_scores(completions, answer)


def _check_in_helper(helper: RewardProcess, completion: str, ref: Any) -> float | None:
    """One response's value from the helper; 0.0 when it had to be killed."""
    from gspo.rewards.isolation import IsolatedFailure

    if helper.proc is None or helper.proc.poll() is not None:
        try:  # (re)start it outside the response's time limit: it imports sympy
            helper.call([""], ["1"], {"answer": ["1"]}, HELPER_START_S)
        except IsolatedFailure as e:
            raise RuntimeError(f"the math_verify helper process did not start:\n{e.report}"
                               ) from None
    try:
        (value,) = helper.call([""], [completion], {"answer": [ref]}, ROW_TIMEOUT_S)
    except IsolatedFailure as e:
        if not e.report.startswith(("RewardTimeout", "RewardMemory", "RewardCrash")):
            raise RuntimeError(f"math_verify failed in its helper process:\n{e.report}"
                               ) from None
        return 0.0  # killed past ROW_TIMEOUT_S or HELPER_MEMORY_MB: not a checkable answer
    return value


def math_verify_reward(prompts: list[str], completions: list[str], *, answer: list[Any],
                       **_: Any) -> list[float | None]:
    """1.0 when math-verify finds the response's final answer equal to the reference.

    Equality is symbolic/numeric: ``\\boxed{3/4}``, ``0.75`` and ``\\frac{3}{4}`` all match a
    reference of ``0.75``. The response's ``\\boxed{}`` answer is preferred; otherwise the last
    expression is read. A reference math-verify cannot parse, or one too large to evaluate
    (:data:`MAX_VALUE_BITS`), makes that row unscorable (None). A response whose answer is too
    large to evaluate (``10^{10^{10}}``, ``(10^{10})!``), or that is still being checked after
    :data:`ROW_TIMEOUT_S` seconds, scores 0.0: parsing and checking run in a helper process
    (started for the call, ~0.3 s, and stopped before it returns) that is killed then, so no
    response can hang the reward. Needs ``pip install math-verify``.
    """
    from gspo.config import check_optional

    check_optional(*MATH_VERIFY)
    if not completions:
        return []
    from gspo.rewards.isolation import RewardProcess

    # One helper per call, closed before returning: no process outlives the call.
    helper = RewardProcess("math_verify", "gspo.rewards.math:_helper_rows",
                           memory_mb=HELPER_MEMORY_MB)
    try:
        return [_check_in_helper(helper, c, ref) for c, ref in zip(completions, answer)]
    finally:
        helper.close()


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
