"""The link between a trainer and a `gspo engine` (gspo.rollout.remote_engine): how each end
meets the other, gives up, and stops."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from gspo.config import ConfigError, check_engine_address
from gspo.rollout import remote_engine
from gspo.rollout.remote_engine import ENGINE, TRAINER, Unreachable, _join, _Slots


class _GoneTrainer:
    """A weights group whose trainer is gone: every broadcast fails, as gloo's does."""

    def broadcast(self, tensors, opts):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")


def test_the_engine_stops_waiting_for_a_version_once_the_trainer_is_gone():
    """A request for version v arrives while v's broadcast is on its way; the trainer dies
    (the receiving thread's broadcast fails): the wait ends at once with that failure, not
    after --timeout (1800 s by default) with the engine still running."""
    slots = _Slots(_GoneTrainer(), {"float32": 4}, 2, 30.0, [], None)
    slots.thread.join(timeout=10)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="receiving weights from the trainer failed: "
                                           "Connection closed by peer"):
        slots.version(1, 1)
    assert time.monotonic() - start < 5
    assert slots.version(1, None) == -1  # no wait: what it holds


def _in_thread(fn, *args, wait_s: float = 60.0):
    """``fn(*args)``'s exception (None if it returned), from a thread; fails the test when it
    is still running after ``wait_s``."""
    out: list[BaseException | None] = []

    def run():
        try:
            fn(*args)
            out.append(None)
        except BaseException as e:
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(wait_s)
    assert out, f"still waiting after {wait_s} s"
    return out[0]


def test_at_a_file_address_each_end_waits_its_timeout_for_the_other(tmp_path):
    """A file store waits for no one, and its own timeout is 300 s: each end waits for the
    other for its own timeout, then says that no one came (not that gloo could not connect,
    nor a traceback after 300 s)."""
    start = time.monotonic()
    err = _in_thread(_join, f"file://{tmp_path}/a", TRAINER, 2.0)
    assert isinstance(err, Unreachable), err
    assert "no engine joined (start one with `gspo engine ADDRESS`) within 2 s" in str(err)
    err = _in_thread(_join, f"file://{tmp_path}/b", ENGINE, 2.0)
    assert isinstance(err, Unreachable), err
    assert "no trainer to join" in str(err) and "within 2 s" in str(err)
    assert time.monotonic() - start < 30


def test_a_trainer_that_cannot_listen_at_its_address_says_so():
    """The port is taken (another trainer listens there): an error at once that says so, not
    'no engine joined within 1800 s'."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        err = _in_thread(_join, address, TRAINER, 1800.0)
    assert isinstance(err, Unreachable)
    assert str(err).startswith(f"{address}: could not listen there (")
    assert "within" not in str(err)


def test_addresses_that_cannot_work_are_refused():
    """Port 0 (the trainer would listen on a port the engine cannot know) and
    ``file://name/path`` (the file would be ``/path``)."""
    for bad in ("tcp://127.0.0.1:0", "file://shared/store"):
        with pytest.raises(ConfigError, match="must be tcp://HOST:PORT or file:///path"):
            check_engine_address(bad, "address")
    for good in ("tcp://127.0.0.1:29500", "tcp://[::1]:29500", "file:///shared/store"):
        check_engine_address(good, "address")


def test_ctrl_c_stops_a_gspo_engine_that_waits_for_its_trainer(tmp_path):
    """Ctrl-C while `gspo engine` waits in the store (C++, which does not look at Python's
    signals): it exits at once with 130, saying so."""
    store = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-m", "gspo", "engine", f"file://{store}",
                             "--timeout", "120"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not store.exists():  # the engine is at the store, waiting for a trainer
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=20)
        assert code == 130 and proc.stderr.read().strip() == "gspo engine: interrupted"
    finally:
        proc.kill()
        proc.wait()


def test_serve_raises_the_engines_failure_in_the_callers_thread(monkeypatch):
    """:func:`serve` runs the engine in a thread of its own; what it raises (here: no trainer)
    reaches the caller as before."""
    def unreachable(address, device, timeout_s):
        raise Unreachable(f"{address}: no trainer")

    monkeypatch.setattr(remote_engine, "_serve", unreachable)
    with pytest.raises(Unreachable, match="no trainer"):
        remote_engine.serve("tcp://127.0.0.1:1", timeout_s=1)
