"""The held-out split is by problem (a prompt the source repeats is never both trained on and
evaluated), and a missing or null prompt/answer is an error, never the string 'None'."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from gspo.config import TaskConfig
from gspo.data import DataError, DatasetTask, Example, build_task
from gspo.data.base import hold_out
from gspo.data.builtin import GSM8K_MINI
from gspo.data.datasets import load_jsonl
from gspo.data.hf import task_from_records

SOURCES = ["jsonl", "dataset", "records"]


def repeated(n: int = 20, copies: int = 3, prefix: str = "q") -> list[dict[str, Any]]:
    """``n`` prompts, each ``copies`` times (as many datasets have: several samples per problem)."""
    return [{"prompt": f"{prefix}{i}", "answer": str(i), "copy": c}
            for c in range(copies) for i in range(n)]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def task_for(source: str, tmp_path: Path, records: list[dict[str, Any]], seed: int = 0,
             **kw: Any) -> DatasetTask:
    if source == "records":
        return task_from_records(records, None, TaskConfig(**kw), seed)
    path = write_jsonl(tmp_path / "train.jsonl", records)
    task = build_task(TaskConfig(name=source, path=path, **kw), seed)
    assert isinstance(task, DatasetTask)
    return task


def prompts(examples: list[Example]) -> set[str]:
    return {ex.prompt for ex in examples}


# ------------------------------------------------------------------ held out by problem


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize(("eval_size", "problems"), [(3, 3), (8, 4)])  # 4: a fifth of 20
def test_a_repeated_prompt_is_held_out_with_all_its_rows(tmp_path, source, eval_size, problems):
    task = task_for(source, tmp_path, repeated(), eval_size=eval_size)
    held = prompts(task.eval_examples)
    assert len(held) == problems  # eval_size counts problems, capped at a fifth of them
    assert len(task.eval_examples) == 3 * problems  # every copy of a held-out prompt
    assert not held & prompts(task.rows)
    assert not held & prompts(task.sample(300))  # five epochs of training draws
    # nothing dropped: every row is on exactly one side
    key = lambda ex: (ex.prompt, ex.columns["copy"])  # noqa: E731
    assert sorted(map(key, task.rows + task.eval_examples)) == sorted(
        (r["prompt"], r["copy"]) for r in repeated())


@pytest.mark.parametrize("source", SOURCES)
def test_split_by_problem_is_seeded_and_resumes(tmp_path, source):
    task = task_for(source, tmp_path, repeated(), seed=7, eval_size=3)
    again = task_for(source, tmp_path, repeated(), seed=7, eval_size=3)
    assert again.eval_examples == task.eval_examples and again.rows == task.rows
    assert not prompts(task.eval_examples) & prompts(task.rows)
    task.sample(50)  # into the second epoch
    state = json.loads(json.dumps(task.state_dict()))
    rest = task.sample(40)
    resumed = task_for(source, tmp_path, repeated(), seed=7, eval_size=3)
    resumed.load_state_dict(state)
    assert resumed.sample(40) == rest


def test_distinct_prompts_keep_the_row_split():
    """With no repeated prompt the split is the seeded row split it always was (gsm8k_mini's
    included); with repeats it is not a row split."""
    def row_split(rows: list[Example], eval_size: int, seed: int) -> tuple[list, list]:
        order = list(range(len(rows)))
        random.Random(f"split-{seed}").shuffle(order)
        n = min(eval_size, len(rows) // 5)
        return [rows[i] for i in order[n:]], [rows[i] for i in order[:n]]

    gsm8k = load_jsonl(str(GSM8K_MINI))
    for seed in range(5):
        for eval_size in (0, 3, 100):
            assert hold_out(gsm8k, eval_size, seed) == row_split(gsm8k, eval_size, seed)
    rows = [Example(r["prompt"], r["answer"], {"copy": r["copy"]}) for r in repeated()]
    train, held = hold_out(rows, 8, 0)
    assert not prompts(train) & prompts(held)


# ------------------------------------------------------- a separate held-out set


def separate(source: str, tmp_path: Path, train: list[dict[str, Any]],
             held: list[dict[str, Any]]) -> DatasetTask:
    if source == "records":
        return task_from_records(train, held, TaskConfig(), 0)
    if source == "jsonl":
        cfg = TaskConfig(name="jsonl", path=write_jsonl(tmp_path / "train.jsonl", train),
                         eval_path=write_jsonl(tmp_path / "test.jsonl", held))
    else:
        write_jsonl(tmp_path / "train.jsonl", train)
        write_jsonl(tmp_path / "test.jsonl", held)
        cfg = TaskConfig(name="dataset", path=str(tmp_path), eval_split="test")
    task = build_task(cfg, 0)
    assert isinstance(task, DatasetTask)
    return task


@pytest.mark.parametrize("source", SOURCES)
def test_prompts_of_a_separate_held_out_set_are_left_out_of_training(tmp_path, capsys, source):
    train = repeated(10)  # q0..q9, 3 copies each
    held = [{"prompt": p, "answer": "x", "copy": 0} for p in ("q1", "q2", "e0")]
    task = separate(source, tmp_path, train, held)
    assert prompts(task.eval_examples) == {"q1", "q2", "e0"}
    assert len(task.rows) == 24  # 30 rows less the 6 copies of q1 and q2
    assert not {"q1", "q2"} & prompts(task.sample(100))
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "left out 6 of 30 training rows" in out[0], out
    assert "held-out set" in out[0]


@pytest.mark.parametrize("source", SOURCES)
def test_a_separate_held_out_set_that_covers_training_is_an_error(tmp_path, source):
    train = repeated(2)
    held = [{"prompt": p, "answer": "x", "copy": 0} for p in ("q0", "q1")]
    with pytest.raises(DataError, match="nothing is left to train on"):
        separate(source, tmp_path, train, held)


# ----------------------------------------------------- missing or null columns


def build(tmp_path: Path, name: str, text: str, suffix: str = ".jsonl", **kw: Any) -> DatasetTask:
    p = tmp_path / f"d{suffix}"
    p.write_text(text)
    task = build_task(TaskConfig(name=name, path=str(p), eval_size=0, **kw), 0)
    assert isinstance(task, DatasetTask)
    return task


@pytest.mark.parametrize(("name", "text", "kw", "error"), [
    ("dataset", '{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n', {},
     r"d\.jsonl \[train\]: row 1: column 'answer' is empty"),
    ("dataset", '{"prompt": "a", "solution": "1"}\n{"prompt": "b", "solution": null}\n',
     {"answer_field": "solution"}, r"d\.jsonl \[train\]: row 1: column 'solution' is empty"),
    ("jsonl", '{"prompt": "a", "solution": "1"}\n{"prompt": "b", "solution": null}\n',
     {"answer_field": "solution"}, r"d\.jsonl:2: column 'solution' is empty"),
    ("dataset", '{"prompt": "a", "answer": "1"}\n{"prompt": null, "answer": "2"}\n', {},
     r"d\.jsonl \[train\]: row 1: column 'prompt' is empty"),
    ("jsonl", '{"prompt": "a", "answer": "1"}\n{"prompt": null, "answer": "2"}\n', {},
     r"d\.jsonl:2: column 'prompt' is empty"),
])
def test_a_missing_or_null_column_is_an_error(tmp_path, name, text, kw, error):
    with pytest.raises(DataError, match=error):
        build(tmp_path, name, text, **kw)


def test_an_empty_csv_cell_is_an_error(tmp_path):
    with pytest.raises(DataError, match=r"d\.csv \[train\]: row 1: column 'answer' is empty"):
        build(tmp_path, "dataset", "prompt,answer\na,4\nb,\nc,5\n", ".csv")
    with pytest.raises(DataError, match=r"d\.csv \[train\]: row 0: column 'prompt' is empty"):
        build(tmp_path, "dataset", "prompt,answer\n,4\nb,6\n", ".csv")


@pytest.mark.parametrize("answer", [None, float("nan")])
def test_a_null_answer_in_records_is_an_error(answer):
    import datasets

    records = [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": answer}]
    for train in (records, datasets.Dataset.from_list(records)):
        with pytest.raises(DataError, match=r"train_dataset: row 1: column 'answer' is empty"):
            task_from_records(train, None, TaskConfig(eval_size=0), 0)
    with pytest.raises(DataError, match=r"eval_dataset: row 1: column 'answer' is empty"):
        task_from_records([{"prompt": "c", "answer": "3"}], records, TaskConfig(), 0)


@pytest.mark.parametrize(("suffix", "text"), [
    (".csv", "prompt,answer\na,4\nb,2.5\n"),  # pandas reads the column as float
    (".jsonl", '{"prompt": "a", "answer": 4}\n{"prompt": "b", "answer": 2.5}\n'),  # arrow too
])
def test_an_integer_answer_in_a_float_column_keeps_its_spelling(tmp_path, suffix, text):
    task = build(tmp_path, "dataset", text, suffix)
    assert {ex.prompt: ex.answer for ex in task.rows} == {"a": "4", "b": "2.5"}



def held_out_of(source: str, tmp_path: Path, rows: list[dict[str, Any]],
                eval_size: int) -> DatasetTask:
    """The task holding ``eval_size`` problems of ``rows`` out (no separate held-out set)."""
    if source == "records":
        return task_from_records(rows, None, TaskConfig(eval_size=eval_size), 0)
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = (TaskConfig(name="jsonl", path=path, eval_size=eval_size) if source == "jsonl" else
           TaskConfig(name="dataset", path=str(tmp_path), eval_size=eval_size))
    task = build_task(cfg, 0)
    assert isinstance(task, DatasetTask)
    return task


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("separate_set", [False, True])
def test_a_row_repeated_exactly_is_evaluated_once(tmp_path, capsys, source, separate_set):
    """Held-out accuracy counts a problem once however often the source repeats its row; rows
    that differ in any column stay apart."""
    exact = [{"prompt": f"q{i}", "answer": str(i), "copy": 0} for i in range(20) for _ in range(3)]
    held = [{"prompt": "e0", "answer": "0", "copy": 0}] * 2 + [
        {"prompt": "e0", "answer": "0", "copy": 1}, {"prompt": "e1", "answer": "1", "copy": 0}]
    task = (separate(source, tmp_path, exact, held) if separate_set
            else held_out_of(source, tmp_path, exact, 4))
    evaluated = [(ex.prompt, ex.answer, ex.columns.get("copy")) for ex in task.eval_examples]
    if separate_set:
        assert evaluated == [("e0", "0", 0), ("e0", "0", 1), ("e1", "1", 0)]
    else:  # 4 problems of 3 identical rows each
        assert len(evaluated) == len(set(evaluated)) == 4
        assert not prompts(task.rows) & prompts(task.eval_examples)
    dropped = 1 if separate_set else 8
    assert (f"{dropped} of {dropped + len(evaluated)} rows repeat an earlier row exactly"
            in capsys.readouterr().out)
