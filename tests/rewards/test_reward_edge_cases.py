"""Reward edge cases: numeric_match compares exactly (long integers, ".5", U+2212 minus), and no
response can hang the built-in math_verify reward (answers too large to evaluate)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from gspo.rewards import final_numeric_match, numeric_match
from gspo.rewards.functions import extract_number

# ----------------------------------------------------------------------------- numeric_match


def nm(completion: str, answer: str) -> float | None:
    (out,) = numeric_match(["p"], [completion], answer=[answer])
    return out


@pytest.mark.parametrize("completion, answer, expected", [
    # exact: no relative tolerance
    ("12345678902", "12345678901", 0.0),
    ("12345678901", "12345678901", 1.0),
    ("1,234,567,890,123", "1234567890124", 0.0),
    ("0.30000000000000004", "0.3", 0.0),
    ("0.1", "0.1", 1.0),
    ("12.0", "12", 1.0),
    ("12.50", "12.5", 1.0),
    # a number may start at its decimal point
    ("The answer is .5", "5", 0.0),
    ("The answer is .5", "0.5", 1.0),
    ("-.5", "-0.5", 1.0),
    ("so...5", "5", 1.0),  # an ellipsis is not a decimal point
    ("1.2.5", "5", 1.0),  # as before: "1.2" then "5"
    # U+2212 MINUS SIGN (and the fullwidth hyphen-minus) are minus signs
    ("\u22123", "-3", 1.0),
    ("10 \u2212 15 = \u22125", "-5", 1.0),
    ("\u22123", "3", 0.0),
    ("-3", "\u22123", 1.0),
    ("\uff0d\uff13", "-3", 1.0),
    # what worked before still works
    ("7.", "7", 1.0),
    ("7!", "7", 1.0),
    ("7)", "7", 1.0),
    ("**7**", "7", 1.0),
    ("1,234", "1234", 1.0),
    ("-5", "-5", 1.0),
    ("\u0664\u0662", "42", 1.0),  # Arabic-Indic digits
    ("\uff14\uff12", "42", 1.0),  # fullwidth digits
    ("\U0001d7d2\U0001d7d0", "42", 1.0),  # mathematical bold digits
])
def test_numeric_match_is_exact(completion, answer, expected):
    assert nm(completion, answer) == expected


def test_extract_number_reads_decimals_and_unicode_minus():
    from gspo.rewards.functions import extract_exact_number

    assert extract_number("about .25 of it") == 0.25
    assert extract_number("\u22123.5") == -3.5
    assert extract_exact_number("0.1").denominator == 10  # exact, not the float 0.1
    assert extract_number("no number") is None
    assert final_numeric_match(["q"], ["it is \u22127"], answer=["-7"]) == [1.0]


# ----------------------------------------------------------------------------- math_verify


EXPLOSIVE = [  # every spelling parses to a value far too large to compute exactly
    r"\boxed{10^{10^{10}}}",
    r"The answer is 10**10**10",
    r"\boxed{10^{(10^{10})}}",
    r"\boxed{{10}^{{10}^{{10}}}}",
    r"\boxed{\left(10^{10}\right)^{10^{10}}}",
    r"\boxed{1.5 \cdot 10^{10^{10}}}",
    r"\boxed{1.5\times10^{10^{10}}}",
    r"\boxed{2^{\frac{10^{20}}{2}}}",
    r"\boxed{10^{10000000000}}",
    r"\boxed{10^{10\cdot10^{9}}}",
    r"\boxed{0.1^{-10^{10}}}",
    r"\boxed{\sqrt{10^{10^{10}}}}",
    r"\boxed{10^{10^{10}} - 10^{10^{10}}}",
    r"\boxed{(10^{10})!}",
    r"\boxed{100000000!}",
    r"\boxed{\binom{10^{10}}{10^{5}}}",
    r"\boxed{\sum_{i=1}^{10^{10}} i!}",
    r"\boxed{\prod_{k=1}^{10^{9}} k}",
    r"\boxed{e^{e^{e^{100}}}}",
    r"\boxed{\begin{pmatrix}1&1\\1&0\end{pmatrix}^{10^{10}}}",
]

FINE = [r"2^{100}", r"10^{6}", r"1.5\times10^{3}", r"6.02\times10^{23}", r"\frac{1}{2^{100}}",
        r"2^{2023}-1", r"2^{2^{2^{2^{2}}}}", r"100!", r"\binom{100}{50}", r"\sum_{k=1}^{100} k^2",
        r"e^{2}", r"(x+1)^{10}"]


@pytest.mark.parametrize("text", EXPLOSIVE)
def test_answers_too_large_to_evaluate_are_refused_in_any_spelling(text):
    math_verify = pytest.importorskip("math_verify")
    from gspo.rewards.math import _small_enough

    parsed = math_verify.parse(text, parsing_timeout=None)  # parsing leaves powers unevaluated
    assert any(not isinstance(p, str) for p in parsed)
    assert not _small_enough(parsed)


@pytest.mark.parametrize("text", FINE)
def test_large_but_reasonable_answers_are_still_checked(text):
    math_verify = pytest.importorskip("math_verify")
    from gspo.rewards.math import _small_enough

    parsed = math_verify.parse(f"${text}$", parsing_timeout=None)
    assert any(not isinstance(p, str) for p in parsed) and _small_enough(parsed)


def test_math_verify_still_scores_large_correct_answers():
    pytest.importorskip("math_verify")
    from gspo.rewards.math import math_verify_scores

    completions = [r"\boxed{2^{100}}", r"\boxed{10^{6}}", r"\boxed{1.5\times10^{3}}",
                   r"\boxed{2^{10}}"]
    answers = [str(2**100), "1000000", "1500", "1000"]
    assert math_verify_scores(completions, answers) == [1.0, 1.0, 1.0, 0.0]


# In a subprocess with a time limit, so that a regression hangs that process, not the suite.
END_TO_END = textwrap.dedent(r'''
    import json, logging, time
    logging.disable(logging.WARNING)
    import gspo.rewards.math as gm
    from gspo.rewards import REWARDS, RewardScorer

    out = {}
    scorer = RewardScorer.from_specs(["math_verify"])
    scorer.timeout_s = 5.0  # the issue's reward.timeout_s=5, default thread isolation
    scorer([""], [r"\boxed{1}"], {"answer": ["1"]})  # imports in this process too
    batch = [r"\boxed{10^{10^{10}}}", r"\boxed{10\^{10\^{10}}}", r"$1.5 \cdot 10^{10^{10}}$",
             r"\boxed{10}"]
    start = time.monotonic()
    total, _ = scorer([""] * 4, batch, {"answer": ["10"] * 4})
    out["repro"] = [total, time.monotonic() - start, dict(scorer.first_errors)]

    # a reference too large to evaluate: the row is unscorable
    out["gold"] = REWARDS["math_verify"]([""], [r"\boxed{10^{10^{10}}}"],
                                        answer=["$10^{10^{10}}$"])

    # Gamma(10^8) is computed while *parsing*, before any guard: the helper is killed
    # the row limit must act, not the batch's: a loaded machine is slow to restart the helper
    gm.ROW_TIMEOUT_S, scorer.timeout_s = 1.0, 30.0
    start = time.monotonic()
    total, _ = scorer([""] * 2, [r"\boxed{\Gamma(100000000)}", r"\boxed{10}"],
                      {"answer": ["10"] * 2})
    out["parse_hang"] = [total, time.monotonic() - start, dict(scorer.first_errors)]
    print(json.dumps(out))
''')


def test_no_response_hangs_the_math_verify_reward():
    pytest.importorskip("math_verify")
    run = subprocess.run([sys.executable, "-c", END_TO_END], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    total, seconds, errors = out["repro"]
    assert total == [0.0, 0.0, 0.0, 1.0] and not errors
    assert seconds < 5.0  # within reward.timeout_s=5 (it used to hang for good)
    assert out["gold"] == [None]
    total, seconds, errors = out["parse_hang"]
    assert total == [0.0, 1.0] and not errors  # killed past ROW_TIMEOUT_S; the next is scored
    assert seconds < 30.0
