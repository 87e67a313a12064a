"""Math rewards (math-verify, \\boxed{} format, Countdown) and DAPO's overlong punishment."""

from __future__ import annotations

import pytest

from gspo.rewards import REWARDS, RewardScorer
from gspo.rewards.math import countdown_score, evaluate_expression, last_boxed
from gspo.rewards.shaping import add_overlong, overlong_reward, soft_overlong_penalty


def test_math_verify_matches_equivalent_forms():
    pytest.importorskip("math_verify")
    fn = REWARDS["math_verify"]
    completions = ["So the answer is \\boxed{3/4}.", "It is 0.75", "\\boxed{\\frac{3}{4}}",
                   "\\boxed{0.7}", "no idea", "Total: \\boxed{72}", "\\boxed{72}"]
    answers = ["0.75", "3/4", "0.75", "0.75", "0.75", "Natalia sold 48+24 = 72 clips.\n#### 72",
               "$\\}{"]
    assert fn([""] * 7, completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, None]


@pytest.mark.parametrize("answer, right, wrong", [
    # MATH-style references are bare LaTeX: read them as such (inside \\boxed{}, as verl does)
    ("3\\sqrt{13}", "\\boxed{3\\sqrt{13}}", "\\boxed{3}"),
    ("[1, 3]", "\\boxed{[1,3]}", "\\boxed{3}"),
    ("2, 3", "\\boxed{2, 3}", "\\boxed{3}"),
    ("\\sqrt{2}", "\\boxed{\\sqrt{2}}", "\\boxed{2}"),
    ("x^2+1", "\\boxed{x^2+1}", "\\boxed{x^2}"),
    ("\\frac{\\pi}{2}", "\\boxed{\\frac{\\pi}{2}}", "\\boxed{\\pi}"),
    ("\\dfrac{1}{2}", "The answer is \\boxed{0.5}", "\\boxed{2}"),
    ("\\$18.90", "\\boxed{18.90}", "\\boxed{18}"),
    # what was read right before still is: numbers, prose with units, $...$, \\boxed{}
    ("1,000", "\\boxed{1000}", "\\boxed{1}"),
    ("-5", "so x = -5", "\\boxed{5}"),
    ("18 dollars", "\\boxed{18}", "\\boxed{8}"),
    ("The answer is $5$ apples", "\\boxed{5}", "\\boxed{4}"),
    ("\\boxed{7}", "\\boxed{7}", "\\boxed{1}"),
])
def test_math_verify_reads_a_bare_latex_reference(answer, right, wrong):
    pytest.importorskip("math_verify")
    from gspo.rewards.math import math_verify_scores

    assert math_verify_scores([right, wrong], [answer, answer]) == [1.0, 0.0]


def test_math_verify_reads_a_numeric_reference_as_that_number():
    """A number column's value: ``str(0.00001)`` is ``1e-05``, which math-verify reads as
    e - 5 (so ``\\boxed{e-5}`` matched and the right answer did not)."""
    pytest.importorskip("math_verify")
    np = pytest.importorskip("numpy")
    from gspo.rewards.math import math_verify_scores

    refs = [0.00001, 0.00001, 1e16, np.float64(2.5), 7]
    outs = ["\\boxed{0.00001}", "\\boxed{e-5}", "\\boxed{10000000000000000}", "\\boxed{5/2}",
            "\\boxed{7}"]
    assert math_verify_scores(outs, refs) == [1.0, 0.0, 1.0, 1.0, 1.0]


def test_boxed_format_and_last_boxed():
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{2} and \\boxed{3") == "2"  # unclosed last one: the one before
    assert last_boxed("nothing") is None
    out = REWARDS["boxed_format"](["p"] * 4, ["\\boxed{5}", "\\boxed{}", "\\boxed{5", "5"])
    assert out == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(("text", "expected"), [
    ("3*7+12", (33, [3, 7, 12])),
    ("(25 - 5) / 4", (5, [25, 5, 4])),
    ("7/2*2", (7, [7, 2, 2])),  # exact fractions: no float rounding
    ("-3+10", None),  # unary minus is not one of the allowed operations
    ("2**10", None),
    ("__import__('os').getcwd()", None),
    ("1.5*2", None),
    ("4/(2-2)", None),
    ("x+1", None),
    ("3 +", None),
    ("1+" * 150 + "1", None),  # over the length cap: not parsed
])
def test_countdown_expressions_are_parsed_never_evaluated(text, expected):
    got = evaluate_expression(text)
    assert (got if got is None else (got[0], got[1])) == expected


def test_countdown_score_rules():
    nums, target = [3, 7, 12, 5], 33
    assert countdown_score("3*7+12", nums, target) == 1.0
    assert countdown_score("Let me think.\n3*7 + 12 = 33.", nums, target) == 1.0
    assert countdown_score("<answer>(12 + 3*7)</answer> done", nums, target) == 1.0
    assert countdown_score("\\boxed{7*3+12}", nums, target) == 1.0
    assert countdown_score("33", nums, target) == 0.0  # 33 is not a given number
    assert countdown_score("3*7+12+5-5", nums, target) == 0.0  # 5 used twice
    assert countdown_score("3*7+7+5", nums, target) == 0.0  # 7 used twice
    assert countdown_score("3*7+12", nums, 34) == 0.0
    assert countdown_score("3*3", [3, 3], 9) == 1.0  # a number given twice may be used twice
    out = REWARDS["countdown"](["p"] * 2, ["3*7+12", "3+7"], numbers=[nums, nums],
                               target=[target, target])
    assert out == [1.0, 0.0]


def test_soft_overlong_penalty_by_hand():
    # L_max = 20, L_cache = 4: free up to 16 tokens, then -1/4 per token, -1 past 20.
    got = [soft_overlong_penalty(n, max_tokens=20, buffer_tokens=4) for n in (0, 16, 17, 18, 20,
                                                                               21)]
    assert got == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]


def test_overlong_reward_counts_tokens():
    fn = overlong_reward(max_tokens=8, buffer_tokens=4)
    assert fn(["p"] * 3, ["a", "b", "c"], response_tokens=[4, 6, 8]) == [1.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="no response_tokens"):
        fn(["p"], ["abc"])

    class Tok:  # one token per character
        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [list(t) for t in texts]}

    scorer = add_overlong(RewardScorer.from_specs(["numeric_match"]), max_tokens=8,
                          buffer_tokens=4, tokenizer=Tok())
    total, per_fn = scorer(["p", "p"], ["7", "7" * 6], {"answer": ["7", "7"]})
    assert per_fn["overlong"] == [1.0, 0.5]
    assert total == [2.0, 0.5]  # "777777" is a wrong answer and 6 of 8 tokens long
    assert scorer.weights == [1.0, 1.0] and scorer.names == ["numeric_match", "overlong"]
    with pytest.raises(ValueError):
        overlong_reward(max_tokens=8, buffer_tokens=0)


def test_a_reward_named_overlong_is_refused_by_add_overlong():
    # it shared the term's name: the total counted the term twice and the function not at
    # all, and evaluation (without_overlong) dropped the function
    def overlong(prompts, completions, **_):
        return [5.0] * len(completions)

    with pytest.raises(ValueError, match="named 'overlong'"):
        add_overlong(RewardScorer.from_specs([overlong]), max_tokens=10, buffer_tokens=4)
