"""Reward columns keep their names (TRL's convention) and a reward that cannot score anything
stops the run before training (issue 18, item 1)."""

from __future__ import annotations

import json
import sys

import pytest

from gspo.config import load_config
from gspo.data import DataError
from gspo.data.datasets import load_jsonl
from gspo.data.hf import records_to_examples
from gspo.rewards import RewardError, RewardScorer
from gspo.trainer import Trainer

ROWS = [{"prompt": f"Which is larger, {a} or {b}?", "larger": max(a, b), "a": a}
        for a, b in zip(range(10), range(5, 15))]


def score(prompts, completions, larger, **kw):
    """A TRL-style reward: the reference column arrives under its own name."""
    assert kw["answer"] == [str(v) for v in larger]  # the alias the built-in rewards read
    assert isinstance(larger[0], int)  # its own value, not the string form
    return [float(str(v) in c) for c, v in zip(completions, larger)]


def _jsonl(tmp_path, rows):
    path = tmp_path / "larger.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_and_records_pass_every_column_under_its_own_name(tmp_path):
    for rows in (load_jsonl(str(_jsonl(tmp_path, ROWS)), answer_field="larger"),
                 records_to_examples(ROWS, answer_field="larger")):
        assert rows[3].answer == "8"
        assert rows[3].columns == {"larger": 8, "a": 3}


def test_a_column_only_some_rows_have_is_none_in_the_others(tmp_path):
    # A batch's columns are its first row's: without the column filled in, a batch starting
    # with a row that lacks it gave the rewards no such column for any of its rows.
    rows = [{"prompt": f"p{i}", "answer": i, **({"hint": f"h{i}"} if i % 2 else {})}
            for i in range(4)]
    for examples in (load_jsonl(str(_jsonl(tmp_path, rows))), records_to_examples(rows)):
        assert [ex.columns for ex in examples] == [{"hint": None}, {"hint": "h1"},
                                                   {"hint": None}, {"hint": "h3"}]


def test_the_default_answer_column_is_not_duplicated():
    rows = records_to_examples([{"prompt": "p", "answer": 4, "tests": ["t"]}])
    assert rows[0].answer == "4" and rows[0].columns == {"tests": ["t"]}


@pytest.mark.parametrize("row, match", [
    ({"prompt": "p", "larger": 1, "answer": 2}, "named 'answer' but task.answer_field='larger'"),
    ({"prompt": "p", "larger": 1, "completions": 2}, "'completions' collides"),
])
def test_ambiguous_columns_are_one_line_errors(tmp_path, row, match):
    with pytest.raises(DataError, match=match):
        records_to_examples([row], answer_field="larger")
    with pytest.raises(DataError, match=match):
        load_jsonl(str(_jsonl(tmp_path, [row])), answer_field="larger")


def _cfg(tmp_path, name, *extra):
    return load_config(None, [
        "model=tiny:llama", f"output_dir={tmp_path}", f"run_name={name}", "progress=false",
        "num_threads=1", "rollout.max_new_tokens=3", "rollout.eval_max_new_tokens=3",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "task.name=jsonl",
        f"task.path={_jsonl(tmp_path, ROWS)}", "task.answer_field=larger", "task.eval_size=2",
        *extra])


def test_a_trl_style_reward_trains_on_a_named_column(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    cfg = _cfg(tmp_path, "ok", "steps=1", "reward.functions=[numeric_match]")
    trainer = Trainer(cfg, reward_fns=[score, "numeric_match"]).setup()
    try:
        result = trainer.train()
    finally:
        trainer.cleanup()
    assert result["steps"] == 1 and trainer.scorer.failures.get("score", 0) == 0
    assert "not installed" not in capsys.readouterr().out  # quiet defaults (item 7)


def test_a_reward_failing_on_every_baseline_response_stops_before_training(tmp_path):
    def needs_smaller(prompts, completions, smaller, **kw):  # no such column
        return [0.0] * len(completions)

    trainer = Trainer(_cfg(tmp_path, "broken", "steps=3"), reward_fns=[needs_smaller]).setup()
    try:
        with pytest.raises(RewardError) as err:
            trainer.train()
    finally:
        trainer.cleanup()
    msg = str(err.value)
    assert "\n" not in msg and trainer.step == 0
    assert "before training" in msg and "missing 1 required positional argument: 'smaller'" in msg


def test_failed_on_all_ignores_partial_failures():
    def half(prompts, completions, **_):
        return [None if i % 2 else 1.0 for i in range(len(completions))]

    def boom(prompts, completions, **_):
        raise ValueError("boom")

    scorer = RewardScorer([half, boom], ["half", "boom"], [1.0, 1.0])
    assert scorer.failed_on_all({}, 0) is None
    scorer(["p"] * 4, ["c"] * 4, {})
    assert scorer.failed_on_all({}, 4) == "boom: ValueError: boom"
    assert scorer.failed_on_all(dict(scorer.failures), 4) is None
