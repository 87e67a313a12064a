"""``reward.isolate=process``: each reward function runs in a process of its own.

A thread cannot be killed and shares the trainer's fate: a reward that segfaults in a C
extension or calls ``os._exit`` ends the trainer, and one that hangs stays alive. Here every
function gets one long-lived child (:mod:`gspo.rewards.reward_worker`), started on first use
and fed one batch at a time over a socket pair. The parent waits for the answer and

- past ``timeout_s`` kills the child's whole process group (``SIGKILL``): unscorable. The
  time a (re)started child takes to import the function (a module that loads a reward model
  at import) is not the batch's: it has :data:`LOAD_TIMEOUT_S` of its own;
- past ``memory_mb`` of resident memory (read from ``/proc`` every ``POLL_S``) does the same;
- when the child dies (a signal, ``os._exit``), reports how: unscorable;

and starts a fresh child for the next batch. :meth:`RewardProcesses.close` (the trainer's
``cleanup``, and ``atexit``) stops them all; a child also gets ``SIGKILL`` when the trainer
dies (``PR_SET_PDEATHSIG``). This is fault isolation for the user's own code, not a sandbox
for untrusted code (that is :mod:`gspo.rewards.sandbox`): the child inherits the environment.

The function reaches the child by name (a registered reward or ``module:function``), as a
pickle (a module-level function), or, for a function of the script being run, by re-running
that script under the name ``__gspo_main__`` (so its training code must sit under
``if __name__ == "__main__":``, as with multiprocessing).
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from gspo.rewards.functions import RewardSpecError

POLL_S = 0.02  # how often the parent checks the child's memory while it waits
LOAD_TIMEOUT_S = 600.0  # a (re)started child's import of the function, before its first batch
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class IsolatedFailure(Exception):
    """A batch the child did not score: ``report`` says why (a traceback or one line)."""

    def __init__(self, report: str) -> None:
        super().__init__(report)
        self.report = report


def payload(name: str, spec: Any) -> tuple[Any, ...]:
    """How the child finds the function of ``spec`` (see the module docstring)."""
    if isinstance(spec, str):
        return ("spec", spec)
    main = sys.modules.get("__main__")
    if getattr(spec, "__module__", None) == "__main__" and getattr(main, "__file__", None):
        if "<locals>" not in spec.__qualname__:
            return ("main", os.path.abspath(main.__file__), spec.__qualname__)  # type: ignore[union-attr]
    try:
        return ("pickle", pickle.dumps(spec))
    except Exception as e:
        raise RewardSpecError(f"reward '{name}' cannot run with reward.isolate=process: it cannot "
                         f"be pickled ({type(e).__name__}); define it at the top level of an "
                         "importable module") from None


def resident_bytes(pid: int) -> int:
    """Resident memory of ``pid`` (Linux ``/proc``; 0 where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class RewardProcess:
    """One reward function's child process, restarted after every failure."""

    def __init__(self, name: str, spec: Any, *, memory_mb: int) -> None:
        self.name, self.memory_mb = name, memory_mb
        self.payload = payload(name, spec)
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self.starts = 0

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gspo.rewards.reward_worker", str(theirs.fileno()),
                 str(os.getpid())], pass_fds=(theirs.fileno(),), env=env,
                stdin=subprocess.DEVNULL, start_new_session=True)  # its own group: killpg
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(self.payload)
        self.starts += 1

    def _kill(self) -> int | None:
        """SIGKILL the child's process group, reap it; its exit code."""
        proc, self.proc = self.proc, None
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
        return proc.wait()

    def call(self, prompts: list[str], completions: list[str], columns: dict[str, list],
             timeout_s: float) -> list[Any]:
        """The function's values for one batch, or :class:`IsolatedFailure`."""
        if self.proc is None or self.proc.poll() is not None:
            self._kill()  # reap a child that died between batches
            self._start()
            self._receive(LOAD_TIMEOUT_S, "to load the function")  # ("loaded", _)
        assert self.conn is not None and self.proc is not None
        try:
            self.conn.send((prompts, completions, columns))
        except (BrokenPipeError, ConnectionResetError, EOFError):
            raise self._died() from None
        except Exception as e:  # columns that cannot be pickled
            raise IsolatedFailure(f"{type(e).__name__}: the batch cannot be sent to {self.name}'s "
                                  f"process ({e})") from None
        kind, value = self._receive(timeout_s, f"on a batch of {len(completions)}",
                                    "reward.timeout_s=")
        if kind == "error":
            raise IsolatedFailure(value)
        return value

    def _receive(self, timeout_s: float, doing: str, setting: str = "") -> tuple[str, Any]:
        """The child's next message, waited for at most ``timeout_s`` (0: no limit) and within
        the memory limit; ``doing`` and ``setting`` word the timeout's report."""
        assert self.conn is not None and self.proc is not None
        deadline = time.monotonic() + timeout_s if timeout_s else float("inf")
        limit = self.memory_mb * 2**20
        while not self.conn.poll(POLL_S):
            if time.monotonic() > deadline:
                self._kill()
                raise IsolatedFailure(
                    f"RewardTimeout: {self.name} took longer than {setting}{timeout_s:g} s "
                    f"{doing}; its process was killed")
            if limit and resident_bytes(self.proc.pid) > limit:
                self._kill()
                raise IsolatedFailure(
                    f"RewardMemory: {self.name} used more than reward.memory_mb="
                    f"{self.memory_mb} MiB of resident memory; its process was killed")
        try:
            return self.conn.recv()
        except (EOFError, ConnectionResetError):
            raise self._died() from None

    def _died(self) -> IsolatedFailure:
        proc = self.proc
        code = proc.wait(timeout=10) if proc is not None else None
        self._kill()
        return IsolatedFailure(f"RewardCrash: {self.name}'s process died ({describe_exit(code)}) "
                               "while scoring a batch; a fresh one scores the next")

    def close(self) -> None:
        if self.conn is not None and self.proc is not None and self.proc.poll() is None:
            try:
                self.conn.send(None)  # ask it to leave; a hung child is killed below
                self.proc.wait(timeout=1.0)
            except (OSError, EOFError, subprocess.TimeoutExpired):
                pass
        self._kill()


class RewardProcesses:
    """The processes of the isolated functions, by name; ``close`` stops every one."""

    def __init__(self, names: Sequence[str], specs: Sequence[Any], *, memory_mb: int) -> None:
        self.workers = {name: RewardProcess(name, spec, memory_mb=memory_mb)
                        for name, spec in zip(names, specs)}
        # Runs on close(), when this object is collected, or at interpreter exit.
        self._finalizer = weakref.finalize(self, _close_all, list(self.workers.values()))

    def __contains__(self, name: str) -> bool:
        return name in self.workers

    def call(self, name: str, prompts: list[str], completions: list[str],
             columns: dict[str, list], timeout_s: float) -> list[Any]:
        return self.workers[name].call(prompts, completions, columns, timeout_s)

    def close(self) -> None:
        self._finalizer()


def _close_all(workers: list[RewardProcess]) -> None:
    for w in workers:
        w.close()
