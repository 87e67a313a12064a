"""Reward isolation: a hung, crashing or absurd reward function costs one batch, is counted
and logged, and never hangs or kills the run."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest

from gspo.config import load_config
from gspo.rewards import RewardError, RewardScorer
from gspo.trainer import Trainer

PROMPTS, COMPLETIONS, COLUMNS = ["p1", "p2"], ["7", "8"], {"answer": ["7", "9"]}


def ok(prompts, completions, **_):
    return [1.0] * len(completions)


def _hang_until(release: threading.Event):
    def hangs(prompts, completions, **_):
        release.wait(30)
        return [0.5] * len(completions)

    return hangs


def _reward_threads():
    return [t for t in threading.enumerate() if t.name.startswith("reward-")]


def test_a_hung_reward_times_out_and_is_not_called_again_while_hung():
    release = threading.Event()
    scorer = RewardScorer.from_specs([_hang_until(release), ok])
    scorer.timeout_s = 0.2
    try:
        t0 = time.monotonic()
        total, per_fn = scorer(PROMPTS, COMPLETIONS, COLUMNS)
        assert time.monotonic() - t0 < 5
        assert all(math.isnan(v) for v in total + per_fn["hangs"])
        assert per_fn["ok"] == [1.0, 1.0]  # the others are still scored
        assert scorer.failures == {"hangs": 2}
        assert "RewardTimeout: hangs took longer than reward.timeout_s=0.2" in \
            scorer.first_errors["hangs"]
        hung = len(_reward_threads())
        t0 = time.monotonic()  # still hung: unscorable at once, no second thread
        _, per_fn = scorer(PROMPTS, COMPLETIONS, COLUMNS)
        assert time.monotonic() - t0 < 0.15 and all(math.isnan(v) for v in per_fn["hangs"])
        assert len(_reward_threads()) == hung and scorer.failures == {"hangs": 4}
    finally:
        release.set()
    for t in _reward_threads():
        t.join(5)
    _, per_fn = scorer(PROMPTS, COMPLETIONS, COLUMNS)  # recovered: scored again
    assert per_fn["hangs"] == [0.5, 0.5]


def test_errors_in_the_worker_thread_keep_their_traceback():
    def boom(prompts, completions, **_):
        raise ZeroDivisionError("inside the reward")

    scorer = RewardScorer.from_specs([boom])
    scorer.timeout_s = 5
    total, _ = scorer(PROMPTS, COMPLETIONS, COLUMNS)
    assert all(math.isnan(v) for v in total)
    err = scorer.first_errors["boom"]
    assert "Traceback" in err and "ZeroDivisionError: inside the reward" in err
    assert 'raise ZeroDivisionError("inside the reward")' in err


def test_without_a_timeout_the_reward_runs_in_the_callers_thread():
    where = []

    def spy(prompts, completions, **_):
        where.append(threading.current_thread())
        return [0.0] * len(completions)

    RewardScorer.from_specs([spy])(PROMPTS, COMPLETIONS, COLUMNS)
    assert where == [threading.current_thread()]


@pytest.mark.parametrize("value", [1e39, -1e39, 10**40])
def test_values_beyond_float32_are_unscorable(value):
    def huge(prompts, completions, **_):
        return [value, 3e38]  # 3e38 still fits in float32

    _, per_fn = RewardScorer.from_specs([huge])(PROMPTS, COMPLETIONS, COLUMNS)
    assert math.isnan(per_fn["huge"][0]) and per_fn["huge"][1] == 3e38


# ----------------------------------------------------------------------------- in the loop


def _cfg(tmp_path, name, *extra):
    return load_config(None, [
        "model=tiny:llama", f"output_dir={tmp_path}", f"run_name={name}", "progress=false",
        "tensorboard=false", "num_threads=1", "rollout.max_new_tokens=3",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "objective.num_minibatches=2",
        "task.eval_size=0", "eval_before=false", *extra])


def test_failures_are_counted_per_function_and_logged_once(tmp_path, capsys):
    calls = {"n": 0}
    release = threading.Event()

    def flaky(prompts, completions, **_):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("flaky failed on call 2")
        if calls["n"] == 3:
            release.wait(30)  # hangs past reward.timeout_s on step 3
        return [0.0] * len(completions)

    cfg = _cfg(tmp_path, "f", "steps=4", "reward.max_unscorable_frac=1.0",
               "reward.timeout_s=0.5")
    trainer = Trainer(cfg, reward_fns=[flaky, ok]).setup()
    try:
        trainer.train()
    finally:
        release.set()
    rows = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    # step 2 raises, step 3 hangs, step 4 finds it still hung (not called again)
    assert [r["reward/failures/flaky"] for r in rows if "reward/mean" in r] == [0, 4, 4, 4]
    assert calls["n"] == 3
    assert all(r["reward/failures/ok"] == 0 for r in rows if "reward/mean" in r)
    log = (trainer.run_dir / "reward_errors.log").read_text()
    assert log.count("== reward function 'flaky' first failed at step 2 ==") == 1
    assert "ValueError: flaky failed on call 2" in log and "Traceback" in log
    out = capsys.readouterr().out
    assert out.count("reward function 'flaky' failed at step 2: ValueError") == 1


@pytest.mark.parametrize("extra, fails_from, step", [
    (["steps=1"], 2, 1),  # call 1: step 1's rollout; call 2: the final evaluation
    (["steps=3", "eval_every=2"], 3, 2),  # calls 1, 2: steps 1, 2; call 3: the eval after 2
])
def test_a_reward_failing_in_an_evaluation_is_logged_at_its_step(tmp_path, capsys, extra,
                                                                 fails_from, step):
    """A reward function that first fails on held-out responses (the final evaluation, or an
    ``eval_every`` one) is printed and logged like one failing in a step, at the step the
    evaluation follows (the final one's was never reported)."""
    calls = {"n": 0}

    def flaky(prompts, completions, **_):
        calls["n"] += 1
        if calls["n"] >= fails_from:
            raise ValueError(f"failed on call {calls['n']}")
        return [0.0] * len(completions)

    cfg = _cfg(tmp_path, "e", "task.eval_size=2", "rollout.eval_max_new_tokens=2",
               "reward.max_unscorable_frac=1.0", "save_final=false", *extra)
    trainer = Trainer(cfg, reward_fns=[flaky]).setup()
    trainer.train()
    trainer.cleanup()
    log = (trainer.run_dir / "reward_errors.log").read_text()
    assert log.count(f"== reward function 'flaky' first failed at step {step} ==") == 1
    assert f"ValueError: failed on call {fails_from}" in log
    out = capsys.readouterr().out
    assert out.count(f"reward function 'flaky' failed at step {step}: ValueError") == 1


def test_too_many_unscorable_still_stops_the_run_and_writes_the_log(tmp_path):
    def broken(prompts, completions, **_):
        raise RuntimeError("no scores today")

    trainer = Trainer(_cfg(tmp_path, "b", "steps=2"), reward_fns=[broken]).setup()
    with pytest.raises(RewardError, match="no scores today"):
        trainer.train()
    log = (trainer.run_dir / "reward_errors.log").read_text()
    assert "first failed at step 1" in log and "RuntimeError: no scores today" in log
