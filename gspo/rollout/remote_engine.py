"""``rollout.async_address``: the async rollout engine in a process started elsewhere, reached
over ``torch.distributed``.

:class:`gspo.rollout.async_engine.AsyncEngine` spawns its engine process on the trainer's
machine and shares the weight slots with it in memory. Here the engine is started on its own,
on an inference machine or beside the trainer, with ``gspo engine ADDRESS`` (:func:`serve`),
and the trainer (:class:`RemoteEngine`, same ``publish / submit / take / close`` as
``AsyncEngine``) meets it at ``ADDRESS``: ``tcp://HOST:PORT`` (where the trainer listens) or
``file:///shared/path``. The two form a world of two processes (trainer rank 0, engine rank 1)
of their own: a store at that address and two gloo process groups built on it directly,
outside any default group. So a trainer rank under torchrun keeps its world for DDP / FSDP2
and links to an engine of its own, at its own address. The two groups:

- **messages** (point to point): the set-up (the model without its weights,
  the tokenizer, the engine's options), then requests one way and batches the other, each a
  pickled object in a uint8 tensor after its length. Sends do not wait for the receiver, so
  the trainer trains while a request is in flight and the engine samples on while a batch
  waits to be taken.
- **weights** (a second group): after every update the trainer broadcasts a header (the
  version, and whether the whole policy follows) and then one flat buffer per dtype, its
  policy copied into one send buffer; for a LoRA policy whose slot on the engine already holds
  the base weights, only the adapter's tensors, packed the same way. The broadcast runs in a
  thread of the trainer's (:meth:`RemoteEngine.publish` returns once the buffers are filled),
  so the trainer trains on while the weights cross the network; the next publish first waits
  for it, since it refills the same buffers. The
  engine keeps the ``k + 1`` slots in its own memory and a thread that waits in that broadcast
  and fills slot ``version % (k + 1)``. The argument of :mod:`gspo.rollout.async_engine` for
  why ``k + 1`` slots need no lock holds unchanged: the trainer publishes version ``v`` only
  after it has *received* the batch of step ``v - 1``, which the engine sends once it has
  finished reading slot ``v - k - 1``. A request whose version has not arrived yet waits for
  it.

The engine samples exactly as the local engine process does (the same
:func:`gspo.rollout.async_engine.run_engine`), so for the same weights it returns the same
batches. Both ends must run the same gspo and torch versions (they exchange pickles). Each
end binds gloo to its own address on the route to the trainer's host, or with a file address
to its address as other machines reach it (:mod:`gspo.rollout.gloo_net`). Tested between two
processes on one machine (``tcp://127.0.0.1``) and between network namespaces of one machine,
each with a network stack of its own, joined by virtual Ethernet links, over IPv4 and over
IPv6 only, at a TCP and at a file address (``tests/trainer/test_network_hosts.py``); not
between two physical machines.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gspo.config import check_engine_address
from gspo.rollout.async_engine import (
    Recompute,
    Request,
    _layout,
    _skeleton,
    changing,
    distinct,
    entry_bytes,
    fill_slot,
    pack,
    packed_buffers,
    run_engine,
    unpack,
)
from gspo.rollout.engine import EngineOptions
from gspo.rollout.gloo_net import IFNAME, bind_source, device_at

TRAINER, ENGINE = 0, 1
STOP = -1  # a weights header that ends the engine's receiving thread
BINDS = "binds_"  # store keys: BINDS + rank, the address that end's gloo device binds to
JOINED = "joined_"  # store keys: JOINED + rank, while that end is there waiting or joined
CLAIMS = "claims_"  # store keys: CLAIMS + rank, how many ends of that rank met the other there
POLL_S = 0.1  # how often a waiting end looks for the other (a Ctrl-C stops it between looks)
# The engine's wait for the trainer's next request or weights: no time limit. The trainer may
# evaluate, update or checkpoint for longer than any --timeout; if its process dies, its
# connections close and the wait fails at once ("Connection closed by peer").
FOREVER = datetime.timedelta(days=3650)


def _broadcast(group: Any, t: torch.Tensor, timeout: datetime.timedelta | None = None
               ) -> None:
    """``t`` from the trainer to the engine over ``group`` (in place on the engine), within
    ``timeout`` (None: the group's)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = TRAINER
    if timeout is not None:
        opts.timeout = timeout
    group.broadcast([t], opts).wait()


class _Messages:
    """Pickled objects to and from the other process over the messages group."""

    def __init__(self, group: Any, peer: int) -> None:
        self.group, self.peer = group, peer
        self.pending: list[tuple[Any, torch.Tensor]] = []  # sends in flight and their tensors

    def send(self, obj: Any) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long)
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]
        self.pending += [(self.group.send([size], self.peer, 0), size),
                         (self.group.send([data], self.peer, 0), data)]

    def recv(self, timeout: datetime.timedelta | None = None) -> Any:
        """The next object; its start within ``timeout`` (None: the group's), its rest within
        the group's."""
        size = torch.zeros(1, dtype=torch.long)
        work = self.group.recv([size], self.peer, 0)
        work.wait() if timeout is None else work.wait(timeout)
        data = torch.empty(int(size), dtype=torch.uint8)
        self.group.recv([data], self.peer, 0).wait()
        return pickle.loads(data.numpy().tobytes())

    def flush(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending = []


class Unreachable(ConnectionError):
    """The other end did not join at the address in time."""


class _Alone(Exception):
    """The deadline passed with no one at the other end."""


class _Taken(Exception):
    """Another end of this rank met the other end at the address first."""


def _store(address: str, rank: int, timeout: datetime.timedelta, deadline: float) -> Any:
    """The key-value store the two processes meet through: a TCP store served by the trainer
    (tcp://HOST:PORT) or a shared file (file:///path). Built here rather than by
    ``torch.distributed.rendezvous``, which under torchrun would look for torchrun's own
    store at ``HOST:PORT``. The engine connects to the trainer's TCP store by the
    ``deadline`` (``TCPStore``'s own connect waits up to twice its timeout); ``timeout`` is
    then the store's, for each of its waits."""
    check_engine_address(address, "address")
    url = urllib.parse.urlparse(address)
    if url.scheme == "file":
        _clear_stale(url.path, rank, deadline)
        store = dist.FileStore(url.path, 2)
        store.set_timeout(timeout)  # its own default is 300 s, whatever the caller's
        return store
    if rank == TRAINER:  # listens at once (or fails at once: the port is taken)
        # a host name that does not resolve fails at once (socket.gaierror): TCPStore's own
        # client would retry it for about twice the timeout, printing a warning each time
        socket.getaddrinfo(url.hostname, url.port, type=socket.SOCK_STREAM)
        return dist.TCPStore(url.hostname, url.port, 2, is_master=True, timeout=timeout,
                             wait_for_workers=False)
    _await_listener(url.hostname, url.port, deadline)
    left = datetime.timedelta(seconds=max(deadline - time.monotonic(), POLL_S))
    store = dist.TCPStore(url.hostname, url.port, 2, is_master=False, timeout=left,
                          wait_for_workers=False)
    store.set_timeout(timeout)
    return store


def _wait_until(ready: Callable[[], bool], deadline: float, why: str) -> None:
    """Call ``ready`` every :data:`POLL_S` until it is true, in Python (a Ctrl-C stops the
    wait, which the store's and gloo's own waits in C++ would not see); :class:`_Alone`
    with ``why`` past ``deadline``."""
    while not ready():
        if time.monotonic() >= deadline:
            raise _Alone(why)
        time.sleep(min(POLL_S, max(deadline - time.monotonic(), 0)))


def _await_listener(host: str, port: int, deadline: float) -> None:
    """Wait until the trainer listens at ``host:port`` (connections refused or timing out
    until then); :class:`_Alone` past ``deadline``. A host name that does not resolve fails
    at once (``socket.gaierror``)."""
    def listening() -> bool:
        try:
            with socket.create_connection(
                    (host, port), timeout=min(max(deadline - time.monotonic(), 0.01), 5.0)):
                return True
        except socket.gaierror:
            raise
        except OSError:
            return False

    _wait_until(listening, deadline, "Connection refused")


def _marker(path: str) -> str:
    """The file beside the store file at ``path`` that says a pair met there (:func:`_stale`)."""
    return path + ".met"


def _stale(path: str) -> bool:
    """Whether the file address ``path`` holds the store of a pair that met there and is
    gone: the trainer writes :func:`_marker` as the pair meets and removes it, after the
    store file, once both ends have built their groups (:func:`_join`), so only a pair that
    died in between leaves it. The store file's own contents (torch's format) are not read."""
    return os.path.exists(_marker(path))


def _clear_stale(path: str, rank: int, deadline: float) -> None:
    """A store file left by a pair that died after it met (killed between its meeting and
    the removal) holds that pair's gloo addresses: a new pair would wait for them in vain. The
    trainer, which owns the address as it owns a TCP port, removes it (saying so); an engine
    waits until its trainer has (:class:`_Alone` past ``deadline``)."""
    if rank == TRAINER:
        if _stale(path):
            if _remove(path):
                print(f"gspo: removed {path}, the store file of an earlier trainer and "
                      "engine that are gone", file=sys.stderr, flush=True)
            _remove(_marker(path))
        return
    _wait_until(lambda: not _stale(path), deadline,
                f"{path} is an earlier pair's store file; a trainer that starts there removes it")


def _remove(path: str) -> bool:
    """Remove the file at ``path``; whether there was one."""
    try:
        os.remove(path)
        return True
    except FileNotFoundError:
        return False


def _meet(store: Any, rank: int, deadline: float) -> None:
    """Leave this end's key in the store and wait for the other's (:func:`_wait_until`);
    then claim this end's rank and wait for the other end's claim. An end claims only once it
    has seen the other end's key, and only the first of a rank holds it (a second engine at
    one trainer's address, or a second trainer at one file address: :class:`_Taken`). So an
    end that left its key and went away while it waited (stopped or killed: its key stays in
    a store file) never claims, and the other end waits on for one that is there. An end that
    gives up while it waits takes its key (and its claim) back."""
    mine = f"{JOINED}{rank}"
    store.set(mine, "1")
    claimed = False
    try:
        _wait_until(lambda: store.check([f"{JOINED}{1 - rank}"]), deadline, "no one came")
        if store.add(f"{CLAIMS}{rank}", 1) != 1:  # the count stays: the first end holds it
            raise _Taken()
        claimed = True
        _wait_until(lambda: store.check([f"{CLAIMS}{1 - rank}"]), deadline, "no one came")
    except _Taken:
        raise  # the key is the first end's too: it stays
    except BaseException:
        with contextlib.suppress(Exception):
            store.delete_key(mine)
            if claimed:
                store.delete_key(f"{CLAIMS}{rank}")
        raise


def _group(store: Any, name: str, rank: int, timeout: datetime.timedelta,
           device: Any) -> Any:
    """One gloo group of the two, on ``device`` (gloo's default device when None)."""
    prefixed = dist.PrefixStore(name, store)
    if device is None:
        return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices, opts._timeout = [device], timeout
    return dist.ProcessGroupGloo(prefixed, rank, 2, opts)


def _join(address: str, rank: int, timeout_s: float) -> tuple[Any, Any]:
    """Join the world of two at ``address``: its (messages, weights) groups, on gloo devices
    bound where the other end reaches them (:func:`_device`). Waits ``timeout_s`` for the
    other end. At a file address the trainer marks the pair's meeting beside the store file
    (:func:`_stale`) and removes both once both ends have built their groups (or its join
    failed after they met), so a pair that dies later leaves none behind."""
    timeout = datetime.timedelta(seconds=timeout_s)
    url = urllib.parse.urlparse(address)
    deadline = time.monotonic() + timeout_s
    try:
        store = _store(address, rank, timeout, deadline)
        _meet(store, rank, deadline)
    except _Alone as e:
        other = ("no engine joined (start one with `gspo engine ADDRESS`)" if rank == TRAINER
                 else "no trainer to join (it listens once it starts with "
                 "rollout.async_address=ADDRESS)")
        raise Unreachable(f"{address}: {other} within {timeout_s:g} s ({_first(e)})") from None
    except _Taken:
        end = "trainer" if rank == TRAINER else "engine"
        raise Unreachable(f"{address}: another {end} has already met the "
                          f"{'engine' if rank == TRAINER else 'trainer'} there (one trainer "
                          "and one engine per address)") from None
    except (dist.DistError, RuntimeError, OSError) as e:  # it failed, rather than waited
        raise Unreachable(f"{address}: could not "
                          f"{'listen there' if rank == TRAINER else 'reach the trainer'} "
                          f"({_first(e)})") from None
    marked = url.scheme == "file" and rank == TRAINER
    if marked:
        open(_marker(url.path), "w").close()
    # file://: no host in the address; this machine's own name stands for it (where it
    # resolves to loopback, as it often does, the outward address)
    host = url.hostname if url.scheme == "tcp" else socket.gethostname()
    try:
        device = _device(store, host, rank)
        groups = tuple(_group(store, name, rank, timeout, device)
                       for name in ("messages", "weights"))
        if url.scheme == "file":  # both ends have built both groups: no one reads the store
            groups[0].barrier().wait()
        return groups
    except (dist.DistError, RuntimeError) as e:
        other = "engine" if rank == TRAINER else "trainer"
        if not _gave_address(store, 1 - rank):
            raise Unreachable(
                f"{address}: the {other} met this end there, then went away (stopped or "
                f"killed) before it connected") from None
        raise Unreachable(
            f"{address}: met the {other} there, but gloo could not connect to the address it "
            f"gave ({_first(e)}); set {IFNAME} to the network interface each end reaches the "
            "other through") from None
    finally:
        if marked:  # the store file first: a marker alone is removed without a word
            _remove(url.path)
            _remove(_marker(url.path))


def _gave_address(store: Any, rank: int) -> bool:
    """Whether end ``rank`` left its gloo address in the store (:func:`_device`), which it
    does as it builds its groups; False also when the store is gone with the trainer that
    served it."""
    try:
        return bool(store.check([f"{BINDS}{rank}"]))
    except (dist.DistError, RuntimeError):
        return False


def _device(store: Any, host: str | None, rank: int) -> Any:
    """This end's gloo device (None: gloo's default, which binds to where this machine's host
    name resolves, often a loopback address that another machine cannot reach). The trainer
    binds to its address as the engine reaches it: on the route to the address's host, which
    at a TCP address is the trainer's own machine, and at a file address is this machine by
    its own name; where that name resolves to loopback, its outward address
    (:func:`gspo.rollout.gloo_net.bind_source`). It leaves that address in the store, and the
    engine binds to its own address on the route to it and leaves that in the store too (an
    engine whose address never came went away before it connected, :func:`_join`). So both
    ends bind in one address family, which gloo needs (an engine that resolved the trainer's
    name to IPv6 while the trainer bound IPv4 could not connect). Where
    ``GLOO_SOCKET_IFNAME`` names one interface (set by the user, or by a torchrun trainer for
    its world), each end binds to an address of that interface, the engine in the family of
    the trainer's. When the trainer binds
    nowhere in particular (a list of interfaces, or no address found), the engine binds
    towards ``host`` itself."""
    if rank == TRAINER:
        source = bind_source(host) if host else None
        store.set(f"{BINDS}{TRAINER}", source or "")
        return device_at(source)
    trainer = store.get(f"{BINDS}{TRAINER}").decode()
    source = bind_source(trainer or host) if trainer or host else None
    store.set(f"{BINDS}{ENGINE}", source or "")
    return device_at(source)


def _first(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


class RemoteEngine:
    """The trainer's side (rank 0): the same calls as
    :class:`gspo.rollout.async_engine.AsyncEngine`, to an engine started by ``gspo engine``.
    ``timeout_s`` bounds the wait for the engine to join and for each message."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, address: str, engine: str,
                 opts: EngineOptions, steps_ahead: int, threads: int, recompute: Recompute,
                 version: int = 0, timeout_s: float = 1800.0, turns: Any = None,
                 whole_publish: bool = False) -> None:
        """``whole_publish``: send the whole policy at every publish, also for a LoRA policy
        (to measure what sending only the adapter saves)."""
        group, self.weights = _join(address, TRAINER, timeout_s)
        self.closed = False
        self._sender: threading.Thread | None = None  # the last publish's broadcast
        self._send_error: BaseException | None = None
        self.last_send_s = 0.0  # how long the last finished broadcast of a publish took
        try:
            self.messages = _Messages(group, ENGINE)
            self.entries, sizes = _layout(model)
            self._unique = distinct(self.entries)
            self._changing = None if whole_publish else changing(model, self._unique)
            self._filled = [False] * (steps_ahead + 1)  # the engine's slot holds a whole policy
            self.keys = sorted(sizes)  # both ends send and receive the dtypes in this order
            self.buffer = {k: torch.empty(n, dtype=getattr(torch, k)) for k, n in sizes.items()}
            self.small = packed_buffers(self.entries, self._changing)
            self.bytes_per_slot = sum(t.numel() * t.element_size() for t in self.buffer.values())
            self.last_publish_bytes = 0
            self.messages.send({"skeleton": _skeleton(model), "entries": self.entries,
                                "sizes": sizes, "slots": steps_ahead + 1, "tokenizer": tokenizer,
                                "engine": engine, "opts": opts, "threads": threads,
                                "recompute": recompute, "turns": turns,
                                "changing": self._changing})
            self.publish(model, version)
            kind, payload = self.messages.recv()
            if kind != "ready":
                raise RuntimeError(f"rollout engine at {address} did not start:\n{payload}")
        except BaseException:
            self.close()
            raise

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> float:
        """Copy ``model``'s weights into the send buffers as version ``version`` (once the
        engine's slot holds a whole policy, only the tensors that can change) and broadcast
        them from a thread of their own: the trainer trains on while they cross the network.
        First waits for the previous publish's broadcast, whose buffers these are. The seconds
        the caller spent here (that wait and the copy)."""
        start = time.perf_counter()
        self.published()
        slot = version % len(self._filled)
        whole = self._changing is None or not self._filled[slot]
        header = torch.tensor([version, int(whole)])
        if whole:
            fill_slot(self.buffer, self.entries, self._unique, model)
            tensors = [header, *(self.buffer[k] for k in self.keys)]
        else:
            pack(self.entries, self._changing, model, self.small)
            tensors = [header, *self.small.values()]
        self._filled[slot] = True
        self.last_publish_bytes = entry_bytes(self.entries, self._unique if whole
                                              else self._changing)
        self._sender = threading.Thread(target=self._send, args=(tensors,),
                                        name="gspo-publish", daemon=True)
        self._sender.start()
        return time.perf_counter() - start

    def _send(self, tensors: list[torch.Tensor]) -> None:
        start = time.perf_counter()
        try:
            for t in tensors:
                _broadcast(self.weights, t)
        except BaseException as e:  # raised by the caller's next publish or close
            self._send_error = e
        self.last_send_s = time.perf_counter() - start

    def published(self) -> None:
        """Wait until the last publish has reached the engine (its broadcast is done)."""
        if self._sender is not None:
            self._sender.join()
            self._sender = None
        if self._send_error is not None:
            err, self._send_error = self._send_error, None
            raise RuntimeError(f"sending weights to the rollout engine failed: {err}") from err

    def submit(self, req: Request) -> None:
        self.messages.send(req)

    def take(self) -> tuple[int, dict[str, Any]]:
        """The next finished batch, in submission order: (step, encoded rollout)."""
        kind, payload = self.messages.recv()
        if kind != "batch":
            raise RuntimeError(f"rollout engine failed:\n{payload}")
        return payload

    def close(self) -> None:
        """Stop the engine (it exits); quietly if the engine is gone."""
        if self.closed:
            return
        self.closed = True
        try:
            self.published()
            self.messages.send(None)
            _broadcast(self.weights, torch.tensor([STOP, 0]))
            self.messages.flush()
        except RuntimeError:
            pass


class _Slots:
    """The engine's ``k + 1`` weight slots and the thread that receives versions into them."""

    def __init__(self, group: Any, sizes: dict[str, int], n: int, timeout_s: float,
                 entries: list[Any], changing: list[int] | None) -> None:
        self.group, self.timeout_s = group, timeout_s
        self.slots = [{k: torch.empty(m, dtype=getattr(torch, k)) for k, m in sizes.items()}
                      for _ in range(n)]
        self.keys = sorted(sizes)
        self.entries, self.changing = entries, changing
        self.small = packed_buffers(entries, changing)
        self.versions = [-1] * n
        self.error: BaseException | None = None  # why the receiving thread stopped early
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._receive, name="gspo-weights", daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        """Receive versions until the trainer's STOP; a failed broadcast (the trainer gone)
        is kept for :meth:`version`, which then stops waiting for versions that cannot come."""
        try:
            self._receive_versions()
        except BaseException as e:
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _receive_versions(self) -> None:
        header = torch.zeros(2, dtype=torch.long)
        while True:
            _broadcast(self.group, header, FOREVER)  # the next publish comes when it comes
            version, whole = int(header[0]), bool(header[1])
            if version == STOP:
                return
            slot = version % len(self.slots)
            with self.cond:
                self.versions[slot] = -1
            if whole:
                for k in self.keys:
                    _broadcast(self.group, self.slots[slot][k])
            else:  # the tensors that can change; the slot holds the frozen rest already
                assert self.changing is not None
                for buf in self.small.values():
                    _broadcast(self.group, buf)
                unpack(self.entries, self.changing, self.small, self.slots[slot])
            with self.cond:
                self.versions[slot] = version
                self.cond.notify_all()

    def version(self, slot: int, wanted: int | None) -> int:
        """The version ``slot`` holds, once it holds ``wanted`` (or after ``timeout_s``); now,
        with ``wanted`` None. Raises at once if receiving failed while it waits (the trainer
        died while it sent ``wanted``): no version arrives any more."""
        with self.cond:
            if wanted is not None:
                self.cond.wait_for(lambda: self.versions[slot] == wanted
                                   or self.error is not None, timeout=self.timeout_s)
                if self.versions[slot] != wanted and self.error is not None:
                    raise RuntimeError(f"receiving weights from the trainer failed: "
                                       f"{_first(self.error)}") from self.error
            return self.versions[slot]


def serve(address: str, *, device: str = "cpu", timeout_s: float = 1800.0) -> None:
    """The engine's side (rank 1, ``gspo engine ADDRESS``): join the trainer at ``address``,
    sample the batches it asks for until it closes, then return. ``timeout_s`` bounds the
    wait for the trainer to join, for a version a request names and for the rest of each
    message once it began; not the wait for the trainer's next request or weights
    (:data:`FOREVER`), which may come after an evaluation, update or checkpoint of any
    length (a trainer that dies closes its connections, and the wait fails at once).

    The engine runs in a thread of its own while this (the main) thread waits for it: the
    store's and gloo's waits (for a trainer to join, for its next request) run in C++ and do
    not see a Ctrl-C; the main thread's wait does, and raises KeyboardInterrupt at once
    (the process then exits, and the trainer's next message to it fails)."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            _serve(address, device, timeout_s)
        except BaseException as e:  # raised in the caller's thread
            failure.append(e)

    thread = threading.Thread(target=run, name="gspo-engine", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def _serve(address: str, device: str, timeout_s: float) -> None:
    group, weights = _join(address, ENGINE, timeout_s)
    messages = _Messages(group, TRAINER)
    setup = messages.recv()
    slots = _Slots(weights, setup["sizes"], setup["slots"], timeout_s, setup["entries"],
                   setup.get("changing"))
    run_engine(setup["skeleton"], setup["entries"], slots.slots, slots.version,
               setup["tokenizer"], setup["engine"], setup["opts"], setup["threads"],
               setup["recompute"], lambda: messages.recv(FOREVER),
               lambda kind, payload: messages.send((kind, payload)), torch.device(device),
               setup.get("turns"), setup.get("changing"))
    messages.flush()
    slots.thread.join(timeout=timeout_s)
