"""The async engine process when its trainer fails: interrupted while the engine starts, or
killed with batches asked ahead (gspo.rollout.async_engine)."""

from __future__ import annotations

import queue

import pytest

from gspo.models import load_model, token_logprobs
from gspo.rollout import SamplingParams, async_engine
from gspo.rollout.async_engine import AsyncEngine, Recompute, Request, _next_request
from gspo.rollout.engine import EngineOptions


class _DeadParent:
    def is_alive(self) -> bool:
        return False


def test_an_engine_whose_trainer_is_gone_samples_none_of_the_batches_asked_ahead(monkeypatch):
    """A SIGKILLed trainer leaves the k batches it asked ahead in the request queue: the
    engine process must stop instead of sampling each of them for no one (minutes each on a
    real model, with its weights and the GPU held)."""
    requests: queue.Queue = queue.Queue()
    for step in range(2):
        requests.put(Request(step, 0, [[1, 2]], 2, SamplingParams(3, 1.0), [0], False))
    monkeypatch.setattr(async_engine.mp, "parent_process", _DeadParent)
    assert _next_request(requests) is None


@pytest.mark.slow
def test_an_engine_interrupted_while_it_starts_is_stopped(monkeypatch):
    """A Ctrl-C while the engine process starts (vLLM takes minutes) reaches the trainer in
    AsyncEngine's wait for it, before anyone holds the engine to close it: the process must be
    stopped there. Left running, it outlived the interpreter's exit, whose join of a daemon
    process that ignores SIGTERM waited forever (``gspo train`` printed "interrupted" and
    hung)."""
    seen: list[AsyncEngine] = []

    def interrupted(self: AsyncEngine, timeout_s: float) -> None:
        seen.append(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(AsyncEngine, "_get", interrupted)
    model, tok = load_model("tiny:llama", seed=0)
    with pytest.raises(KeyboardInterrupt):
        AsyncEngine(model, tok, engine="hf", opts=EngineOptions(), steps_ahead=1, threads=1,
                    recompute=Recompute(token_logprobs, 1.0, 8, 0))
    (engine,) = seen
    try:
        assert not engine.proc.is_alive()
    finally:
        if engine.proc.is_alive():
            engine.proc.kill()
            engine.proc.join()


ENGINE_KILLED_MID_BATCH = '''
import os, signal, time
from gspo.models import load_model, token_logprobs
from gspo.rollout import SamplingParams
from gspo.rollout.async_engine import AsyncEngine, Recompute, Request
from gspo.rollout.engine import EngineOptions

if __name__ == "__main__":
    model, tok = load_model("tiny:llama", seed=0)
    eng = AsyncEngine(model, tok, engine="hf", opts=EngineOptions(), steps_ahead=1, threads=1,
                      recompute=Recompute(token_logprobs, 1.0, 8, 0))
    for step in range(2):  # each batch more than a pipe holds (64 KiB)
        eng.submit(Request(step, 0, [[200 + i] * 400 for i in range(16)], 16,
                           SamplingParams(4, 1.0), list(range(16)), False))
    while not eng.idle():  # both sampled ahead while the trainer trains
        time.sleep(0.1)
    time.sleep(2.0)  # the pipe now holds the start of the first batch, the rest waits
    os.kill(eng.proc.pid, signal.SIGKILL)  # the engine dies (the OOM killer, kill -9)
    try:
        eng.take(timeout_s=30)
    except RuntimeError as e:
        print(e)
    eng.close()
'''


@pytest.mark.slow
def test_an_engine_killed_in_the_middle_of_a_batch_is_a_clear_error(tmp_path):
    """An engine ahead of its trainer holds a finished batch half-written in the full pipe
    until take() reads it: killed then, the trainer read the half and waited for the rest
    forever (past take's own timeout), since it held the pipe's writing end open itself."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "trainer.py"
    script.write_text(ENGINE_KILLED_MID_BATCH)
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(script)], timeout=240, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rollout engine process died (exit code -9)" in proc.stdout
