"""Built-in reward functions and how a config names them.

``REWARDS`` maps a name to ``fn(prompts, completions, **columns) -> list[float | None]``;
``reward.functions`` entries are such names, ``'package.module:function'`` or callables.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import re
import unicodedata
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from gspo.registry import Registry
from gspo.rewards.math import (
    MATH_VERIFY,
    boxed_format_reward,
    countdown_reward,
    math_verify_reward,
)
from gspo.rewards.reasoning_gym import reasoning_gym_reward

RewardFn = Callable[..., list]
REWARDS: Registry[RewardFn] = Registry("reward function")


class RewardSpecError(ValueError):
    """A reward named in the config cannot be found or imported."""

# A number: an optional minus (ASCII '-', U+2212 MINUS SIGN or U+FF0D FULLWIDTH HYPHEN-MINUS),
# then digits with optional thousands commas and decimals ("1,234.5"; LaTeX's "1{,}000",
# "10,\!000" and "10\,000" too), or only decimals (".5", not the ".5" of "1.2.5" or "...5"),
# and an optional exponent ("1.5e3", "1e-05"). \d is any Unicode decimal digit (Arabic-Indic,
# fullwidth, ...). A comma is a thousands separator only between
# groups of three digits: "2,3" and "(4,5)" are two numbers, not 23 and 45. A minus right after
# a digit is a range or a subtraction, not a sign: "pages 3-4" ends with 4, "5-3" with 3.
# A fraction of two integers is one number: "3/4" and "-3/4" with no spaces (not "3 / 4", nor
# "3/4.5", read as before: 3 then 4.5), and LaTeX's \frac{3}{4} (\dfrac, \tfrac; either part
# may carry the minus; \frac34 too).
_MINUS = "-\u2212\uff0d"
_INT = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"
_NUMBER = re.compile(
    rf"(?P<sign>(?<!\d)[{_MINUS}])?(?:"
    rf"\\[dt]?frac\s*\{{\s*(?P<fsign>[{_MINUS}])?(?P<fnum>{_INT})\s*\}}"
    rf"\s*\{{\s*(?P<fden>{_INT})\s*\}}"
    rf"|(?P<num>{_INT})/(?P<den>{_INT})(?!\.\d)"
    rf"|(?P<mant>{_INT}(?:\.\d+)?|(?<![\d.])\.\d+)(?:[eE](?P<exp>[{_MINUS}+]?\d+))?)")
_MAX_EXPONENT_DIGITS = 4  # 10**9999 is cheap to build exactly; 10**(10**9) is not
# LaTeX's thousands separators, read as a plain comma: ``1{,}000``, MATH's ``10,\!000`` (a
# comma and a negative thin space) and the thin space of ``10\,000`` between digit groups.
_LATEX_THOUSANDS = re.compile(r"\{,\}|,\\!|(?<=\d)\\,(?=\d{3}(?!\d))")
# LaTeX's fractions whose arguments are single digits without braces: ``\frac12`` is
# ``\frac{1}{2}`` (and ``\frac1{2}``, ``\frac{1}2``; ``\frac123`` is ``\frac{1}{2}3``).
_BARE_FRAC = re.compile(r"(\\[dt]?frac)\s*(?:(\d)|(\{[^{}]*\}))\s*(?:(\d)|(\{[^{}]*\}))")


def _braced_fracs(text: str) -> str:
    return _BARE_FRAC.sub(lambda m: m[1] + (m[3] or "{" + (m[2] or "") + "}")
                          + (m[5] or "{" + (m[4] or "") + "}"), text)


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function as ``name``; a taken name raises ValueError."""
    return REWARDS.register(name)


# Built-in rewards that need an optional package: name -> :func:`gspo.config.check_optional`'s
# (module, setting, package and how to install it). A run
# that names one without it stops at setup (:func:`check_packages`), not at its first scoring.
PACKAGES: dict[str, tuple[str, str, str]] = {
    "math_verify": MATH_VERIFY,
    "reasoning_gym": ("reasoning_gym", "reward.functions: the reasoning_gym reward",
                      "the reasoning_gym package (pip install 'gspo[reasoning_gym]')"),
}


def check_packages(specs: list[Any]) -> None:
    """:class:`gspo.config.MissingPackage` naming the first built-in reward in ``specs`` whose
    package (:data:`PACKAGES`) is not installed (nothing is imported)."""
    from gspo.config import check_optional

    for spec in specs:
        if isinstance(spec, str) and spec in PACKAGES:
            check_optional(*PACKAGES[spec])


def resolve_reward(spec: str | RewardFn) -> RewardFn:
    """A registered name, ``'package.module:function'``, or a callable."""
    if callable(spec):
        return spec
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except Exception as e:  # also ValueError (':f'), TypeError ('..m:f'), import-time errors
            lines = str(e).strip().splitlines()
            why = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
            raise RewardSpecError(f"reward '{spec}' cannot be imported ({why})") from None
        if not callable(fn):
            raise RewardSpecError(f"reward '{spec}' is not callable")
        return fn
    if spec not in REWARDS:
        names = ", ".join(REWARDS.names())
        raise RewardSpecError(f"unknown reward '{spec}'; choose one of: {names} "
                              "or give 'module:function'")
    return REWARDS[spec]


def _ascii(part: str) -> str:
    """``part`` of a number in ASCII: any minus is ``-``, thousands commas go, digits of any
    script become ``0-9``."""
    out = []
    for ch in part:
        if ch in _MINUS:
            out.append("-")
        elif ch in ".+":
            out.append(ch)
        elif ch != ",":
            out.append(str(unicodedata.decimal(ch)))  # \d matched: a Unicode decimal digit
    return "".join(out)


def _last_number_text(text: str) -> str | None:
    """The last number in ``text`` in ASCII (``-1234.5``, ``3/4``, ``1.5e3``), or None when there
    is none."""
    matches = list(_NUMBER.finditer(_braced_fracs(_LATEX_THOUSANDS.sub(",", text))))
    if not matches:
        return None
    found = matches[-1]
    minus = "-" if found["sign"] else ""
    if found["fnum"] is not None:  # \frac{a}{b}: a minus outside and one inside cancel
        minus = "-" if bool(found["sign"]) != bool(found["fsign"]) else ""
        return f"{minus}{_ascii(found['fnum'])}/{_ascii(found['fden'])}"
    if found["num"] is not None:
        return f"{minus}{_ascii(found['num'])}/{_ascii(found['den'])}"
    exp = "" if found["exp"] is None else "e" + _ascii(found["exp"])
    return f"{minus}{_ascii(found['mant'])}{exp}"


def _exact(number: str) -> Fraction | None:
    """``number`` (what :func:`_last_number_text` gives) as a fraction, or None: ``3/0``, an
    exponent of more than four digits, more digits than ``int()`` converts."""
    if "e" in number and len(number.partition("e")[2].lstrip("+-")) > _MAX_EXPONENT_DIGITS:
        return None
    try:
        return Fraction(number)
    except (ValueError, ZeroDivisionError):
        return None


def extract_exact_number(text: str) -> Fraction | None:
    """The last number in ``text`` as an exact fraction (``"12.0"`` is 12, ``"0.1"`` is 1/10,
    ``"3/4"`` is 3/4), or None when there is none; see :func:`extract_number` for what counts as
    a number."""
    number = _last_number_text(text)
    return None if number is None else _exact(number)


def extract_number(text: str) -> float | None:
    """The last number in ``text`` (``-12``, ``1,234`` or LaTeX's ``1,\\!234``, ``3.5``, ``.5``,
    ``−3`` with U+2212, ``1.5e3``, the fractions ``3/4`` and ``\\frac{3}{4}``), or None when there
    is none (or it is ``x/0``). Digits of any script count (``٣``, ``７``)."""
    number = _last_number_text(text)
    if number is None:
        return None
    if "/" not in number:
        return float(number)  # inf past float's range, as before
    value = _exact(number)
    if value is None:
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _reference_number(ref: Any) -> Fraction | None:
    """A reference as an exact number: a number (a numeric column) as it prints, so that
    ``1e-05`` is 1/100000, else the last number of its text (``"#### 72"`` is 72, ``"3/4"`` is
    3/4, ``"1e-05"``, what a float column's answer arrives as, is 1/100000)."""
    if isinstance(ref, numbers.Real) and not isinstance(ref, bool):
        try:
            return Fraction(str(ref))
        except (ValueError, OverflowError, ZeroDivisionError):  # inf, nan
            return None
    return extract_exact_number(str(ref))


@register_reward("numeric_match")
def numeric_match(prompts: list[str], completions: list[str], *, answer: list[str],
                  **_: Any) -> list[float | None]:
    """1.0 when the last number in the response equals the reference answer exactly, else 0.0.

    Answer format: the response may say anything, but its final number is read as the answer
    ("3 + 4 = 7" and "The answer is 7." both score 1). Numbers compare exactly, as rationals:
    ``12.0`` equals ``12``, but ``12345678902`` does not equal ``12345678901`` and ``0.5`` (also
    written ``.5``) does not equal ``5``. A fraction is one number in the reference and the
    response alike: ``3/4``, ``\\frac{3}{4}`` and ``0.75`` are equal, and ``4`` does not equal
    ``3/4`` (a mixed number ``1 1/2`` is read as ``1/2``, ``50%`` as ``50``); so is scientific
    notation, ``1.5e3`` being 1500. A reference that is not a number makes that row unscorable
    (None).
    """
    out: list[float | None] = []
    for completion, ref in zip(completions, answer):
        target = _reference_number(ref)
        if target is None:
            out.append(None)
            continue
        out.append(float(extract_exact_number(completion) == target))
    return out


@register_reward("code")
def code_tests(prompts: list[str], completions: list[str], *, tests: list[Any],
               **columns: Any) -> list[float | None]:
    """Fraction of a row's tests that the response's Python code passes, run in the sandbox
    (:mod:`gspo.rewards.sandbox`); every program failure scores 0.0."""
    from gspo.rewards.sandbox import code_reward

    return code_reward(prompts, completions, tests=tests, **columns)


@register_reward("math_verify")
def math_verify(prompts: list[str], completions: list[str], *, answer: list[Any],
                **columns: Any) -> list[float | None]:
    """1.0 when math-verify finds the final answer equal to the reference (``\\boxed{3/4}``
    matches ``0.75``); see :func:`gspo.rewards.math.math_verify_reward`."""
    return math_verify_reward(prompts, completions, answer=answer, **columns)


@register_reward("boxed_format")
def boxed_format(prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
    """1.0 when the response contains a closed, non-empty ``\\boxed{...}``, else 0.0."""
    return boxed_format_reward(prompts, completions, **columns)


@register_reward("countdown")
def countdown(prompts: list[str], completions: list[str], *, numbers: list[Any],
              target: list[Any], **columns: Any) -> list[float | None]:
    """1.0 when the response's expression reaches ``target`` using each of ``numbers`` at most
    once (task.name=countdown); see :func:`gspo.rewards.math.countdown_reward`."""
    return countdown_reward(prompts, completions, numbers=numbers, target=target, **columns)


@register_reward("reasoning_gym")
def reasoning_gym(prompts: list[str], completions: list[str], *, rg_dataset: list[str],
                  rg_options: list[Any], rg_entry: list[Any], **columns: Any
                  ) -> list[float | None]:
    """The reasoning-gym dataset's own verifier (task.name=reasoning_gym); see
    :func:`gspo.rewards.reasoning_gym.reasoning_gym_reward`."""
    return reasoning_gym_reward(prompts, completions, rg_dataset=rg_dataset,
                                rg_options=rg_options, rg_entry=rg_entry, **columns)
