"""task.subset with a local dataset: a folder's configurations (a local copy of a Hub
dataset, its README.md declaring them) are picked by it as on the Hub; a single file has none."""

from __future__ import annotations

import pytest

from gspo.config import TaskConfig
from gspo.data import DataError, build_task

README = """---
configs:
- config_name: main
  default: true
  data_files:
  - split: train
    path: main/train.jsonl
  - split: test
    path: main/test.jsonl
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train.jsonl
  - split: test
    path: socratic/test.jsonl
---
"""


def two_configs(root):
    (root / "README.md").write_text(README)
    for name in ("main", "socratic"):
        (root / name).mkdir()
        for split, n in (("train", 6), ("test", 2)):
            (root / name / f"{split}.jsonl").write_text("".join(
                f'{{"question": "{name} {split} {i}", "answer": "{i}"}}\n' for i in range(n)))
    return root


def cfg(path, **kw) -> TaskConfig:
    return TaskConfig(name="dataset", path=str(path), prompt_field="question", **kw)


@pytest.mark.parametrize("subset", ["main", "socratic"])
def test_subset_picks_a_local_folders_configuration(tmp_path, subset):
    task = build_task(cfg(two_configs(tmp_path), subset=subset, eval_split="test"), seed=0)
    assert {ex.prompt.split()[0] for ex in task.rows + task.eval_examples} == {subset}
    assert sorted(ex.prompt for ex in task.eval_examples) == [f"{subset} test 0",
                                                              f"{subset} test 1"]


def test_an_unknown_subset_of_a_local_folder_is_an_error(tmp_path):
    with pytest.raises(DataError, match="'nope' not found"):
        build_task(cfg(two_configs(tmp_path), subset="nope"), seed=0)


def test_a_subset_with_a_single_file_is_an_error(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(f'{{"question": "q{i}", "answer": "{i}"}}\n' for i in range(10)))
    with pytest.raises(DataError, match=r"d\.jsonl: task\.subset='main' names a configuration"):
        build_task(cfg(path, subset="main"), seed=0)
    assert len(build_task(cfg(path, eval_size=2), seed=0).rows) == 8
