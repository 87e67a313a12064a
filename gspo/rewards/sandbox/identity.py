"""Who the program runs as, and what is removed after it: the sandbox uids (layer 5 of the
package docstring), their lock files, the ``/proc`` sweep that kills every process of a
dedicated uid, and the removal of the files it left behind."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import pwd
import shutil
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

_SANDBOX_UIDS = tuple(range(65_100, 65_116))  # Debian: 65000-65533 "reserved", unallocated
_NOBODY_FALLBACK = 65_534
_SWEEP_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")


@dataclass(frozen=True)
class _Identity:
    uid: int
    gid: int
    dedicated: bool  # only this library uses the uid, so all its processes / files may go


def _uid_mapped(uid: int) -> bool:
    """Whether ``uid`` exists in this (possibly nested) user namespace."""
    try:
        with open("/proc/self/uid_map") as f:
            for line in f:
                inside, _outside, count = (int(x) for x in line.split())
                if inside <= uid < inside + count:
                    return True
    except (OSError, ValueError):
        return uid < 65_536
    return False


@functools.lru_cache(maxsize=1)
def _identities() -> tuple[_Identity, ...]:
    ids = []
    for uid in _SANDBOX_UIDS:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            if _uid_mapped(uid):
                ids.append(_Identity(uid, uid, dedicated=True))
    if ids:
        return tuple(ids)
    try:
        pw = pwd.getpwnam("nobody")
        return (_Identity(pw.pw_uid, pw.pw_gid, dedicated=False),)
    except KeyError:
        return (_Identity(_NOBODY_FALLBACK, _NOBODY_FALLBACK, dedicated=False),)


_lock_dir_guard = threading.Lock()
_lock_dir_path: str | None = None


def _lock_dir(refresh: bool = False) -> str:
    """A directory only root can write, shared by all processes of this machine if possible."""
    global _lock_dir_path
    with _lock_dir_guard:
        if _lock_dir_path is not None and not refresh:
            return _lock_dir_path
        shared = os.path.join(tempfile.gettempdir(), f"gspo-sandbox-locks-{os.geteuid()}")
        with contextlib.suppress(FileExistsError):
            os.mkdir(shared, 0o700)
        try:
            st = os.lstat(shared)
            ok = (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
                  and not st.st_mode & 0o022)
        except OSError:
            ok = False
        _lock_dir_path = shared if ok else tempfile.mkdtemp(prefix="gspo-sandbox-locks-")
        return _lock_dir_path


@contextlib.contextmanager
def _identity() -> Iterator[_Identity | None]:
    """The identity to run as: a locked sandbox uid when we are root, else None (ourselves)."""
    if os.geteuid() != 0:
        yield None
        return
    ids = _identities()
    while True:
        for ident in ids:
            name = f"uid-{ident.uid}.lock"
            try:
                fd = os.open(os.path.join(_lock_dir(), name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                             0o600)
            except FileNotFoundError:  # a /tmp cleaner removed the directory
                fd = os.open(os.path.join(_lock_dir(refresh=True), name),
                             os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            try:
                yield ident
            finally:
                os.close(fd)  # releases the lock
            return
        time.sleep(0.02)


def _proc_uids_and_state(pid: str) -> tuple[set[int], str]:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return set(), ""
    uids: set[int] = set()
    state = ""
    for line in text.splitlines():
        if line.startswith("Uid:"):
            uids = {int(x) for x in line.split()[1:] if x.isdigit()}
        elif line.startswith("State:"):
            state = line.split()[1] if len(line.split()) > 1 else ""
    return uids, state


def _sandbox_processes(uid: int) -> list[int]:
    """Live (non-zombie) processes with ``uid`` as real, effective, saved or fs uid."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            uids, state = _proc_uids_and_state(entry)
            if uid in uids and state != "Z":
                found.append(int(entry))
    return found


def _kill_if_owned(pid: int, uid: int) -> None:
    """SIGKILL ``pid`` if it still belongs to ``uid``; a pidfd pins it against pid reuse."""
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
        uids, state = _proc_uids_and_state(str(pid))
        if uid not in uids or state == "Z":
            return
        if pidfd is None:
            os.kill(pid, signal.SIGKILL)
        else:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of a dedicated sandbox uid, until none is left (fork races)."""
    for _ in range(200):
        pids = _sandbox_processes(uid)
        if not pids:
            return
        for pid in pids:
            _kill_if_owned(pid, uid)
        time.sleep(0.005)


def _sweep_files(uid: int) -> None:
    """Remove what a dedicated sandbox uid left in the world-writable directories."""
    for top in dict.fromkeys((*_SWEEP_DIRS, tempfile.gettempdir())):
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
                if st.st_uid != uid:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    _rmtree(entry.path)
                else:
                    os.unlink(entry.path)
            except OSError:
                continue


def _rmtree(path: str) -> None:
    """Remove a tree even where the sandbox took its own permissions away. Permissions are only
    ever changed strictly *inside* the tree, never on ``path``'s parent."""
    root = os.path.abspath(path)
    if not os.path.lexists(root):
        return

    def inside(p: str) -> bool:
        return p == root or p.startswith(root + os.sep)

    def onerror(func: Callable[..., Any], p: str, exc_info: Any) -> None:
        if isinstance(exc_info[1], FileNotFoundError):
            return
        p = os.path.abspath(p)
        parent = os.path.dirname(p)
        if not (inside(p) and inside(parent)):
            return
        with contextlib.suppress(OSError):
            os.chmod(parent, 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
            func(p)

    shutil.rmtree(root, onerror=onerror)
    if os.path.lexists(root):
        shutil.rmtree(root, ignore_errors=True)
