"""Reward functions: numeric_match, resolving specs, and the defensive RewardScorer."""

from __future__ import annotations

import math
import textwrap

import pytest

from gspo.rewards import (
    REWARDS,
    RewardScorer,
    RewardSpecError,
    numeric_match,
    register_reward,
    resolve_reward,
)

# ----------------------------------------------------------------------------- numeric_match


def nm(completion: str, answer: str) -> float | None:
    (out,) = numeric_match(["p"], [completion], answer=[answer])
    return out


@pytest.mark.parametrize("completion, answer, expected", [
    ("7", "7", 1.0),
    ("The answer is 7.", "7", 1.0),
    ("3 + 4 = 7", "7", 1.0),  # last number wins
    ("7, no wait, 8", "7", 0.0),
    ("8? No: 7", "7", 1.0),
    ("1,234", "1234", 1.0),
    ("It is 1,234,567 exactly", "1234567", 1.0),
    ("-5", "-5", 1.0),
    ("10 - 15 = -5", "-5", 1.0),
    ("5", "-5", 0.0),
    ("3.5", "3.5", 1.0),
    ("3.50", "3.5", 1.0),
    ("7.0", "7", 1.0),
    ("0.1", "0", 0.0),
    ("no number here", "7", 0.0),
    ("", "7", 0.0),
    ("seven", "7", 0.0),
    ("answer: 12\n", "12", 1.0),
    ("x=12x", "12", 1.0),
    # a comma separates thousands only between groups of three digits
    ("The roots are 2,3", "23", 0.0),
    ("The roots are 2,3", "3", 1.0),
    ("at (4,5)", "45", 0.0),
    ("1,234.5", "1234.5", 1.0),
    ("it costs 1,000, not 900", "900", 1.0),
    ("it costs 1,000.", "1000", 1.0),
    # a minus right after a digit is not a sign; LaTeX writes the thousands comma as {,}
    ("pages 3-4", "4", 1.0),
    ("pages 3-4", "-4", 0.0),
    ("5\u22123", "3", 1.0),
    ("x = -4", "-4", 1.0),
    ("\\boxed{1{,}000}", "1000", 1.0),
])
def test_numeric_match(completion, answer, expected):
    assert nm(completion, answer) == expected


@pytest.mark.parametrize("completion, answer, expected", [
    # MATH writes the thousands comma as ,\! (comma, negative thin space); SI style as \,
    ("$\\boxed{10,\\!000}$", "10000", 1.0),
    ("$\\boxed{10,\\!000}$", "0", 0.0),
    ("The answer is 10000.", "10,\\!000", 1.0),
    ("$1,\\!234,\\!567.5$", "1234567.5", 1.0),
    ("$\\tfrac{1,\\!000}{8}$", "125", 1.0),
    ("$10\\,000$", "10000", 1.0),
    ("$2,\\!3$", "3", 1.0),  # not groups of three: two numbers, as "2,3"
    ("$400 \\, \\text{ml}$", "400", 1.0),  # a thin space not between digits is no separator
])
def test_numeric_match_reads_latex_thousands_separators(completion, answer, expected):
    """``10,\\!000`` was read as its last group, 0: the right answer scored 0 and a reference
    written so matched a response of 0."""
    assert nm(completion, answer) == expected


@pytest.mark.parametrize("completion, answer, expected", [
    ("$\\boxed{\\frac12}$", "0.5", 1.0),  # LaTeX's single-digit arguments need no braces
    ("$\\boxed{\\frac12}$", "12", 0.0),
    ("$\\dfrac34$", "3/4", 1.0),
    ("$-\\frac1{2}$", "-0.5", 1.0),
    ("$\\tfrac{1}2$", "1/2", 1.0),
    ("$\\frac 1 2$", "0.5", 1.0),
    ("$\\frac123$", "3", 1.0),  # \frac{1}{2}3: the last number is 3
    ("The answer is 1/2.", "\\frac12", 1.0),
])
def test_numeric_match_reads_fractions_with_unbraced_digits(completion, answer, expected):
    """``\\frac12`` was read as 12 (the right answer 1/2 scored 0, and 12 matched it)."""
    assert nm(completion, answer) == expected


@pytest.mark.parametrize("answer", ["seven", "", "n/a", "abc def"])
def test_numeric_match_non_numeric_reference_is_unscorable(answer):
    assert nm("7", answer) is None


def test_numeric_match_numeric_reference_is_read_as_a_number():
    """A number column's value is compared as the number it is: ``str(0.00001)`` is
    ``1e-05``, 1/100000, not -5 (and ``1e16`` is not 16)."""
    np = pytest.importorskip("numpy")
    refs = [0.00001, 0.00001, 1e16, 1e16, np.float64(2.5e-7), np.int64(7), 0.1, math.inf]
    outs = ["0.00001", "-5", "10000000000000000", "16", "0.00000025", "7", "0.1", "1"]
    assert numeric_match(["p"] * 8, outs, answer=refs) == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0,
                                                           None]


@pytest.mark.parametrize("completion, answer, expected", [
    # a fraction is one number: "3/4" is not 4, in the reference or the response
    ("The answer is 4.", "3/4", 0.0),
    ("The answer is 3/4.", "4", 0.0),
    ("The answer is 3/4.", "3/4", 1.0),
    ("The answer is 0.75.", "3/4", 1.0),
    ("The answer is 3/4.", "0.75", 1.0),
    ("6/8", "3/4", 1.0),
    ("-3/4", "3/4", 0.0),
    ("\u22123/4", "-3/4", 1.0),
    ("$\\frac{3}{4}$", "4", 0.0),
    ("$\\frac{3}{4}$", "0.75", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("\\tfrac{1{,}000}{8}", "125", 1.0),
    ("$-\\frac{3}{4}$", "-0.75", 1.0),
    ("$\\frac{-3}{4}$", "-0.75", 1.0),
    ("$-\\frac{-3}{4}$", "0.75", 1.0),
    ("#### 3/4", "#### 3/4", 1.0),
    ("1 1/2", "3/2", 0.0),  # a mixed number is not read as one
    ("3/0", "0", 0.0),
    # integers and decimals around a slash read as before
    ("3 / 4", "4", 1.0),
    ("3/4.5", "4.5", 1.0),
    ("2.5/5", "5", 1.0),
    ("12/31/2024", "2024", 1.0),
])
def test_numeric_match_reads_a_fraction_as_one_number(completion, answer, expected):
    assert nm(completion, answer) == expected


@pytest.mark.parametrize("completion, answer, expected", [
    ("0.00001", "1e-05", 1.0),
    ("-5", "1e-05", 0.0),
    ("10000000000000000", "1e+16", 1.0),
    ("16", "1e+16", 0.0),
    ("1e-05", "1e-05", 1.0),
    ("The answer is 1.5e3.", "1500", 1.0),
    ("2.5E-7", "0.00000025", 1.0),
])
def test_numeric_match_reads_scientific_notation(completion, answer, expected):
    assert nm(completion, answer) == expected


def test_numeric_match_a_huge_exponent_is_no_number_and_costs_nothing():
    """``Fraction("1e9999999")`` builds 10**9999999 (15 s; a digit more, minutes): a response
    must not stall the reward, so an exponent of more than four digits is no number."""
    import time

    from gspo.rewards.functions import extract_exact_number

    start = time.perf_counter()
    assert nm("1e9999999", "1") == 0.0
    assert nm("1e-9999999", "0") == 0.0
    assert extract_exact_number("1e9999") == 10**9999
    assert time.perf_counter() - start < 2.0


def test_numeric_match_float_column_reference_arrives_as_text_and_is_read_as_a_number():
    """A float answer column reaches the rewards as ``str(value)`` (``Example.answer`` is text):
    ``1e-05`` must be 1/100000 there too, not its last number -5."""
    from gspo.data.hf import records_to_examples

    rows = [{"prompt": "a", "answer": 0.00001}, {"prompt": "b", "answer": 2.5e-7}]
    answers = [ex.answer for ex in records_to_examples(rows)]
    assert answers == ["1e-05", "2.5e-07"]
    assert numeric_match(["a", "b"], ["0.00001", "0.00000025"], answer=answers) == [1.0, 1.0]
    assert numeric_match(["a", "b"], ["-5", "-7"], answer=answers) == [0.0, 0.0]


def test_numeric_match_batch_and_columns():
    out = numeric_match(["a", "b", "c"], ["1", "2", "x"], answer=["1", "3", "4"], level=[1, 2, 3])
    assert out == [1.0, 0.0, 0.0]
    assert all(isinstance(v, float) for v in out)


def test_numeric_match_is_registered():
    assert REWARDS["numeric_match"] is numeric_match


# ----------------------------------------------------------------------------- resolve_reward


def test_resolve_by_name():
    assert resolve_reward("numeric_match") is numeric_match


def test_resolve_callable():
    def mine(prompts, completions, **_):
        return [0.0] * len(completions)

    assert resolve_reward(mine) is mine
    assert resolve_reward(len) is len


def test_resolve_module_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(textwrap.dedent("""
        def length_reward(prompts, completions, **_):
            return [float(len(c)) for c in completions]

        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = resolve_reward("my_rewards_mod:length_reward")
    assert fn(["p"], ["abc"]) == [3.0]
    with pytest.raises(RewardSpecError, match="not callable"):
        resolve_reward("my_rewards_mod:NOT_CALLABLE")
    with pytest.raises(RewardSpecError, match="my_rewards_mod:missing"):
        resolve_reward("my_rewards_mod:missing")


def test_register_reward_rejects_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("numeric_match")(lambda p, c, **_: [])


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and len(msg.splitlines()) == 1, msg
    return msg


@pytest.mark.parametrize("spec, needle", [
    ("nope", "unknown reward 'nope'"),
    ("no_such_module_xyz:f", "no_such_module_xyz"),
    ("json:no_such_attr", "json:no_such_attr"),
    (":f", "':f'"),
    ("..rel:f", "..rel:f"),
    ("json:", "json:"),
])
def test_resolve_errors(spec, needle):
    with pytest.raises(RewardSpecError) as e:
        resolve_reward(spec)
    assert needle in _one_line(e)


def test_unknown_name_lists_choices():
    with pytest.raises(RewardSpecError, match="numeric_match") as e:
        resolve_reward("numeric_matc")
    assert "module:function" in _one_line(e)


def test_resolve_module_broken_at_import(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards_mod.py").write_text("raise RuntimeError('boom\\nsecond line')\n")
    (tmp_path / "bad_syntax_rewards_mod.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardSpecError, match="boom") as e:
        resolve_reward("broken_rewards_mod:f")
    _one_line(e)
    with pytest.raises(RewardSpecError, match="bad_syntax_rewards_mod") as e:
        resolve_reward("bad_syntax_rewards_mod:f")
    _one_line(e)


# ----------------------------------------------------------------------------- RewardScorer


def const(value):
    def fn(prompts, completions, **_):
        return [value] * len(completions)

    fn.__name__ = f"const_{value!r}"
    return fn


def nan_at(values: list[float]) -> list[bool]:
    return [math.isnan(v) for v in values]


PROMPTS, COMPLETIONS = ["p1", "p2", "p3"], ["7", "8", "x"]
COLUMNS = {"answer": ["7", "9", "1"]}


def test_scorer_weighted_sum():
    scorer = RewardScorer.from_specs(["numeric_match", const(0.5)], [2.0, -1.0])
    total, per_fn = scorer(PROMPTS, COMPLETIONS, COLUMNS)
    assert per_fn["numeric_match"] == [1.0, 0.0, 0.0]
    assert per_fn["const_0.5"] == [0.5, 0.5, 0.5]
    assert total == pytest.approx([1.5, -0.5, -0.5])
    assert scorer.failures == {} and scorer.first_errors == {}


def test_two_rewards_with_one_name_are_each_weighted_once():
    # Two lambdas (or partials of one function) share a __name__: each keeps its own values
    # and weight (the second used to overwrite the first: 10 + 10 instead of 1 + 10, and a
    # logged weight-0 function was trained on).
    import functools

    def scaled(prompts, completions, scale, **_):
        return [scale] * len(completions)

    scorer = RewardScorer.from_specs([lambda p, c, **_: [1.0] * len(c),
                                      lambda p, c, **_: [10.0] * len(c)])
    total, per_fn = scorer(["p"], ["c"], {})
    assert scorer.names == ["<lambda>", "<lambda>_2"] and total == [11.0]
    assert per_fn == {"<lambda>": [1.0], "<lambda>_2": [10.0]}
    scorer = RewardScorer.from_specs([functools.partial(scaled, scale=1.0),
                                      functools.partial(scaled, scale=3.0)], [1.0, 0.0])
    assert scorer(["p"], ["c"], {})[0] == [1.0]
    scorer = RewardScorer.from_specs(["numeric_match"] * 3, [1.0, 2.0, 4.0])
    assert scorer.names == ["numeric_match", "numeric_match_2", "numeric_match_3"]
    assert scorer(["p"], ["7"], {"answer": ["7"]})[0] == [7.0]


def test_scorer_default_weights_and_columns_passed():
    seen = {}

    def spy(prompts, completions, **columns):
        seen.update(columns, prompts=prompts)
        return [1] * len(completions)  # ints are fine

    scorer = RewardScorer.from_specs([spy, "numeric_match"])
    assert scorer.weights == [1.0, 1.0]
    assert scorer.names == ["spy", "numeric_match"]
    total, _ = scorer(PROMPTS, COMPLETIONS, {**COLUMNS, "level": [1, 2, 3]})
    assert total == [2.0, 1.0, 1.0]
    assert seen == {"answer": ["7", "9", "1"], "level": [1, 2, 3], "prompts": PROMPTS}


def test_scorer_exception_gives_nan_and_keeps_first_traceback():
    calls = []

    def boom(prompts, completions, **_):
        calls.append(len(calls))
        raise ZeroDivisionError(f"call {len(calls)}")

    scorer = RewardScorer.from_specs(["numeric_match", boom])
    total, per_fn = scorer(PROMPTS, COMPLETIONS, COLUMNS)
    assert all(nan_at(total))
    assert all(nan_at(per_fn["boom"]))
    assert per_fn["numeric_match"] == [1.0, 0.0, 0.0]  # other functions still scored
    assert "ZeroDivisionError: call 1" in scorer.first_errors["boom"]
    assert "Traceback" in scorer.first_errors["boom"]
    scorer(PROMPTS, COMPLETIONS, COLUMNS)
    assert "call 1" in scorer.first_errors["boom"]  # the first one is kept
    assert scorer.failures["boom"] == 6
    assert "numeric_match" not in scorer.failures


@pytest.mark.parametrize("returned", [[1.0], [1.0] * 4, [], None, 3.0, "abc"])
def test_scorer_wrong_length_or_type_is_nan(returned):
    def bad(prompts, completions, **_):
        return returned

    scorer = RewardScorer.from_specs([bad, const(1.0)])
    total, per_fn = scorer(PROMPTS, COMPLETIONS, COLUMNS)
    assert all(nan_at(total)) and all(nan_at(per_fn["bad"]))
    assert per_fn["const_1.0"] == [1.0, 1.0, 1.0]
    assert "bad" in scorer.first_errors and scorer.failures["bad"] == 3


def test_scorer_bad_values_are_nan_per_response():
    def mixed(prompts, completions, **_):
        return [None, math.inf, "0.5"]

    def mixed2(prompts, completions, **_):
        return [1 + 2j, -math.inf, math.nan]

    scorer = RewardScorer.from_specs([mixed, mixed2, const(2.0)])
    total, per_fn = scorer(PROMPTS, COMPLETIONS, COLUMNS)
    assert all(nan_at(per_fn["mixed"])) and all(nan_at(per_fn["mixed2"]))
    assert all(nan_at(total))
    assert per_fn["const_2.0"] == [2.0, 2.0, 2.0]
    # None is a legitimate "cannot score"; the others are reported.
    assert scorer.failures["mixed"] == 2
    assert scorer.failures["mixed2"] == 3
    assert "inf" in scorer.first_errors["mixed"]


def test_scorer_one_bad_row_does_not_spoil_others():
    def partial(prompts, completions, **_):
        return [1.0, None, 0.25]

    total, _ = RewardScorer.from_specs([partial, "numeric_match"])(PROMPTS, COMPLETIONS, COLUMNS)
    assert total[0] == 2.0 and math.isnan(total[1]) and total[2] == 0.25


def test_scorer_accepts_numpy_and_generators():
    np = pytest.importorskip("numpy")

    def numpy_fn(prompts, completions, **_):
        return np.array([1.0, 0.0, 0.5], dtype=np.float32)

    def gen_fn(prompts, completions, **_):
        return (np.int64(i) for i in range(len(completions)))

    total, per_fn = RewardScorer.from_specs([numpy_fn, gen_fn])(PROMPTS, COMPLETIONS, COLUMNS)
    assert per_fn["numpy_fn"] == [1.0, 0.0, 0.5]
    assert per_fn["gen_fn"] == [0.0, 1.0, 2.0]
    assert total == [1.0, 1.0, 2.5]


def test_scorer_scores_bools_and_zero_dimensional_tensors():
    """A bool is 1.0 or 0.0, as in TRL (Python, numpy and torch bools alike), and a function may
    return a tensor of one value per response; None and NaN stay unscorable."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")

    def bools(prompts, completions, **_):
        return [True, False, np.bool_(True), np.bool_(False), torch.tensor(True),
                torch.tensor(False), None, math.nan]

    def tensor(prompts, completions, **_):
        return torch.tensor([0.5] * len(completions), dtype=torch.bfloat16)

    n = 8
    scorer = RewardScorer.from_specs([bools, tensor])
    total, per_fn = scorer(["p"] * n, ["c"] * n, {})
    assert per_fn["bools"][:6] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert all(type(v) is float for v in per_fn["bools"])
    assert nan_at(per_fn["bools"]) == [False] * 6 + [True, True]
    assert per_fn["tensor"] == [0.5] * n
    assert total[:6] == [1.5, 0.5, 1.5, 0.5, 1.5, 0.5] and nan_at(total)[6:] == [True, True]
    assert scorer.failures == {"bools": 1}  # the NaN; None is a legitimate "cannot score"


def test_scorer_huge_int_is_nan_not_crash():
    total, _ = RewardScorer.from_specs([const(10**400)])(PROMPTS, COMPLETIONS, COLUMNS)
    assert all(nan_at(total))


def test_scorer_needs_one_name_and_one_weight_per_function():
    """Fewer weights (or names) than functions left the extra functions out of the total:
    computed and logged, never trained on. Two functions of one name shared one entry."""
    with pytest.raises(ValueError, match="2 reward functions, 2 names and 1 weights"):
        RewardScorer.from_specs([const(1.0), const(10.0)], [1.0])
    with pytest.raises(ValueError, match="1 reward functions, 1 names and 2 weights"):
        RewardScorer.from_specs([const(1.0)], [1.0, 5.0])
    with pytest.raises(ValueError, match="2 reward functions, 1 names and 2 weights"):
        RewardScorer([const(1.0), const(10.0)], ["a"], [1.0, 1.0])
    with pytest.raises(ValueError, match="names must be distinct"):
        RewardScorer([const(1.0), const(10.0)], ["r", "r"], [1.0, 1.0])
    for weight in (math.nan, math.inf):  # NaN: every total NaN, reported as "returned None"
        with pytest.raises(ValueError, match="weights must be finite"):
            RewardScorer.from_specs(["numeric_match"], [weight])
    total, _ = RewardScorer.from_specs([const(1.0), const(10.0)], [1.0, 0.5])(
        PROMPTS, COMPLETIONS, COLUMNS)
    assert total == [6.0] * 3


def test_scorer_from_specs_unknown_raises():
    with pytest.raises(RewardSpecError):
        RewardScorer.from_specs(["numeric_match", "not_a_reward"])


def test_a_function_of_weight_zero_is_logged_but_leaves_the_total_alone():
    def partial(prompts, completions, **_):
        return [None if c == "x" else 0.25 for c in completions]

    scorer = RewardScorer.from_specs(["numeric_match", partial], [1.0, 0.0])
    total, per_fn = scorer(PROMPTS, COMPLETIONS, COLUMNS)
    assert total == [1.0, 0.0, 0.0]  # "x" scored by numeric_match alone
    assert per_fn["partial"][:2] == [0.25, 0.25] and nan_at(per_fn["partial"])[2]
    weighted = RewardScorer.from_specs(["numeric_match", partial], [1.0, 0.5])
    assert nan_at(weighted(PROMPTS, COMPLETIONS, COLUMNS)[0]) == [False, False, True]


def test_a_function_of_weight_zero_failing_everywhere_is_not_every_response_unscorable():
    """The trainer stops before training when ``failed_on_all`` names a function ("every
    held-out response was unscorable"); a logged-only function (weight 0) that raises on every
    response leaves every total finite, so it must not be named."""
    def diagnostic(prompts, completions, judge_score, **_):  # a column this task lacks
        return [0.0] * len(completions)

    scorer = RewardScorer.from_specs(["numeric_match", diagnostic], [1.0, 0.0])
    total, _ = scorer(PROMPTS, COMPLETIONS, COLUMNS)
    assert not any(nan_at(total)) and scorer.failures["diagnostic"] == len(COMPLETIONS)
    assert scorer.failed_on_all({}, len(COMPLETIONS)) is None
    weighted = RewardScorer.from_specs(["numeric_match", diagnostic], [1.0, 0.5])
    weighted(PROMPTS, COMPLETIONS, COLUMNS)
    assert weighted.failed_on_all({}, len(COMPLETIONS)).startswith("diagnostic: TypeError")


def test_eval_accuracy_full_marks_leave_out_penalties():
    """A penalty (a function of negative weight) at its best adds 0, not its weight: with
    weights [1, -1], full marks were a total of 0, so every wrong, unpenalised response was
    "accurate"."""
    from gspo.data.base import Example
    from gspo.models.tiny import build_tiny
    from gspo.trainer.evaluate import evaluate

    model, tok = build_tiny("llama")
    right = {"2+2?": 1.0, "3+3?": 1.0, "4+4?": 0.0, "5+5?": 0.0}
    penalised = {"2+2?": 0.0, "3+3?": 1.0, "4+4?": 0.0, "5+5?": 1.0}

    def correct(prompts, completions, **_):
        return [right[p] for p in prompts]

    def rambling(prompts, completions, **_):
        return [penalised[p] for p in prompts]

    scorer = RewardScorer.from_specs([correct, rambling], [1.0, -1.0])
    out = evaluate(model, tok, [Example(p, "", {}) for p in right], scorer,
                   chat_template=False, system_prompt="", max_new_tokens=2,
                   eos=[tok.eos_token_id], pad_id=tok.pad_token_id or 0)
    assert out["accuracy"] == 0.25  # right and not penalised: 2+2 only
    assert out["reward_mean"] == 0.0
