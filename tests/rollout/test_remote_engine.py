"""The link between a trainer and a `gspo engine` (gspo.rollout.remote_engine): how each end
meets the other, gives up, and stops."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

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
    code, err = _interrupt_a_waiting_engine(tmp_path / "store")
    assert code == 130 and err.strip() == "gspo engine: interrupted"


def _interrupt_a_waiting_engine(store: Path) -> tuple[int, str]:
    """Start `gspo engine file://STORE`, Ctrl-C it once it waits there for its trainer; its
    exit code and stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "gspo", "engine", f"file://{store}",
                             "--timeout", "120"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not store.exists():  # the engine is at the store, waiting for a trainer
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        return proc.wait(timeout=20), proc.stderr.read()
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_at_a_tcp_address_the_engine_waits_its_timeout_not_twice_it():
    """No trainer listens: the engine gives up after its timeout (TCPStore's own connect
    retried for a second timeout, and more: 4 s took 7.3 s)."""
    start = time.monotonic()
    err = _in_thread(_join, f"tcp://127.0.0.1:{_free_port()}", ENGINE, 4.0)
    waited = time.monotonic() - start
    assert isinstance(err, Unreachable) and "no trainer to join" in str(err), err
    assert "within 4 s" in str(err)
    assert 4.0 <= waited < 5.5, waited


def test_the_trainers_wait_for_its_engine_can_be_configured(tmp_path):
    """``rollout.async_timeout_s``: how long the trainer waits for its engine (it was a fixed
    1800 s); checked, and only with an address."""
    from gspo.config import load_config
    from gspo.trainer import Trainer

    with pytest.raises(ConfigError, match="async_timeout_s must be a number > 0"):
        load_config(None, ["rollout.async_steps=1", "rollout.async_timeout_s=0",
                           "rollout.async_address=tcp://127.0.0.1:29500"])
    with pytest.raises(ConfigError, match=r"async_timeout_s is used only with "
                                          r"rollout\.async_address"):
        load_config(None, ["rollout.async_steps=1", "rollout.async_timeout_s=60"])
    address = f"tcp://127.0.0.1:{_free_port()}"
    cfg = load_config(None, [
        "model=tiny:llama", f"output_dir={tmp_path}", "run_name=t", "progress=false",
        "tensorboard=false", "num_threads=1", "rollout.max_new_tokens=4",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "task.eval_size=0", "steps=1",
        "eval_before=false", "rollout.async_steps=1", f"rollout.async_address={address}",
        "rollout.async_timeout_s=2"])
    start = time.monotonic()
    with pytest.raises(Unreachable, match=r"no engine joined .* within 2 s"):
        Trainer(cfg).setup()
    assert time.monotonic() - start < 60


_WAITING_TRAINER = """
import sys
from gspo.rollout.remote_engine import _join
print("waiting", flush=True)
try:
    _join(sys.argv[1], 0, 120.0)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


@pytest.mark.parametrize("scheme", ["tcp", "file"])
def test_ctrl_c_stops_a_trainer_that_waits_for_its_engine(tmp_path, scheme):
    """The trainer's wait for its engine ran in the store's C++ code, which does not look at
    Python's signals: a Ctrl-C to `gspo train` went unheeded for the whole wait (1800 s by
    default). It stops the wait at once now."""
    address = (f"tcp://127.0.0.1:{_free_port()}" if scheme == "tcp"
               else f"file://{tmp_path}/store")
    proc = subprocess.Popen([sys.executable, "-c", _WAITING_TRAINER, address],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "waiting"
        time.sleep(2.0)  # in the wait
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
        assert out.strip() == "interrupted"
    finally:
        proc.kill()
        proc.wait()


_PAIR_THAT_DIES = """
import os, sys, time
from gspo.rollout.remote_engine import _join
os.remove = lambda path: None  # killed before its store file could be removed
groups = _join(sys.argv[1], int(sys.argv[2]), 120.0)
print("met", flush=True)
time.sleep(600)
"""


def _a_pair_meets_and_dies(address: str) -> None:
    """A trainer and an engine meet at ``address``, then both are killed (SIGKILL)."""
    pair = [subprocess.Popen([sys.executable, "-c", _PAIR_THAT_DIES, address, str(rank)],
                             stdout=subprocess.PIPE, text=True) for rank in (TRAINER, ENGINE)]
    try:
        assert [p.stdout.readline().strip() for p in pair] == ["met", "met"]
    finally:
        for p in pair:
            p.kill()
            p.wait()


def test_a_store_file_left_by_a_pair_that_died_does_not_stop_the_next_pair(tmp_path, capfd):
    """A pair killed after it met left its store file, with its gloo addresses, at the file
    address: the next pair there waited for them (with a 15 s timeout, 75 s) and failed with
    'gloo could not connect'. The trainer removes such a file (saying so), the engine waits
    for it to; a pair that met leaves no file."""
    from gspo.rollout.remote_engine import _broadcast

    store = tmp_path / "store"
    address = f"file://{store}"
    _a_pair_meets_and_dies(address)
    assert store.exists()
    joined: dict[int, tuple] = {}

    def join(rank):
        joined[rank] = _join(address, rank, 30.0)
        t = torch.tensor([7 if rank == TRAINER else 0])
        _broadcast(joined[rank][1], t)
        assert int(t) == 7

    start = time.monotonic()
    engine = threading.Thread(target=lambda: _in_thread(join, ENGINE, wait_s=40), daemon=True)
    engine.start()  # the engine first, at the stale file
    time.sleep(1.0)
    assert _in_thread(join, TRAINER, wait_s=40) is None
    engine.join(40)
    assert sorted(joined) == [TRAINER, ENGINE] and time.monotonic() - start < 20
    assert not store.exists()  # removed once both ends had their groups
    assert f"gspo: removed {store}, the store file of an earlier" in capfd.readouterr().err


def test_gspo_engine_refuses_a_timeout_that_is_not_a_positive_number(capsys):
    """``--timeout 0`` waited for a trainer for ever (0 is no timeout to the file store) and
    ``--timeout nan`` ended in a traceback."""
    from gspo.cli import main

    for bad in ("0", "-5", "nan"):
        with pytest.raises(SystemExit) as exit_:
            main(["engine", "file:///tmp/gspo-no-such-store", f"--timeout={bad}"])
        assert exit_.value.code == 2
        assert "--timeout must be a number > 0" in capsys.readouterr().err


_ENGINE_KILLED_AS_IT_JOINS = """
import os, signal, sys
from gspo.rollout import remote_engine
# met the trainer at the address, then killed before it gave its gloo address
remote_engine._device = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
print("imported", flush=True)
remote_engine._join(sys.argv[1], 1, 60.0)
"""


def test_an_engine_killed_as_it_joins_is_said_to_be_gone():
    """An engine killed in the instant after it met its trainer: the trainer said that gloo
    could not connect to the address the engine gave (it gave none) and to set
    GLOO_SOCKET_IFNAME. It says the engine went away."""
    address = f"tcp://127.0.0.1:{_free_port()}"
    engine = subprocess.Popen([sys.executable, "-c", _ENGINE_KILLED_AS_IT_JOINS, address],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout.readline().strip() == "imported"
        err = _in_thread(_join, address, TRAINER, 5.0, wait_s=90)
        assert engine.wait(timeout=30) == -signal.SIGKILL
    finally:
        engine.kill()
        engine.wait()
    assert isinstance(err, Unreachable), err
    assert str(err) == (f"{address}: the engine met this end there, then went away (stopped "
                        "or killed) before it connected")


def test_a_dead_pairs_store_file_is_told_by_its_marker_not_by_its_bytes(tmp_path, capfd):
    """Whether a store file at a file address is a dead pair's was read from the file's
    bytes (the key names in torch's FileStore format): a store in another format (here: the
    dead pair's file rewritten) was taken for a live one, and the next pair failed. The
    trainer marks a pair's meeting in a file of its own beside the store file."""
    store = tmp_path / "store"
    address = f"file://{store}"
    _a_pair_meets_and_dies(address)
    store.write_bytes(bytes(range(256)) * 4)  # the dead pair's store, in a format unknown here
    err = _in_thread(_join, address, TRAINER, 3.0, wait_s=60)
    assert isinstance(err, Unreachable) and "no engine joined" in str(err), err
    assert f"gspo: removed {store}, the store file of an earlier" in capfd.readouterr().err
    assert not (tmp_path / "store.met").exists()


_PATIENT_ENGINE_PAIR_S = 3.0


def test_a_trainer_busier_than_the_engines_timeout_keeps_its_engine(tmp_path):
    """The engine waited for the trainer's next request and its next weights for --timeout:
    an evaluation or an update longer than that killed a healthy pair (the engine timed out,
    the trainer's next take failed: 'Connection closed by peer'). It waits for them as long
    as the trainer is there; --timeout bounds its wait for the trainer to join and for each
    message's rest."""
    from gspo.models import load_model, token_logprobs
    from gspo.rollout.async_engine import Recompute, Request
    from gspo.rollout.engine import EngineOptions, SamplingParams
    from gspo.rollout.remote_engine import RemoteEngine

    address = f"file://{tmp_path}/store"
    model, tok = load_model("tiny:llama", seed=0)
    engine = subprocess.Popen([sys.executable, "-m", "gspo", "engine", address, "--timeout",
                               str(_PATIENT_ENGINE_PAIR_S)], stderr=subprocess.PIPE, text=True)
    try:
        eng = RemoteEngine(model, tok, address=address, engine="hf", opts=EngineOptions(),
                           steps_ahead=1, threads=1,
                           recompute=Recompute(token_logprobs, 1.0, 8, 0), timeout_s=120)
        try:
            eng.submit(Request(0, 0, [[1, 2, 3]], 2, SamplingParams(4, 1.0), [5], False))
            assert eng.take()[0] == 0
            time.sleep(2.5 * _PATIENT_ENGINE_PAIR_S)  # a long evaluation, update, checkpoint
            eng.publish(model, 1)
            eng.submit(Request(1, 1, [[1, 2, 3]], 2, SamplingParams(4, 1.0), [5], False))
            assert eng.take()[0] == 1
        finally:
            eng.close()
        assert engine.wait(timeout=60) == 0, engine.stderr.read()
    finally:
        engine.kill()
        engine.wait()


def _pair_talks(trainer_groups, engine_groups) -> None:
    """Both of the trainer's groups lead to this engine: a message and a weights broadcast
    from the trainer arrive (within 20 s each)."""
    import datetime

    from gspo.rollout.remote_engine import _broadcast, _Messages

    got: dict[str, object] = {}

    def engine():
        t = torch.zeros(1, dtype=torch.long)
        _broadcast(engine_groups[1], t, datetime.timedelta(seconds=20))
        got["weights"] = int(t)
        got["message"] = _Messages(engine_groups[0], TRAINER).recv(datetime.timedelta(seconds=20))

    receiver = threading.Thread(target=lambda: _in_thread(engine, wait_s=60), daemon=True)
    receiver.start()
    _broadcast(trainer_groups[1], torch.tensor([7]), datetime.timedelta(seconds=20))
    sender = _Messages(trainer_groups[0], ENGINE)
    sender.send("setup")
    sender.flush()
    receiver.join(60)
    assert got == {"weights": 7, "message": "setup"}


def test_a_second_engine_at_one_trainers_address_is_refused():
    """Two `gspo engine`s started for one trainer's address (one left from an earlier try,
    or two ranks' addresses mixed up): both joined, and the trainer's two groups could each
    lead to another engine (its set-up to one, its weights to the other: each then waited
    for the rest until its --timeout). The second is refused, saying so."""
    address = f"tcp://127.0.0.1:{_free_port()}"
    joined: dict[str, tuple] = {}
    failed: dict[str, BaseException] = {}

    def join(name: str, rank: int) -> None:
        try:
            joined[name] = _join(address, rank, 20.0)
        except Unreachable as e:
            failed[name] = e

    threads = [threading.Thread(target=join, args=args, daemon=True)
               for args in (("trainer", TRAINER), ("a", ENGINE), ("b", ENGINE))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert "trainer" in joined and len(failed) == 1, (sorted(joined), failed)
    (loser, err), = failed.items()
    assert str(err) == (f"{address}: another engine has already met the trainer there (one "
                        "trainer and one engine per address)")
    _pair_talks(joined["trainer"], joined[({"a", "b"} - {loser}).pop()])


def test_an_engine_stopped_while_it_waited_at_a_file_address_is_not_met(tmp_path):
    """A `gspo engine` stopped (Ctrl-C) while it waited for its trainer at a file address
    left its key in the store file: the next trainer there took it for its engine, waited for
    that engine's gloo address (rollout.async_timeout_s, 30 min by default) and failed ('the
    engine met this end there, then went away'), while the new engine waited behind the
    trainer's marker as long. The next pair meets."""
    store = tmp_path / "store"
    address = f"file://{store}"
    assert _interrupt_a_waiting_engine(store)[0] == 130
    assert store.exists()
    joined: dict[int, tuple] = {}

    def join(rank: int) -> None:
        joined[rank] = _join(address, rank, 10.0)

    trainer = threading.Thread(target=lambda: _in_thread(join, TRAINER, wait_s=60), daemon=True)
    trainer.start()
    time.sleep(1.0)  # the trainer first: it finds the stopped engine's key
    assert _in_thread(join, ENGINE, wait_s=60) is None
    trainer.join(60)
    assert sorted(joined) == [TRAINER, ENGINE]
    _pair_talks(joined[TRAINER], joined[ENGINE])


def test_a_trainer_whose_host_does_not_resolve_says_so_at_once():
    """A trainer's address whose host name does not resolve (a typo): TCPStore's client
    retried it for about twice rollout.async_timeout_s (an hour by default), printing a C++
    warning and stack each time, then said that a client socket had timed out. It fails at
    once, saying the name does not resolve."""
    address = f"tcp://no-such-host.invalid:{_free_port()}"
    start = time.monotonic()
    err = _in_thread(_join, address, TRAINER, 30.0, wait_s=90)
    assert isinstance(err, Unreachable), err
    assert str(err).startswith(f"{address}: could not listen there ([Errno -")
    assert time.monotonic() - start < 10
