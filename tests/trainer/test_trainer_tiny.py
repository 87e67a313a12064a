"""The whole loop on a tiny model: reward rises, checkpoints resume bit-exactly."""

import json

import pytest
import torch
from safetensors.torch import load_file

from gspo.config import load_config
from gspo.trainer import Trainer


def starts_with_digit(prompts, completions, **_):
    return [float(bool(c) and c[0].isdigit()) for c in completions]


def _cfg(tmp_path, name, *extra):
    return load_config(None, [
        "model=tiny:llama", f"output_dir={tmp_path}", f"run_name={name}", "progress=false",
        "rollout.max_new_tokens=6", "rollout.prompts_per_step=4", "rollout.group_size=6",
        "rollout.temperature=1.0", "task.eval_size=8", "optim.lr=3e-3", *extra])


def _weights(run_dir, step):
    return load_file(f"{run_dir}/checkpoints/step_{step:06d}/model.safetensors")


def test_reward_rises_on_an_easy_task(tmp_path):
    cfg = _cfg(tmp_path, "rise", "steps=30", "objective.name=grpo", "objective.eps_low=0.2",
               "objective.eps_high=0.27")
    trainer = Trainer(cfg, reward_fns=[starts_with_digit]).setup()
    trainer.train()
    rows = [json.loads(x) for x in open(trainer.run_dir / "metrics.jsonl")]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert len(rewards) == 30
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.3, (first, last)


def test_gspo_default_objective_logs_paper_stats(tmp_path):
    trainer = Trainer(_cfg(tmp_path, "stats", "steps=2"), reward_fns=[starts_with_digit]).setup()
    trainer.train()
    row = json.loads(open(trainer.run_dir / "metrics.jsonl").readlines()[1])
    for key in ("objective/clip_frac_tokens", "objective/seq_ratio_max", "objective/approx_kl",
                "train/grad_norm", "train/entropy", "rollout/truncated_frac",
                "perf/rollout_tokens_per_s", "time/update_s", "reward/std_within_group"):
        assert key in row, key
    assert row["rollout/logprob_gap_abs_max"] < 3e-5  # sampler and trainer agree in fp32
    assert (trainer.run_dir / "config.yaml").is_file()


def test_one_minibatch_one_epoch_warns(tmp_path):
    cfg = _cfg(tmp_path, "warn", "steps=1", "objective.num_minibatches=1")
    with pytest.warns(UserWarning, match="every ratio is 1"):
        Trainer(cfg, reward_fns=[starts_with_digit]).setup()


def test_resume_is_bit_identical(tmp_path):
    straight = Trainer(_cfg(tmp_path, "a", "steps=4"), reward_fns=[starts_with_digit]).setup()
    straight.train()
    first = Trainer(_cfg(tmp_path, "b", "steps=2"), reward_fns=[starts_with_digit]).setup()
    first.train()
    resumed = Trainer(_cfg(tmp_path, "ignored", "steps=4", f"resume={first.run_dir}"),
                      reward_fns=[starts_with_digit]).setup()
    assert resumed.step == 2
    resumed.train()
    a, b = _weights(straight.run_dir, 4), _weights(first.run_dir, 4)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    steps = [json.loads(x)["step"] for x in open(first.run_dir / "metrics.jsonl")]
    assert steps == sorted(steps) and steps.count(3) == 1
