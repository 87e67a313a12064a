"""MoE policies through the trainer: routing-change metric, R2 replay, load-balancing loss."""

import json

import pytest

from gspo.config import ConfigError, load_config
from gspo.trainer import Trainer


def first_char_digit(prompts, completions, **_):
    return [float(bool(c) and c[0].isdigit()) for c in completions]


def _run(tmp_path, name, *extra):
    cfg = load_config(None, [
        f"output_dir={tmp_path}", f"run_name={name}", "progress=false", "steps=2",
        "rollout.max_new_tokens=5", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "task.eval_size=0", "eval_before=false", *extra])
    trainer = Trainer(cfg, reward_fns=[first_char_digit]).setup()
    trainer.train()
    return [json.loads(x) for x in open(trainer.run_dir / "metrics.jsonl")]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_routing_change_is_zero_without_weight_change(tmp_path, family):
    rows = _run(tmp_path, family, f"model=tiny:{family}", "optim.lr=0")
    changes = [r["moe/routing_change"] for r in rows if "moe/routing_change" in r]
    assert len(changes) == 2 and all(c == 0.0 for c in changes)
    assert "moe/routing_change_layer3" in rows[0]


def test_r2_replay_and_aux_loss_run_and_routes_drift_with_updates(tmp_path):
    rows = _run(tmp_path, "r2", "model=tiny:qwen3_moe", "optim.lr=1e-2", "moe.routing_replay=r2",
                "moe.aux_loss_coef=0.01", "objective.name=grpo", "objective.eps_low=0.2",
                "objective.eps_high=0.27")
    assert rows[-1]["moe/routing_change"] > 0  # later minibatches see a changed router
    assert rows[-1]["moe/load_balancing_loss"] > 0


def test_moe_options_on_a_dense_model_are_an_error(tmp_path):
    cfg = load_config(None, ["model=tiny:llama", "moe.routing_replay=r2",
                             f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="dense"):
        Trainer(cfg, reward_fns=[first_char_digit]).setup()
    assert not any(tmp_path.iterdir())
