"""The synchronous loop's messages and logs on a tiny model."""

import pytest

from gspo.config import load_config
from gspo.rewards import RewardError
from gspo.trainer import Trainer


def _cfg(tmp_path, name, *extra):
    return load_config(None, [
        "model=tiny:llama", f"output_dir={tmp_path}", f"run_name={name}", "progress=false",
        "tensorboard=false", "num_threads=1", "rollout.max_new_tokens=4",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "task.eval_size=0",
        "eval_before=false", "reward.timeout_s=0", *extra])


def test_too_many_unscorable_names_the_function_that_left_this_batch_unscored(tmp_path):
    """The stop names the function that scored nothing in this batch and why, not the run's
    first error of another function from an earlier batch (it named `correct`'s inf of
    step 1 when `fmt` returned None for every response of step 2)."""
    calls = {"n": 0}

    def correct(prompts, completions, **_):
        calls["n"] += 1
        out = [1.0] * len(completions)
        if calls["n"] == 1:  # one value beyond float32 in step 1: unscorable, logged
            out[0] = float("inf")
        return out

    def fmt(prompts, completions, **_):  # from step 2 on it cannot score anything
        return [0.0] * len(completions) if calls["n"] == 1 else [None] * len(completions)

    trainer = Trainer(_cfg(tmp_path, "none", "steps=3"), reward_fns=[correct, fmt]).setup()
    try:
        with pytest.raises(RewardError) as err:
            trainer.train()
    finally:
        trainer.cleanup()
    msg = str(err.value)
    assert trainer.step == 1
    assert "reward function 'fmt' scored 0 of 8 (it returned None)" in msg
    assert "inf" not in msg and "correct" not in msg
