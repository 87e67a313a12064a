"""Launching commands that start processes of their own (torchrun and its workers) from tests.

``pyproject.toml`` puts this folder on the tests' import path: ``from proc_session import
run_session``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

SUPPORT = os.path.dirname(os.path.abspath(__file__))


def with_support(env: dict[str, str] | None) -> dict[str, str]:
    """``env`` (default: this process's) with this folder on ``PYTHONPATH``: a child that
    imports a test module (an engine unpickling a test's environment class, say) can then
    import these helpers as the test module does."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SUPPORT, env.get("PYTHONPATH")) if p)
    return env


def run_session(cmd: list[str], *, timeout: float, **kw: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)`` for a
    command that starts processes of its own. The command runs in a session of its own, and
    when it outlives ``timeout`` (or the test stops while it runs) the whole session is
    killed. ``subprocess.run`` kills only the command: torchrun's workers keep running, and
    its wait for their output then hangs the test for as long as they live. The command's
    environment gets this folder on ``PYTHONPATH`` (:func:`with_support`)."""
    kw["env"] = with_support(kw.get("env"))
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:  # timed out, or interrupted
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
