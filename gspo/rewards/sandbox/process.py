"""The child process from the parent's side (layers 4 and 10 of the package docstring): read its
output within bounds until it exits or a limit is hit, kill its process group, reap it."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass

from gspo.rewards.sandbox.limits import _Limits
from gspo.rewards.sandbox.protocol import _RESULT_CAP

_TAIL_BYTES = 4096  # how much of stdout / stderr a SandboxResult keeps


class _Tail:
    """Counts bytes and keeps only the last ``_TAIL_BYTES`` of them."""

    def __init__(self) -> None:
        self.total = 0
        self.buf = bytearray()

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self.buf += chunk
        if len(self.buf) > 2 * _TAIL_BYTES:
            del self.buf[:-_TAIL_BYTES]

    def text(self) -> str:
        return bytes(self.buf[-_TAIL_BYTES:]).decode("utf-8", "replace")


def _child_exited(pid: int) -> bool:
    """Whether the child has exited, *without* reaping it (so its pgid cannot be reused)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)


@dataclass
class _Collected:
    out: _Tail
    err: _Tail
    result: bytearray
    timed_out: bool = False
    output_exceeded: bool = False


def _collect(proc: subprocess.Popen, result_r: int, limits: _Limits,
             deadline: float) -> _Collected:
    """Read stdout, stderr and the result pipe until the child is gone or a limit is hit."""
    assert proc.stdout is not None and proc.stderr is not None
    got = _Collected(_Tail(), _Tail(), bytearray())
    sel = selectors.DefaultSelector()
    sinks = {proc.stdout.fileno(): "out", proc.stderr.fileno(): "err", result_r: "res"}
    for fd, name in sinks.items():
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ, name)
    exited_at: float | None = None
    try:
        while True:
            now = time.monotonic()
            if exited_at is None and now >= deadline:
                got.timed_out = True
                return got
            if exited_at is not None and (not sel.get_map() or now >= exited_at + 0.5):
                return got  # 0.5 s grace to drain pipes after the group was killed
            budget = deadline - now if exited_at is None else exited_at + 0.5 - now
            step = 0.05 if sel.get_map() else 0.005  # all pipes closed: just poll for the exit
            for key, _ in sel.select(timeout=max(0.0, min(step, budget))):
                try:
                    chunk = os.read(key.fd, 65_536)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                if key.data == "res":
                    got.result += chunk
                    if len(got.result) > _RESULT_CAP:
                        return got  # far more than two records: tampering
                else:
                    (got.out if key.data == "out" else got.err).add(chunk)
                    if got.out.total + got.err.total > limits.max_output_bytes:
                        got.output_exceeded = True
                        return got
            if exited_at is None and _child_exited(proc.pid):
                exited_at = time.monotonic()
                _kill_group(proc.pid)  # whatever it left behind in its group
    finally:
        sel.close()
        # whatever already sits in the result pipe (the setup record at least) still counts
        while len(got.result) <= _RESULT_CAP:
            try:
                chunk = os.read(result_r, 65_536)
            except OSError:
                break
            if not chunk:
                break
            got.result += chunk


def _reap(proc: subprocess.Popen | None) -> int | None:
    """Kill the child's group (before reaping, so the pgid is still ours) and reap it."""
    if proc is None:
        return None
    if proc.returncode is None:
        _kill_group(proc.pid)
    try:
        returncode = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # stuck in the kernel; leave it to Popen's cleanup
        returncode = None
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    return returncode
