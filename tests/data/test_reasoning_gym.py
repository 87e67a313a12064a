"""task.name=reasoning_gym: the split, options, resume, and scoring with the dataset's verifier."""

from __future__ import annotations

import pytest

from gspo.config import ConfigError, TaskConfig, load_config
from gspo.data import DataError, Task, build_task
from gspo.data.base import is_held_out
from gspo.rewards import RewardScorer, resolve_reward

pytest.importorskip("reasoning_gym")

DATASETS = ["chain_sum", "leg_counting", "letter_counting"]


def _task(subset: str, seed: int = 0, eval_size: int = 8, options: dict | None = None):
    return build_task(TaskConfig(name="reasoning_gym", subset=subset, options=options or {},
                                 eval_size=eval_size), seed)


@pytest.mark.parametrize("subset", DATASETS)
def test_split_is_disjoint_seeded_and_follows_the_protocol(subset):
    task = _task(subset)
    assert isinstance(task, Task)
    train = task.sample(60)
    held = {ex.prompt for ex in task.eval_examples}
    assert len(held) == 8 and all(is_held_out(p) for p in held)
    assert not held & {ex.prompt for ex in train}
    again = _task(subset)
    assert [ex.prompt for ex in again.sample(60)] == [ex.prompt for ex in train]
    assert [ex.prompt for ex in again.eval_examples] == [ex.prompt for ex in task.eval_examples]
    other = _task(subset, seed=1)
    assert [ex.prompt for ex in other.sample(10)] != [ex.prompt for ex in train[:10]]


@pytest.mark.parametrize("subset", DATASETS)
def test_the_reference_answer_scores_one_and_junk_scores_less(subset):
    examples = _task(subset).sample(6)
    reward = resolve_reward("reasoning_gym")
    columns = {k: [ex.columns[k] for ex in examples] for k in examples[0].columns}
    prompts = [ex.prompt for ex in examples]
    tagged = [f"Let me think.\n<answer>{ex.answer}</answer>" for ex in examples]
    assert reward(prompts, tagged, **columns) == [1.0] * 6
    assert reward(prompts, [ex.answer for ex in examples], **columns) == [1.0] * 6  # untagged
    junk = reward(prompts, ["<answer>zebra</answer>"] * 6, **columns)
    assert all(r is not None and r < 1.0 for r in junk)


def test_options_reach_the_generator_and_bad_ones_are_one_line_errors():
    easy = _task("chain_sum", options={"min_terms": 2, "max_terms": 2})
    for ex in easy.sample(20):
        assert ex.columns["rg_entry"]["metadata"]["num_terms"] == 2
    with pytest.raises(DataError, match=r"task\.options for reasoning-gym 'chain_sum'"):
        _task("chain_sum", options={"no_such_field": 1})
    with pytest.raises(DataError, match=r"task\.options\.seed: set by gspo"):
        _task("chain_sum", options={"seed": 3})
    with pytest.raises(DataError, match="'nope' is not a reasoning-gym dataset"):
        _task("nope")


def test_resume_continues_the_same_draws():
    task = _task("leg_counting")
    task.sample(5)
    state = task.state_dict()
    expected = [ex.prompt for ex in task.sample(5)]
    fresh = _task("leg_counting")
    fresh.load_state_dict(state)
    assert [ex.prompt for ex in fresh.sample(5)] == expected


def test_scorer_through_the_runs_reward_path():
    examples = _task("chain_sum").sample(4)
    scorer = RewardScorer.from_specs(["reasoning_gym"])
    columns = {"answer": [ex.answer for ex in examples]}
    columns |= {k: [ex.columns[k] for ex in examples] for k in examples[0].columns}
    total, _ = scorer([ex.prompt for ex in examples],
                      [f"<answer>{ex.answer}</answer>" for ex in examples[:2]] + ["no", "no"],
                      columns)
    assert total == [1.0, 1.0, 0.0, 0.0]


def test_config_checks():
    cfg = load_config(None, ["task.name=reasoning_gym", "task.subset=chain_sum",
                             "reward.functions=[reasoning_gym]", "task.options.max_terms=3",
                             "task.options.min_terms=2"])
    assert cfg.task.options == {"max_terms": 3, "min_terms": 2}  # dotted keys merge
    with pytest.raises(ConfigError, match=r"task\.options is used only by"):
        load_config(None, ["task.options.max_terms=3"])
    with pytest.raises(ConfigError, match=r"needs task\.subset"):
        load_config(None, ["task.name=reasoning_gym", "reward.functions=[reasoning_gym]"])
    with pytest.raises(ConfigError, match=r"reward\.functions=\[reasoning_gym\]"):
        load_config(None, ["task.name=reasoning_gym", "task.subset=chain_sum"])
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(None, ["task.options=3"])


def test_other_seeds_draw_other_problems():
    """A reasoning-gym dataset draws problem i from Random(seed + i): training on the
    dataset built with the run's seed gave seed 1 seed 0's problems shifted by one."""
    first = [ex.prompt for ex in _task("chain_sum", seed=0, eval_size=0).sample(40)]
    second = [ex.prompt for ex in _task("chain_sum", seed=1, eval_size=0).sample(40)]
    assert len(set(first) & set(second)) < 5


def test_a_dataset_that_builds_its_problems_up_front_can_be_trained_on():
    """word_ladder refuses a size over 20000 (acre, list_functions and gsm_symbolic build
    every problem when created): each dataset is built with CHUNK problems at a time."""
    task = _task("word_ladder", eval_size=2)
    assert len(task.eval_examples) == 2 and len(task.sample(2)) == 2


def test_draws_go_on_across_a_chunk_and_resume_there():
    from gspo.data.reasoning_gym import CHUNK

    task = _task("chain_sum", eval_size=0)
    task.load_state_dict({"index": CHUNK - 2})
    state = task.state_dict()
    drawn = [ex.prompt for ex in task.sample(4)]
    assert len(set(drawn)) == 4 and task.state_dict()["index"] >= CHUNK + 2
    again = _task("chain_sum", eval_size=0)
    again.load_state_dict(state)
    assert [ex.prompt for ex in again.sample(4)] == drawn


def test_without_the_package_the_task_says_what_to_install(monkeypatch):
    """Built from the library (no reward check before it), the task's own one-line
    MissingPackage names the setting and the install."""
    import sys

    from gspo.config import MissingPackage

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import` fails as if absent
    with pytest.raises(MissingPackage, match=r"^task.name=reasoning_gym needs the reasoning-gym "
                                             r"package \(pip install 'gspo\[reasoning_gym\]'\)$"):
        build_task(TaskConfig(name="reasoning_gym", subset="chain_sum", eval_size=2), seed=0)


def test_random_string_hashing_is_warned_of(monkeypatch):
    """Some reasoning-gym datasets draw in the order of Python sets: in a process whose string
    hashing is random, the task says so (the gspo command fixes it, see test_cli)."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.warns(UserWarning, match="PYTHONHASHSEED unset"):
        _task("chain_sum", eval_size=2)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _task("chain_sum", eval_size=2)
