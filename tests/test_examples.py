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
import torch

from gspo import TrainConfig, Trainer
from gspo.config import (
    LoggingConfig,
    ObjectiveConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    TaskConfig,
)
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
    model, tok = build_tiny("llama")  # before the stand-ins: transformers looks for wandb
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "trackio", trackio)
    import gspo.rollout.hf_engine as engine_module

    seen_prompts: list[list[int]] = []
    real_generate = engine_module.generate

    def spy(model, prompts, **kw):
        seen_prompts.extend(prompts)
        return real_generate(model, prompts, **kw)

    monkeypatch.setattr(engine_module, "generate", spy)
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


def test_api_resume_with_a_model_passed_in_continues_from_the_checkpoint(tmp_path):
    """``Trainer(cfg, model=..., resume=run)``: the model passed in is the run's initial
    policy; the resumed run trains on from the checkpoint's weights (it trained on from the
    initial ones, with the checkpoint's optimizer, step and data position), and its KL
    reference stays the initial policy. The resumed run ends where an uninterrupted one does."""
    def cfg(name, steps, **kw):
        return TrainConfig(steps=steps, output_dir=str(tmp_path), run_name=name, progress=False,
                           num_threads=1, tensorboard=False, eval_before=False, save_every=1,
                           task=TaskConfig(eval_size=2),
                           rollout=RolloutConfig(prompts_per_step=2, group_size=4,
                                                 max_new_tokens=3, eval_max_new_tokens=3,
                                                 temperature=1.0),
                           optim=OptimConfig(lr=3e-3),
                           objective=ObjectiveConfig(num_minibatches=2, beta=0.1), **kw)

    def weights(model):
        return {k: v.clone() for k, v in model.state_dict().items()}

    whole = Trainer(cfg("whole", 3), model=build_tiny("llama")[0], tokenizer=build_tiny("llama")[1],
                    reward_fns=[starts_with_digit]).setup()
    initial = weights(whole.model)
    whole.train()
    cut = Trainer(cfg("cut", 2), model=build_tiny("llama")[0], tokenizer=build_tiny("llama")[1],
                  reward_fns=[starts_with_digit]).setup()
    cut.train()
    at_2 = weights(cut.model)
    resumed = Trainer(cfg("cut", 3, resume=str(cut.run_dir)), model=build_tiny("llama")[0],
                      tokenizer=build_tiny("llama")[1], reward_fns=[starts_with_digit]).setup()
    assert resumed.step == 2
    assert all(torch.equal(v, at_2[k]) for k, v in resumed.model.state_dict().items())
    assert all(torch.equal(v, initial[k]) for k, v in resumed.ref_model.state_dict().items())
    resumed.train()
    assert all(torch.equal(v, whole.model.state_dict()[k])
               for k, v in resumed.model.state_dict().items())


def test_a_resumed_run_continues_its_tracker_runs(tmp_path, monkeypatch):
    """W&B and trackio: a resumed run continues the tracker run it started (W&B by the id the
    run folder keeps, trackio by the run's name) instead of opening a second one."""
    inits: list[tuple[str, dict]] = []

    class Run:
        def log(self, metrics, step):
            pass

        def finish(self):
            pass

    models = [build_tiny("llama") for _ in range(2)]  # before the stand-ins (as above)
    for name in ("wandb", "trackio"):
        module = types.SimpleNamespace(
            init=lambda _name=name, **kw: inits.append((_name, kw)) or Run(),
            log=lambda m, step: None, finish=lambda: None)
        monkeypatch.setitem(sys.modules, name, module)

    def run(steps, **kw):
        cfg = TrainConfig(steps=steps, output_dir=str(tmp_path), run_name="t", progress=False,
                          num_threads=1, tensorboard=False, eval_before=False, save_every=1,
                          task=TaskConfig(eval_size=0),
                          rollout=RolloutConfig(prompts_per_step=2, group_size=2,
                                                max_new_tokens=2),
                          logging=LoggingConfig(wandb_project="p", trackio_project="p"), **kw)
        cfg.objective.num_minibatches = 2
        model, tok = models.pop()
        Trainer(cfg, model=model, tokenizer=tok, reward_fns=[starts_with_digit]).setup().train()

    run(1)
    run(2, resume=str(tmp_path / "t"))
    (w1, first), (t1, first_t), (w2, again), (t2, again_t) = inits
    assert (w1, t1, w2, t2) == ("wandb", "trackio", "wandb", "trackio")
    assert first["id"] == again["id"] and len(first["id"]) == 16
    assert first["resume"] == again["resume"] == "allow"
    assert "resume" not in first_t and again_t["resume"] == "allow"
    assert first_t["name"] == again_t["name"] == "t"


def test_a_loaded_model_without_its_tokenizer_is_a_clear_error():
    """``Trainer(cfg, model=m)`` without ``tokenizer=`` crashed at setup on
    ``None.pad_token_id``; it is refused at once, naming what is missing."""
    model, tok = build_tiny("llama")
    with pytest.raises(ValueError, match="a loaded model needs its tokenizer"):
        Trainer(TrainConfig(model="tiny:llama"), model=model)
    with pytest.raises(ValueError, match="tokenizer= needs the loaded model"):
        Trainer(TrainConfig(model="tiny:llama"), tokenizer=tok)
