"""Datasets through Hugging Face `datasets`, the built-in countdown and gsm8k_mini tasks,
raw-prompt formatting for base models."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from gspo.config import ConfigError, TaskConfig, load_config
from gspo.data import DataError, DatasetTask, Example, build_task, format_prompt
from gspo.data.builtin import GSM8K_MINI, CountdownTask
from gspo.data.hf import records_to_examples, task_from_records
from gspo.models.tiny import byte_tokenizer
from gspo.rewards.math import countdown_score, evaluate_expression


def rows(n: int, prefix: str = "q") -> list[dict]:
    return [{"question": f"{prefix}{i}", "target": i, "level": i % 3} for i in range(n)]


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def cfg(path, **kw) -> TaskConfig:
    fields = {"prompt_field": "question", "answer_field": "target", **kw}
    return TaskConfig(name="dataset", path=str(path), **fields)


def test_local_files_every_format_with_column_mapping(tmp_path):
    import datasets

    data = rows(10)
    ds = datasets.Dataset.from_list(data)
    files = {"d.jsonl": write_jsonl(tmp_path / "d.jsonl", data)}
    files["d.csv"] = str(tmp_path / "d.csv")
    ds.to_csv(files["d.csv"], index=False)
    files["d.parquet"] = str(tmp_path / "d.parquet")
    ds.to_parquet(files["d.parquet"])
    for name, path in files.items():
        task = build_task(cfg(path, eval_size=2), seed=0)
        assert isinstance(task, DatasetTask), name
        assert len(task.rows) == 8 and len(task.eval_examples) == 2, name
        everything = task.rows + task.eval_examples
        assert sorted(ex.prompt for ex in everything) == sorted(f"q{i}" for i in range(10))
        ex = next(e for e in everything if e.prompt == "q4")
        # every other column reaches the rewards under its own name, the answer column too
        assert ex == Example("q4", "4", {"target": 4, "level": 1}), name


def test_folder_with_splits_seeded_shuffle_and_resume(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", rows(12))
    write_jsonl(tmp_path / "test.jsonl", rows(3, prefix="e"))
    task = build_task(cfg(tmp_path, eval_split="test"), seed=1)
    assert [ex.prompt for ex in task.eval_examples] == ["e0", "e1", "e2"]
    assert len(task.rows) == 12  # nothing held out of the training split
    first = [ex.prompt for ex in task.sample(5)]
    assert first != [f"q{i}" for i in range(5)]  # shuffled with the seed
    assert first == [ex.prompt for ex in build_task(cfg(tmp_path, eval_split="test"),
                                                   seed=1).sample(5)]
    state = task.state_dict()
    rest = [ex.prompt for ex in task.sample(10)]  # crosses into the second epoch
    again = build_task(cfg(tmp_path, eval_split="test"), seed=1)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert [ex.prompt for ex in again.sample(10)] == rest


def test_errors_are_one_line_and_name_the_source(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", rows(5))
    cases = [
        (cfg(path, prompt_field="prompt"), r"d\.jsonl \[train\]: column 'prompt' not found"),
        (cfg(path, eval_split="test"), r"no split 'test' \(splits: train\)"),
        (cfg(tmp_path / "missing.jsonl"), r"dataset not found: .*missing\.jsonl"),
        (cfg(tmp_path / "d.txt"), "not found"),
    ]
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    cases.append((cfg(tmp_path / "bad.csv"), r"column 'question' not found \(columns: a, b\)"))
    # The Hub is out of reach here: force offline mode so nothing waits on the network.
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cases.append((cfg("no-such-org/no-such-dataset"), "needs network access"))
    cases.append((cfg(tmp_path / "empty.jsonl"), r"empty\.jsonl: dataset is empty"))
    (tmp_path / "header.csv").write_text("question,target\n")
    cases.append((cfg(tmp_path / "header.csv"), r"header\.csv: split 'train' is empty"))
    for task_cfg, pattern in cases:
        with pytest.raises(DataError, match=pattern) as info:
            build_task(task_cfg, seed=0)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"task\.path is required"):
        load_config(None, ["task.name=dataset"])


def test_in_memory_records_for_the_python_api():
    import datasets

    data = [{"prompt": f"p{i}", "answer": i} for i in range(10)]
    task = task_from_records(data, None, TaskConfig(eval_size=2), seed=0)
    assert len(task.rows) == 8 and len(task.eval_examples) == 2
    from_ds = task_from_records(datasets.Dataset.from_list(data), data[:3],
                                TaskConfig(eval_size=2), seed=0)
    # the held-out prompts are left out of training (they leaked into its draws before)
    assert len(from_ds.rows) == 7 and [e.prompt for e in from_ds.eval_examples] == [
        "p0", "p1", "p2"]
    with pytest.raises(DataError, match="row 1 has no column 'answer'"):
        records_to_examples([{"prompt": "a", "answer": 1}, {"prompt": "b"}])
    with pytest.raises(DataError, match="column 'prompt' must be a non-empty string"):
        records_to_examples([{"prompt": "", "answer": 1}])
    with pytest.raises(DataError, match="train_dataset is empty"):
        task_from_records([], None, TaskConfig(), seed=0)


# ----------------------------------------------------------------------------- built-in tasks


def test_countdown_problems_are_solvable_and_split_by_hash():
    task = build_task(TaskConfig(name="countdown", countdown_numbers=4, eval_size=20), seed=0)
    assert isinstance(task, CountdownTask) and len(task.eval_examples) == 20
    train = task.sample(200)
    for ex in train[:50] + task.eval_examples:
        numbers, target = ex.columns["numbers"], ex.columns["target"]
        assert len(numbers) == 4 and 1 <= target <= 100
        assert countdown_score(ex.answer, numbers, target) == 1.0, ex  # the kept solution
        value, used = evaluate_expression(ex.answer)
        assert value == target and not Counter(used) - Counter(numbers)
    def key(ex):
        return tuple(sorted(ex.columns["numbers"])), ex.columns["target"]

    assert not {key(e) for e in task.eval_examples} & {key(e) for e in train}
    state = task.state_dict()
    nxt = task.sample(3)
    fresh = build_task(TaskConfig(name="countdown", countdown_numbers=4, eval_size=0), seed=9)
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert fresh.sample(3) == nxt
    with pytest.raises(ConfigError, match="numeric_match would reward echoing"):
        load_config(None, ["task.name=countdown"])
    load_config(None, ["task.name=countdown", "reward.functions=[countdown]"])


def test_gsm8k_mini_ships_forty_problems():
    lines = [json.loads(x) for x in GSM8K_MINI.read_text().splitlines()]
    assert len(lines) == 40 and len({r["prompt"] for r in lines}) == 40
    assert all(r["answer"].lstrip("-").isdigit() for r in lines)
    task = build_task(TaskConfig(name="gsm8k_mini", eval_size=5), seed=0)
    assert len(task.eval_examples) == 5 and len(task.rows) == 35
    assert all(ex.prompt.endswith("\\boxed{}.") for ex in task.rows)


# ----------------------------------------------------------------------------- raw prompts


def test_raw_prompts_for_base_models():
    tok = byte_tokenizer()
    chat = format_prompt(tok, "2+2?", chat_template=True, system_prompt="Be brief.")
    assert tok.decode(chat) == "system: Be brief.\nuser: 2+2?\nassistant:"
    raw = format_prompt(tok, "2+2?", chat_template=False, system_prompt="Be brief.")
    assert tok.decode(raw) == "2+2?"  # no role markers, no system message
    tok.chat_template = None  # a base model's tokenizer: raw even when asked for the template
    assert format_prompt(tok, "2+2?", chat_template=True) == raw


# Gemma's template (abridged): BOS in the text, no system role, roles must alternate.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def test_a_template_without_a_system_role_gets_the_system_prompt_in_the_user_message():
    """The default task.system_prompt stopped a Gemma model's first rollout with the
    template's "System role not supported"."""
    tok = byte_tokenizer()
    tok.chat_template = GEMMA_TEMPLATE
    ids = format_prompt(tok, "2+2?", system_prompt=TaskConfig().system_prompt)
    assert tok.decode(ids) == ("<bos><start_of_turn>user\nYou are a helpful assistant.\n\n2+2?"
                               "<end_of_turn>\n<start_of_turn>model\n")
    assert ids.count(tok.bos_token_id) == 1  # the template's BOS only
    assert tok.decode(format_prompt(tok, "2+2?")) == (
        "<bos><start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n")
