"""scripts/thread_invariance.py: the same training steps on several thread counts, weight
hashes compared (whether rollout.async_lend_threads keeps a run bit for bit here)."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "thread_invariance.py"


def _script():
    return runpy.run_path(str(SCRIPT), run_name="thread_invariance")


@pytest.mark.parametrize("hashes, rc", [({1: ["a", "b"], 2: ["a", "b"]}, 0),
                                        ({1: ["a", "b"], 2: ["a", "c"]}, 1)])
def test_the_exit_status_says_whether_every_thread_count_agrees(monkeypatch, capsys, hashes,
                                                                 rc):
    main = _script()["main"]

    def fake_run(cmd, **kwargs):
        threads = int(cmd[cmd.index("--child") + 1])
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(hashes[threads]) + "\n")

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert main(["--model", "m", "--threads", "1,2"]) == rc
    out = capsys.readouterr().out
    assert ("the same bit for bit" in out) == (rc == 0)
    assert ("NOT the same" in out) == (rc == 1)


@pytest.mark.slow
def test_the_tiny_model_trains_to_the_same_bits_on_one_and_two_threads():
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny:llama", "--threads",
                           "1,2"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the same bit for bit on every thread count" in done.stdout
