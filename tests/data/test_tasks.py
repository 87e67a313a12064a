"""Prompt sources: the arithmetic task's train/eval split and resume, JSONL datasets."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from gspo.config import ConfigError, TaskConfig, TrainConfig, build, validate
from gspo.data import ArithmeticTask, DataError, DatasetTask, Example, build_task
from gspo.data.tasks import LEVELS

PROMPT = re.compile(r"^What is (\d+)([+*-])(\d+)\? Answer with a number\.$")
ALL_OPS = ["+", "-", "*"]


def parse(ex: Example) -> tuple[str, int, int]:
    m = PROMPT.match(ex.prompt)
    assert m, ex.prompt
    return m.group(2), int(m.group(1)), int(m.group(3))


def canonical(ex: Example) -> tuple[str, int, int]:
    """a+b and b+a (a*b and b*a, a-b and b-a) are the same problem."""
    op, a, b = parse(ex)
    return op, max(a, b), min(a, b)


def make(levels=(1, 2, 3), ops=ALL_OPS, eval_size=300, seed=0, eval_levels=(), weights=()):
    return ArithmeticTask(list(levels), list(weights), list(ops), list(eval_levels), eval_size,
                          seed)


# ----------------------------------------------------------------------------- arithmetic


def test_train_and_eval_are_disjoint():
    task = make()
    eval_prompts = {ex.prompt for ex in task.eval_examples}
    eval_keys = {canonical(ex) for ex in task.eval_examples}
    train = task.sample(5000)
    assert len(train) == 5000
    assert not eval_prompts & {ex.prompt for ex in train}
    assert not eval_keys & {canonical(ex) for ex in train}
    # Every level and operation shows up in training.
    assert {ex.columns["level"] for ex in train} == {1, 2, 3}
    assert {parse(ex)[0] for ex in train} == set(ALL_OPS)


def test_split_does_not_depend_on_seed():
    """The seed orders the draws; it never moves a problem between train and eval."""
    eval_keys = set()
    for seed in (1, 2, 3):
        eval_keys |= {canonical(ex) for ex in make(seed=seed).eval_examples}
    for seed in (0, 7):
        train_keys = {canonical(ex) for ex in make(seed=seed, eval_size=0).sample(3000)}
        assert not eval_keys & train_keys


def test_commuted_problem_is_in_the_same_split():
    task = make(levels=[3], ops=["+", "*"], eval_size=200)
    for ex in task.eval_examples:
        op, a, b = parse(ex)
        swapped = ArithmeticTask.make(op, b, a, 3)
        assert canonical(swapped) == canonical(ex)
    train = task.sample(3000)
    train_prompts = {ex.prompt for ex in train}
    for ex in task.eval_examples:
        op, a, b = parse(ex)
        assert f"What is {b}{op}{a}? Answer with a number." not in train_prompts


def test_eval_set_deterministic_and_unique():
    a, b = make(levels=[2, 3], seed=5, eval_size=301), make(levels=[2, 3], seed=5, eval_size=301)
    assert a.eval_examples == b.eval_examples
    assert len({ex.prompt for ex in a.eval_examples}) == 301
    # Split per level as evenly as possible, in level order.
    assert Counter(ex.columns["level"] for ex in a.eval_examples) == {2: 151, 3: 150}
    assert make(levels=[2, 3], seed=6, eval_size=301).eval_examples != a.eval_examples
    # The eval set has its own rng: it does not shift the training stream.
    assert make(seed=5, eval_size=0).sample(200) == make(seed=5, eval_size=50).sample(200)
    assert make(seed=5).sample(200) == make(seed=5).sample(200)
    assert make(seed=5).sample(200) != make(seed=6).sample(200)


def test_small_level_eval_pool_is_exhausted_not_looped():
    task = make(levels=[1], ops=["+"], eval_size=100)
    prompts = [ex.prompt for ex in task.eval_examples]
    assert len(prompts) == len(set(prompts))
    assert 0 < len(prompts) < 50  # 100 one-digit sums, about a fifth of them held out
    # Distinct prompts, but a+b and b+a may both be held out (they share one split).
    assert max(Counter(canonical(ex) for ex in task.eval_examples).values()) <= 2


def test_eval_levels_override():
    task = make(levels=[1], eval_levels=[3, 4], eval_size=40)
    assert {ex.columns["level"] for ex in task.eval_examples} == {3, 4}
    assert len(task.eval_examples) == 40


@pytest.mark.parametrize("op", ALL_OPS)
def test_answers_are_correct(op):
    task = make(levels=[1, 2, 3, 4], ops=[op], eval_size=40)
    for ex in task.sample(500) + task.eval_examples:
        got_op, a, b = parse(ex)
        assert got_op == op
        expected = {"+": a + b, "-": a - b, "*": a * b}[op]
        assert ex.answer == str(expected)
        if op == "-":
            assert a >= b and int(ex.answer) >= 0
        (lo_a, hi_a), (lo_b, hi_b) = LEVELS[ex.columns["level"]]
        big, small = max(a, b), min(a, b)
        in_range = (lo_a <= a <= hi_a and lo_b <= b <= hi_b) or (
            lo_a <= b <= hi_a and lo_b <= a <= hi_b)
        assert in_range, (ex.prompt, big, small)


def test_make_negative_free_subtraction():
    ex = ArithmeticTask.make("-", 3, 8, 1)
    assert ex.prompt == "What is 8-3? Answer with a number."
    assert ex.answer == "5" and ex.columns == {"level": 1}


def test_level_weights():
    task = make(levels=[1, 3], weights=[0.0, 1.0], eval_size=0)
    assert {ex.columns["level"] for ex in task.sample(300)} == {3}


def test_state_dict_resumes_the_same_sequence():
    task = make(seed=3)
    task.sample(123)
    state = task.state_dict()
    expected = task.sample(200)
    # Through JSON (tuples become lists), into a task built with another seed.
    other = make(seed=99)
    other.sample(7)
    other.load_state_dict(json.loads(json.dumps(state)))
    assert other.sample(200) == expected
    # Loading the same state again rewinds.
    task.load_state_dict(state)
    assert task.sample(200) == expected


# ----------------------------------------------------------------------------- DatasetTask


def rows(n: int, prefix: str = "q") -> list[Example]:
    return [Example(f"{prefix}{i}", str(i), {"i": i}) for i in range(n)]


def test_dataset_task_epochs_cover_every_row():
    data = rows(7)
    task = DatasetTask(data, [], seed=1)
    epoch1, epoch2 = task.sample(7), task.sample(7)
    assert sorted(ex.prompt for ex in epoch1) == sorted(ex.prompt for ex in data)
    assert sorted(ex.prompt for ex in epoch2) == sorted(ex.prompt for ex in data)
    assert task.epoch == 1 and task.position == 7
    # Samples crossing an epoch boundary still see every row once per epoch.
    task2 = DatasetTask(data, [], seed=1)
    assert task2.sample(5) + task2.sample(9) == (epoch1 + epoch2)[:14]


def test_dataset_task_shuffle_depends_on_seed_and_epoch():
    data = rows(30)
    a = DatasetTask(data, [], seed=0).sample(60)
    b = DatasetTask(data, [], seed=1).sample(60)
    assert a != b
    assert a[:30] != a[30:]  # reshuffled each epoch
    assert DatasetTask(data, [], seed=0).sample(60) == a
    assert a[:30] != data  # actually shuffled


@pytest.mark.parametrize("consumed", [0, 3, 10, 11, 25])
def test_dataset_task_resume(consumed):
    data = rows(10)
    task = DatasetTask(data, [], seed=4)
    task.sample(consumed)
    state = json.loads(json.dumps(task.state_dict()))
    expected = task.sample(17)
    fresh = DatasetTask(data, [], seed=4)
    fresh.load_state_dict(state)
    assert fresh.sample(17) == expected


def test_dataset_task_empty():
    with pytest.raises(DataError, match="empty"):
        DatasetTask([], [], seed=0)


# ----------------------------------------------------------------------------- build_task


def write_jsonl(path, n, prefix="q", **extra):
    path.write_text("".join(json.dumps({"prompt": f"{prefix}{i}", "answer": i, **extra}) + "\n"
                            for i in range(n)))
    return str(path)


def test_build_task_arithmetic():
    cfg = TaskConfig(levels=[2], operations=["*"], eval_size=10)
    task = build_task(cfg, seed=0)
    assert isinstance(task, ArithmeticTask)
    assert len(task.eval_examples) == 10
    assert {parse(ex)[0] for ex in task.sample(20)} == {"*"}


def test_build_task_jsonl_with_eval_path(tmp_path):
    cfg = TaskConfig(name="jsonl", path=write_jsonl(tmp_path / "train.jsonl", 12, tag="t"),
                     eval_path=write_jsonl(tmp_path / "eval.jsonl", 4, prefix="e"),
                     eval_size=2)
    task = build_task(cfg, seed=0)
    assert isinstance(task, DatasetTask)
    assert len(task.rows) == 12  # nothing held out of the training file
    assert [ex.prompt for ex in task.eval_examples] == ["e0", "e1", "e2", "e3"]
    sampled = task.sample(12)
    assert sorted(ex.prompt for ex in sampled) == sorted(f"q{i}" for i in range(12))
    assert all(ex.columns == {"tag": "t"} for ex in sampled)
    assert all(isinstance(ex.answer, str) for ex in sampled)


def test_build_task_jsonl_holds_out_rows(tmp_path):
    cfg = TaskConfig(name="jsonl", path=write_jsonl(tmp_path / "d.jsonl", 20), eval_size=100)
    task = build_task(cfg, seed=3)
    train = {ex.prompt for ex in task.rows}
    held = {ex.prompt for ex in task.eval_examples}
    assert len(held) == 4  # capped at a fifth of the file
    assert not train & held
    assert train | held == {f"q{i}" for i in range(20)}
    again = build_task(cfg, seed=3)
    assert again.eval_examples == task.eval_examples
    cfg.eval_size = 2
    assert len(build_task(cfg, seed=3).eval_examples) == 2
    cfg.eval_size = 0
    assert build_task(cfg, seed=3).eval_examples == []


def test_build_task_jsonl_custom_fields(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"question": "2+2?", "target": 4, "level": 9}\n')
    cfg = TaskConfig(name="jsonl", path=str(p), prompt_field="question", answer_field="target",
                     eval_size=0)
    (ex,) = build_task(cfg, seed=0).sample(1)
    assert ex == Example("2+2?", "4", {"target": 4, "level": 9})  # the answer column keeps its name


def test_build_task_errors(tmp_path):
    with pytest.raises(DataError, match="unknown task"):
        build_task(TaskConfig(name="countdownz"), seed=0)
    with pytest.raises(DataError, match="not found"):
        build_task(TaskConfig(name="jsonl", path=str(tmp_path / "missing.jsonl")), seed=0)
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "answer": 1}\n{"prompt": "b"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: missing field 'answer'"):
        build_task(TaskConfig(name="jsonl", path=str(p)), seed=0)
    write_jsonl(p, 3)
    bad_eval = tmp_path / "e.jsonl"
    bad_eval.write_text("not json\n")
    with pytest.raises(DataError, match=r"e\.jsonl:1: invalid JSON"):
        build_task(TaskConfig(name="jsonl", path=str(p), eval_path=str(bad_eval)), seed=0)


def test_prompt_template_replaces_the_prompt_and_keeps_the_problems():
    plain = build_task(build(TrainConfig, None, ["task.eval_size=5"]).task, seed=3)
    cfg = build(TrainConfig, None, ["task.eval_size=5",
                                    "task.prompt_template=Write Python that prints {problem}."])
    templated = build_task(cfg.task, seed=3)
    for a, b in zip(plain.eval_examples, templated.eval_examples):
        assert b.answer == a.answer and b.prompt.startswith("Write Python that prints ")
        assert a.prompt.replace("What is ", "").split("?")[0] in b.prompt


def test_prompt_template_errors():
    with pytest.raises(ConfigError, match=r"must contain \{problem\}"):
        validate(build(TrainConfig, None, ["task.prompt_template=hello"]))
    with pytest.raises(ConfigError, match=r"only to task\.name=arithmetic"):
        validate(build(TrainConfig, None, ["task.name=countdown", "reward.functions=[countdown]",
                                           "task.prompt_template=x {problem}"]))
