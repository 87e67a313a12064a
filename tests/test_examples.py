"""The documented examples run at tiny scale, and the Python API they use behaves as documented:
datasets from lists of dicts, several reward functions logged apart, raw prompts, trackers,
sample logs."""

from __future__ import annotations

import json
import runpy
import sys
import types
from pathlib import Path

import pytest

from gspo import TrainConfig, Trainer
from gspo.config import LoggingConfig, RewardConfig, RolloutConfig, TaskConfig
from gspo.models.tiny import build_tiny
from gspo.trainer.samples import write_samples

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def example(name: str):
    return runpy.run_path(str(EXAMPLES / name))["main"]  # not run as __main__: nothing starts


def metrics(run_dir) -> list[dict]:
    return [json.loads(x) for x in open(Path(run_dir) / "metrics.jsonl")]


def test_quickstart_example(tmp_path):
    result = example("quickstart.py")(["--smoke", f"output_dir={tmp_path}", "run_name=q"])
    rows = metrics(result["run_dir"])
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
    assert any((tmp_path / "q" / "tensorboard").iterdir())  # TensorBoard is on by default


def test_custom_reward_example_logs_each_reward(tmp_path):
    result = example("custom_reward.py")(["--smoke", f"output_dir={tmp_path}", "run_name=c"])
    row = next(r for r in metrics(result["run_dir"]) if "reward/mean" in r)
    assert {"reward/correct_city", "reward/brevity"} <= row.keys()
    saved = (Path(result["run_dir"]) / "config.yaml").read_text()
    assert "correct_city" in saved and "city" in saved


def test_lora_example_on_a_local_folder(tmp_path):

    model, tok = build_tiny("llama")
    model.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    result = example("lora_local_model.py")(["--model", str(tmp_path / "base"), "--smoke",
                                             f"output_dir={tmp_path}", "run_name=l"])
    assert (Path(result["merged"]) / "model.safetensors").is_file()


def starts_with_digit(prompts, completions, **_):
    return [float(bool(c) and c[0].isdigit()) for c in completions]


def short(prompts, completions, *, level, **_):  # `level` comes from the dataset's rows
    assert all(lv == 7 for lv in level)
    return [1.0 / (1 + len(c)) for c in completions]


def test_python_api_with_records_raw_prompts_and_trackers(tmp_path, monkeypatch):
    calls: list[tuple] = []

    class Run:
        def log(self, metrics, step):
            calls.append(("wandb.log", step, dict(metrics)))

        def finish(self):
            calls.append(("wandb.finish",))

    wandb = types.SimpleNamespace(init=lambda **kw: calls.append(("wandb.init", kw)) or Run())
    trackio = types.SimpleNamespace(init=lambda **kw: calls.append(("trackio.init", kw)),
                                    log=lambda m, step: calls.append(("trackio.log", step)),
                                    finish=lambda: calls.append(("trackio.finish",)))
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "trackio", trackio)
    import gspo.rollout.hf_engine as engine_module

    seen_prompts: list[list[int]] = []
    real_generate = engine_module.generate

    def spy(model, prompts, **kw):
        seen_prompts.extend(prompts)
        return real_generate(model, prompts, **kw)

    monkeypatch.setattr(engine_module, "generate", spy)
    model, tok = build_tiny("llama")
    data = [{"prompt": f"{i}+1=", "answer": str(i + 1), "level": 7} for i in range(10)]
    cfg = TrainConfig(steps=1, output_dir=str(tmp_path), run_name="api", progress=False,
                      num_threads=1,
                      tensorboard=False, eval_before=False,
                      task=TaskConfig(chat_template=False, eval_size=2),
                      rollout=RolloutConfig(prompts_per_step=2, group_size=2, max_new_tokens=3,
                                            eval_max_new_tokens=3),
                      logging=LoggingConfig(wandb_project="p", trackio_project="p"))
    cfg.objective.num_minibatches = 2
    trainer = Trainer(cfg, model=model, tokenizer=tok, reward_fns=[starts_with_digit, short],
                      train_dataset=data).setup()
    assert len(trainer.task.rows) == 8 and len(trainer.task.eval_examples) == 2
    trainer.train()
    texts = {tok.decode(p) for p in seen_prompts}
    assert texts <= {d["prompt"] for d in data}  # raw: no role markers, no system message
    row = next(r for r in metrics(trainer.run_dir) if "reward/mean" in r)
    assert {"reward/starts_with_digit", "reward/short"} <= row.keys()
    names = [c[0] for c in calls]
    assert names[:2] == ["wandb.init", "trackio.init"] and names[-2:] == ["wandb.finish",
                                                                          "trackio.finish"]
    assert calls[0][1]["project"] == "p" and calls[0][1]["config"]["steps"] == 1
    logged = next(c for c in calls if c[0] == "wandb.log" and c[1] == 1)[2]
    assert logged["reward/mean"] == row["reward/mean"]


def test_api_checks_the_config_before_any_work():
    from gspo.config import ConfigError

    assert Trainer(TrainConfig(), model="tiny:llama").cfg.model == "tiny:llama"
    with pytest.raises(ConfigError, match="group_size"):
        Trainer(TrainConfig(rollout=RolloutConfig(group_size=1)))
    with pytest.raises(ConfigError, match="one weight per reward function"):
        Trainer(TrainConfig(reward=RewardConfig(weights=[1.0])),
                reward_fns=[starts_with_digit, short])


def test_write_samples(tmp_path):
    path = write_samples(tmp_path, 3, ["p", "p", "q"], ["a", "b", "c"], [1.0, float("nan"), 0.5],
                         answers=["1", "1", "2"], per_fn={"f": [1.0, float("nan"), 0.5]}, limit=2)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert rows == [
        {"step": 3, "prompt": "p", "completion": "a", "reward": 1.0, "answer": "1",
         "rewards": {"f": 1.0}},
        {"step": 3, "prompt": "p", "completion": "b", "reward": None, "answer": "1",
         "rewards": {"f": None}},
    ]
