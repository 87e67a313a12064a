"""reward.isolate=process: a reward that crashes, exits, hangs or allocates without bound is
killed and scored unscorable, the caller goes on, and no process is left (issue 18, item 5)."""

from __future__ import annotations

import math
import os
import textwrap
import time

import psutil
import pytest

from gspo.config import ConfigError, load_config
from gspo.rewards import RewardScorer, RewardSpecError

HOSTILE = '''
import ctypes, os, subprocess, sys, time

def behave(prompts, completions, **columns):
    """What the first prompt says: ok, segfault, exit, hang, grandchild, alloc, raise."""
    what = prompts[0]
    if what == "segfault":
        ctypes.string_at(0)
    elif what == "exit":
        os._exit(3)
    elif what == "hang":
        time.sleep(120)
    elif what == "grandchild":  # a child of the reward's own, then hang
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        time.sleep(120)
    elif what == "alloc":  # grows until killed; stops at 3 GiB so the test can fail safely
        hold = []
        for _ in range(60):
            hold.append(bytearray(50 * 2**20))
            time.sleep(0.01)
    elif what == "raise":
        raise ValueError("reward raised")
    return [float(os.getpid())] * len(completions)
'''


@pytest.fixture
def hostile(tmp_path, monkeypatch) -> str:
    (tmp_path / "hostile_rewards.py").write_text(textwrap.dedent(HOSTILE))
    monkeypatch.syspath_prepend(str(tmp_path))  # the child gets the parent's sys.path
    return "hostile_rewards:behave"


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.status() != "zombie"]


def _scorer(spec, timeout_s=5.0, memory_mb=4096) -> RewardScorer:
    scorer = RewardScorer.from_specs([spec])
    scorer.timeout_s = timeout_s
    scorer.isolate([spec], memory_mb=memory_mb)
    return scorer


def _score(scorer, what, n=3) -> list[float]:
    total, _ = scorer([what] * n, ["c"] * n, {"answer": ["1"] * n})
    return total


def test_a_good_reward_runs_in_one_long_lived_child(hostile):
    before = {p.pid for p in _children()}
    scorer = _scorer(hostile)
    try:
        first, second = _score(scorer, "ok"), _score(scorer, "ok")
        pid = int(first[0])
        assert first == second == [float(pid)] * 3 and pid != os.getpid()
        assert pid in {p.pid for p in _children()} - before
    finally:
        scorer.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
    assert {p.pid for p in _children()} == before


@pytest.mark.parametrize("what, timeout_s, memory_mb, why", [
    ("segfault", 10.0, 4096, "killed by SIGSEGV"),
    ("exit", 10.0, 4096, "exit status 3"),
    ("hang", 1.0, 4096, "RewardTimeout"),
    ("grandchild", 1.5, 4096, "RewardTimeout"),
    ("alloc", 30.0, 300, "RewardMemory"),
    ("raise", 10.0, 4096, "ValueError: reward raised"),
])
def test_a_failing_reward_is_unscorable_and_the_next_batch_is_scored(
        hostile, what, timeout_s, memory_mb, why):
    before = {p.pid for p in _children()}
    scorer = _scorer(hostile, timeout_s=timeout_s, memory_mb=memory_mb)
    try:
        start = time.monotonic()
        assert all(math.isnan(v) for v in _score(scorer, what))
        assert time.monotonic() - start < timeout_s + 5
        assert why in scorer.first_errors[hostile] and scorer.failures[hostile] == 3
        if what != "raise":  # the failed process and everything it started is gone
            assert {p.pid for p in _children()} == before
        again = _score(scorer, "ok")
        assert not math.isnan(again[0])
    finally:
        scorer.close()
    assert {p.pid for p in _children()} == before


def test_the_import_of_a_reward_is_not_the_batch_s_time(tmp_path, monkeypatch):
    """A module that loads a reward model at import may take longer than reward.timeout_s to
    start (in thread mode it imports once, in setup): each (re)started child has
    isolation.LOAD_TIMEOUT_S for that, and the batch its own timeout_s after it."""
    from gspo.rewards import isolation

    (tmp_path / "slow_import_reward.py").write_text(textwrap.dedent("""
        import os, time
        time.sleep(float(os.environ.get("SLOW_IMPORT_S", "2")))

        def score(prompts, completions, **_):
            return [1.0] * len(completions)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SLOW_IMPORT_S", "2")
    spec = "slow_import_reward:score"
    before = {p.pid for p in _children()}
    scorer = _scorer(spec, timeout_s=1.0)
    try:
        assert _score(scorer, "ok") == _score(scorer, "ok") == [1.0] * 3
        assert spec not in scorer.failures
        scorer.processes.workers[spec]._kill()  # a fresh child imports again: still scored
        assert _score(scorer, "ok") == [1.0] * 3
        # an import that never ends is killed past LOAD_TIMEOUT_S
        scorer.processes.workers[spec]._kill()
        monkeypatch.setenv("SLOW_IMPORT_S", "120")
        monkeypatch.setattr(isolation, "LOAD_TIMEOUT_S", 1.5)
        start = time.monotonic()
        assert all(math.isnan(v) for v in _score(scorer, "ok"))
        assert time.monotonic() - start < 10
        assert "RewardTimeout" in scorer.first_errors[spec]
        assert "to load the function" in scorer.first_errors[spec]
        assert {p.pid for p in _children()} == before
    finally:
        scorer.close()
    assert {p.pid for p in _children()} == before


def test_callables_go_by_pickle_and_unpicklable_ones_are_refused(hostile):
    import hostile_rewards

    scorer = RewardScorer.from_specs([hostile_rewards.behave])
    scorer.isolate([hostile_rewards.behave], memory_mb=0)
    try:
        assert int(_score(scorer, "ok")[0]) != os.getpid()
    finally:
        scorer.close()

    def local(prompts, completions, **_):
        return [1.0] * len(completions)

    with pytest.raises(RewardSpecError, match="cannot be pickled"):
        RewardScorer.from_specs([local]).isolate([local], memory_mb=0)


def test_memory_mb_needs_process_isolation():
    assert load_config(None, ["reward.isolate=process", "reward.memory_mb=512"])
    with pytest.raises(ConfigError, match=r"only with reward\.isolate=process"):
        load_config(None, ["reward.memory_mb=512"])


def test_a_run_survives_a_segfaulting_reward_and_leaves_no_process(hostile, tmp_path):
    from gspo.trainer import Trainer

    before = {p.pid for p in _children()}
    cfg = load_config(None, [
        "model=tiny:llama", f"output_dir={tmp_path}", "run_name=iso", "progress=false",
        "tensorboard=false",
        "num_threads=1", "rollout.max_new_tokens=3", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "task.eval_size=0", "eval_before=false", "steps=2",
        "reward.isolate=process", "reward.max_unscorable_frac=1.0",
        "reward.functions=[hostile_rewards:behave, numeric_match]"])
    # the hostile reward reads its instruction from the prompt: make every prompt "segfault"
    trainer = Trainer(cfg).setup()
    original = trainer.task.sample
    trainer.task.sample = lambda n: [type(ex)("segfault", ex.answer, ex.columns)
                                     for ex in original(n)]
    try:
        result = trainer.train()
    finally:
        trainer.cleanup()
    assert result["steps"] == 2
    assert trainer.scorer.failures["hostile_rewards:behave"] == 8
    assert "killed by SIGSEGV" in (trainer.run_dir / "reward_errors.log").read_text()
    assert {p.pid for p in _children()} == before
