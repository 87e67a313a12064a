"""The child side of ``reward.isolate=process``: one reward function served in its own process.

Started by :class:`gspo.rewards.isolation.RewardProcess` as
``python -m gspo.rewards.reward_worker FD PARENT_PID``; ``FD`` is its end of a socket pair.
The first message names the function (see :func:`load`), answered by ``("loaded", error)``
once it is imported (the parent's batch timeout starts after that); every later one is a batch
``(prompts, completions, columns)`` answered by ``("ok", values)`` or ``("error", traceback)``;
``None`` or the parent closing its end ends the process. Only the parent enforces limits
(timeout, memory): this side just computes, and dies with its parent.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import runpy
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h): a signal for us when the parent dies


def die_with_parent(parent_pid: int) -> None:
    """Get SIGKILL when the trainer dies, even one killed with SIGKILL (Linux; elsewhere the
    closed socket ends the loop once the reward returns)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def load(message: tuple[str, ...]) -> Any:
    """The reward function from ``("spec", name_or_module_function)``, ``("pickle", bytes)`` or
    ``("main", script_path, qualname)`` (a function of the user's script, whose top level is
    run again here under the name ``__gspo_main__``, as multiprocessing's spawn does)."""
    kind = message[0]
    if kind == "spec":
        from gspo.rewards.functions import resolve_reward

        return resolve_reward(message[1])
    if kind == "pickle":
        return pickle.loads(message[1])
    if kind == "main":
        namespace = runpy.run_path(message[1], run_name="__gspo_main__")
        obj: Any = namespace[message[2].split(".")[0]]
        for part in message[2].split(".")[1:]:
            obj = getattr(obj, part)
        return obj
    raise ValueError(f"unknown reward payload {kind!r}")


def serve(conn: Connection) -> None:
    """Answer batches until the parent says stop or goes away."""
    fn: Any = None
    load_error = ""
    try:
        fn = load(conn.recv())
    except EOFError:
        return
    except BaseException:  # a reward module failing to import: every batch reports why
        load_error = traceback.format_exc(limit=5)
    conn.send(("loaded", load_error))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        prompts, completions, columns = message
        if load_error:
            reply: tuple[str, Any] = ("error", load_error)
        else:
            try:
                reply = ("ok", list(fn(prompts, completions, **columns)))
            except BaseException:  # also SystemExit: a reward must not end its server quietly
                reply = ("error", traceback.format_exc(limit=5))
        try:
            conn.send(reply)
        except Exception:  # values that cannot be pickled
            conn.send(("error", traceback.format_exc(limit=3)))


def main(argv: list[str]) -> int:
    fd, parent_pid = int(argv[0]), int(argv[1])
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    serve(Connection(fd))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
