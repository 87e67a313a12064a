"""Run model-written Python against tests in a sandbox, and turn the outcome into a reward.

Public API
----------
``run_python(code, tests, *, wall_timeout_s, cpu_s, memory_mb, max_procs, max_output_bytes)``
    runs ``code`` and then each test in a fresh, isolated interpreter and returns a frozen
    :class:`SandboxResult`. It never raises for anything the program does.
``code_reward(prompts, completions, *, tests, **columns)``
    the library's reward-function contract: per row, extract the code from the completion
    (:func:`extract_code`), run it against that row's tests, return the fraction of tests
    passed; 0.0 whenever anything goes wrong, None only for a row without tests.
``make_code_reward(workers=..., **limits)``
    the same with other limits or another pool size.

Threat model
------------
The program is hostile: it may loop, fork, allocate, print without end, write or delete files,
read secrets, open sockets, signal other processes, load native code, or try to *fake a pass*.
The parent (a trainer or pytest, possibly root, possibly holding a GPU) must survive all of it
and score such a program 0. No single layer below is trusted on its own; each says what it does
NOT stop.

Layers, outermost first
-----------------------
1. **Separate process.** ``subprocess.Popen`` starts ``sys.executable -I -S -B -c BOOTSTRAP``;
   nothing of the program is ever exec'd, eval'd or unpickled in the parent. ``-I`` ignores
   ``PYTHON*`` variables, the user site and the current directory on ``sys.path``; ``-S`` skips
   ``site`` (so third-party packages are not importable: stdlib only); ``-B`` writes no ``.pyc``.
   No ``preexec_fn`` is used (it is unsafe in a threaded parent such as a trainer): everything
   that must happen in the child happens in the bootstrap, before the program's first byte runs.
2. **Minimal environment.** ``env`` is exactly ``PATH=/usr/bin:/bin``, ``LANG=C.UTF-8`` and
   ``HOME``/``TMPDIR`` pointing at the throwaway directory (so ``tempfile`` works). Nothing is
   inherited, so no token or key in the parent's environment is visible. stdin is ``/dev/null``.
   Does not stop: reading secrets from *files* (see layers 5 and 9).
3. **Throwaway working directory** from ``tempfile.mkdtemp``, owned by the sandbox user (and
   covered by a private tmpfs, see 8), removed in a ``finally`` after every run, after all
   sandbox processes are dead.
4. **New session / process group** (``start_new_session=True``); on timeout, output overflow or
   exit the parent kills the whole group with ``SIGKILL``. Wall time is enforced by the parent,
   not by the child. Does not stop: a process that leaves the group (``setsid``) - see the
   sweep in 5.
5. **Unprivileged identity (root parents).** RLIMIT_NPROC is not enforced for root and root can
   write anywhere, so when the parent is root the bootstrap drops to a dedicated uid/gid
   (``setgroups([])``, ``setresgid``, ``setresuid``; checked, and checked that root cannot be
   regained) before the program runs. Uids come from a small reserved range (65100-65115, used
   only if no account owns them and the user namespace maps them), one per concurrent run, held
   with a lock file, so that after each run *every* process of that uid can be killed (a
   ``/proc`` sweep that also catches processes that left the group) and files it left in
   ``/tmp``, ``/var/tmp``, ``/dev/shm`` and ``/run/lock`` can be removed, without touching
   anyone else's processes. If the range is unusable the fallback is ``nobody`` (65534 if
   absent), without the sweeps (``nobody`` may be a real daemon's uid). The stdlib may not be
   readable by that uid (``/root/.pyenv``...), so the bootstrap opens the ``sys.path``
   directories first and imports through ``/proc/self/fd/N``. ``PR_SET_NO_NEW_PRIVS`` (no
   setuid binary can give privileges back) and ``PR_SET_DUMPABLE=0`` (``/proc/self/mem`` and
   friends become root-owned) are set too. Does not stop (kernel side): reading world-readable
   files, probing ``stat`` of paths. When the parent is *not* root the program runs as the
   current user: the kernel then protects nothing of that user's files or processes, and only
   the audit layer (9) does.
6. **Resource limits** set in the bootstrap (soft = hard, except CPU): ``RLIMIT_CPU``
   (``SIGXCPU``, then ``SIGKILL`` one second later), ``RLIMIT_AS`` (allocation fails with
   ``MemoryError``), ``RLIMIT_NPROC`` (processes *and threads* of the uid), ``RLIMIT_FSIZE``
   (16 MiB per file), ``RLIMIT_NOFILE`` (64), ``RLIMIT_CORE=0``. Does not stop: memory spread
   over ``max_procs`` processes (at most ``max_procs * memory_mb``; the audit layer refuses
   process creation), GPU access (nothing is prepared, but device nodes are not hidden).
7. **No network.** As root the bootstrap calls ``unshare(CLONE_NEWNET | CLONE_NEWIPC)`` (through
   ``ctypes``, as ``os.unshare`` needs Python 3.12): a new network namespace with only a
   loopback that is down, so nothing at all is reachable, not even 127.0.0.1 or abstract unix
   sockets; new SysV IPC too. As non-root it tries an unprivileged user namespace
   (``CLONE_NEWUSER``) to get the same, maps its own uid and drops every capability before the
   program runs. Failures are tolerated (some containers forbid namespaces): layer 9 still
   refuses sockets. ``SandboxResult.isolation`` says which layers were actually in place.
   Does not stop: filesystem unix sockets the sandbox uid may open (layer 9 refuses
   ``connect``/``bind`` of any socket).
8. **Private mounts.** In a new mount namespace (same conditions as 7), fresh ``noexec``,
   ``nosuid``, ``nodev`` tmpfs are mounted on ``/tmp``, ``/var/tmp``, ``/dev/shm``,
   ``/run/lock`` (16 MiB each) and on the work dir (64 MiB): the program can neither fill the
   host's disk nor leave files behind, and nothing it writes can be mapped executable, so a
   home-made extension module or binary cannot be loaded (``dlopen`` fails). Does not stop:
   other world-writable places if the host has any (the sweep in 5 covers the usual ones).
9. **Audit hook** (``sys.addaudithook``, cannot be removed from Python), installed by the
   bootstrap after the steps above and before the program's code is compiled. The hook only
   uses C functions captured beforehand (its own ``realpath`` on ``posix.lstat``/``readlink``)
   and only accepts paths that are exactly ``str``, ``bytes`` or ``int``, so monkeypatching
   ``os``/``posixpath``/builtins or passing a lying ``os.PathLike`` does not fool it
   (``pathlib``'s ``open``/``read_text``/``write_text`` still work). It refuses:

   - process creation: ``os.fork``/``forkpty``/``system``/``exec*``/``posix_spawn``,
     ``subprocess.Popen`` (the raw ``_posixsubprocess.fork_exec``, which raises no event, is
     replaced by a refusing stub before the program runs and its re-import is refused);
   - sockets: any socket other than ``AF_UNIX`` (``socketpair`` keeps asyncio working) and any
     ``connect``/``bind``/``sendto``/``sendmsg``/name lookup;
   - signals to anything but itself (``os.kill``, ``os.killpg``; ``pidfd_open`` and
     ``pidfd_send_signal``, which raise no event, are stubbed);
   - native code: importing ``ctypes``/``_ctypes``, the ``_test*``/``_xx*`` modules,
     sub-interpreters (they would run without the hook), ``readline``/``dbm``/shared-memory
     modules (C-level file access), every ``ctypes.*`` event, sqlite extension loading,
     ``os.memfd_create`` (stubbed); constructing code objects (``code.__new__``/``replace``,
     except ``types.coroutine``'s flag change), so no hand-made bytecode;
   - writing, creating, deleting, renaming, truncating, chmod-ing outside the working
     directory (paths are resolved; relative paths may not contain ``..``; ``dir_fd``
     variants, ``os.fwalk``, symlink creation and opening directories outside the work dir are
     refused), reading outside the stdlib, the work dir and a few harmless files
     (``/dev/urandom``, zoneinfo...), and all of ``/proc`` (so ``/proc/self/mem``);
   - frame and object introspection (``sys._getframe``, ``tb_frame``, ``gi_frame``,
     ``sys.settrace``/``setprofile``, ``gc.get_objects``/``get_referrers``...), and Python-level
     signal handlers (they receive the current frame): see "Faking a pass" below.

   Process creation, networking, foreign signals and native code end the process at once with
   exit code 86 (status ``killed``); refused file access raises ``PermissionError``, refused
   introspection a ``ValueError`` subclass (which the stdlib treats as "no frames here", e.g. in
   ``collections.namedtuple``) and refused imports ``ImportError``. Does not stop: races
   between the check and the system call (TOCTOU, e.g. a symlink swapped by a thread),
   operations that raise no audit event and were not stubbed, crafted ``marshal`` data
   (``marshal.loads`` must stay allowed for imports) or an interpreter memory-safety bug. That
   is why layers 5-8 exist.
10. **Parent-side accounting.** stdout/stderr are read incrementally with ``select``; only a
    bounded tail is kept, and once ``max_output_bytes`` is exceeded the group is killed
    (``output_limit``). The result channel is bounded as well and parsed as plain ASCII; any
    unexpected byte, exit code or state is 0 reward.

Faking a pass
-------------
The tests run in the same interpreter as the program (they must call its functions), so the
pass signal must be something the program cannot produce. The parent puts a random 128-bit
nonce in the payload, which reaches the child only through an anonymous, already-unlinked file
descriptor that the bootstrap reads and closes before the program runs. The nonce lives only in
a local variable of the bootstrap's frame; every route to that frame (frames, tracebacks,
generators, tracing, signal handlers, gc, ``/proc/self/mem``, ctypes, hand-made bytecode) is
refused by layer 9 and ``/proc/self/mem`` also by layer 5. After the program and *all* tests
have run, the bootstrap writes ``<nonce> result <status> <passed> <total>`` to a pipe it received
as an extra descriptor (not stdout, which the program can hook) and calls ``os._exit(0)``. The
parent accepts a result only if exactly that one line carries the nonce, nothing else was
written to the pipe, the counts match and the exit code is 0. So ``sys.exit(0)``/``os._exit``
before the tests, printing a guessed line, writing to every descriptor, or replacing
``AssertionError``/``print``/builtins cannot produce a pass: the bootstrap catches every
``BaseException`` per test, compares nothing the program controls, keeps references to
``exec``/``compile``/``os.write`` taken before the program ran, and restores the builtins module
before the tests. The program raising at top level (including ``SystemExit``) is status
``error`` with no tests run.

What this does NOT prevent: a program that passes the tests *semantically* dishonestly, e.g. a
function returning an object whose ``__eq__`` is always true, or special-casing the visible
test inputs. Those are reward-design problems (hidden tests, type checks in the tests), not
sandbox problems. The in-process secrecy of the nonce also rests on layer 9, so a CPython
memory-corruption exploit could in principle fake a pass; it could not escape layers 5-8.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import math
import os
import pwd
import re
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

__all__ = [
    "STATUSES",
    "SandboxResult",
    "code_reward",
    "extract_code",
    "make_code_reward",
    "run_python",
]

STATUSES = ("ok", "failed", "timeout", "memory", "output_limit", "error", "killed")

_VIOLATION_EXIT = 86  # the audit hook ended the process (literal in _BOOTSTRAP; 70 = setup failed)
_TAIL_BYTES = 4096  # how much of stdout / stderr a SandboxResult keeps
_RESULT_CAP = 4096  # the result channel carries two short lines; more is tampering
_FSIZE_BYTES = 16 << 20  # RLIMIT_FSIZE: largest file the program may write
_DISK_BYTES = 64 << 20  # size of the private tmpfs work dir, when mount namespaces work
_NOFILE = 64
_SANDBOX_UIDS = tuple(range(65_100, 65_116))  # Debian: 65000-65533 "reserved", unallocated
_NOBODY_FALLBACK = 65_534
_SWEEP_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_MAX_WORKERS = 2


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    ``status``: ``ok`` (all tests passed), ``failed`` (ran, some tests failed), ``timeout``
    (wall or CPU limit), ``memory`` (ran out of its address-space limit), ``output_limit``
    (printed more than ``max_output_bytes``), ``error`` (did not compile, raised at top level,
    exited before the tests, or its result could not be trusted), ``killed`` (ended by the
    audit hook, or died of a signal).

    ``isolation`` lists the layers the child reported in place (``uid``, ``netns``, ``mountns``,
    ``noexec``, ``rlimits``, ``audit``...). ``program_ran`` is False when the sandbox itself
    could not be set up (or did not start in time), so the program never ran: not the
    program's fault, and :func:`code_reward` reports such a row as unscorable (None).
    """

    passed: bool
    status: str
    n_passed: int
    n_tests: int
    stdout_tail: str
    stderr_tail: str
    wall_s: float
    isolation: tuple[str, ...] = ()
    program_ran: bool = True

    @property
    def fraction(self) -> float:
        """Fraction of tests passed; 0.0 unless the run completed (``ok`` or ``failed``)."""
        if self.status not in ("ok", "failed") or self.n_tests <= 0:
            return 0.0
        return self.n_passed / self.n_tests


# --------------------------------------------------------------------------------------------
# The bootstrap: the only code the child runs before the program. It starts as the parent's
# user (maybe root) and is trusted; everything it reads from the payload is data.
# --------------------------------------------------------------------------------------------
_BOOTSTRAP = r'''
import sys as _sys


class _SandboxDenied(PermissionError, ValueError):
    """Refused by the gspo sandbox (a ValueError too: stdlib fallbacks for frames keep working)."""


class _ImportDenied(ImportError):
    """Import refused by the gspo sandbox."""


def _denied(*args, **kwargs):
    raise _SandboxDenied("refused by the gspo sandbox")


def _main():
    import os
    import json
    import posix
    import resource
    import _posixsubprocess
    import _signal
    import _thread
    import types

    _write = os.write
    _exit = os._exit

    def say(msg):
        try:
            _write(2, ("gspo-sandbox: " + msg + "\n").encode("utf-8", "replace"))
        except BaseException:
            pass

    def die(msg):
        say(msg)
        _exit(70)

    # -- payload: from an anonymous file descriptor, then closed -------------------------------
    try:
        payload_fd = int(_sys.argv[1])
        result_fd = int(_sys.argv[2])
        chunks = []
        while True:
            chunk = os.read(payload_fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(payload_fd)
        cfg = json.loads(b"".join(chunks).decode("utf-8"))
        del chunks
        nonce = cfg["nonce"]
        source = cfg["code"]
        tests = cfg["tests"]
        workdir = cfg["workdir"]
        uid = cfg["uid"]
        gid = cfg["gid"]
        limits = cfg["limits"]
        audit = cfg["audit"]
        del cfg
    except Exception as e:
        die("bad payload: %r" % (e,))

    layers = []
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
    except Exception:
        ctypes = libc = None
    CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWIPC, CLONE_NEWUSER = (
        0x00020000, 0x40000000, 0x08000000, 0x10000000)
    MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 1 << 14, 1 << 18

    # -- the stdlib through descriptors opened now: the sandbox uid may not be able to traverse
    # its path (e.g. /root), and the private mounts below may cover it (e.g. a venv in /tmp)
    stdlib_dirs = [p for p in _sys.path if p and os.path.isdir(p)]
    remap = {}
    for p in stdlib_dirs:
        try:
            fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        remap[p] = "/proc/self/fd/%d" % fd
    _sys.path[:] = [remap.get(p, p) for p in _sys.path]
    _sys.path_importer_cache.clear()
    for mod in list(_sys.modules.values()):
        paths = getattr(mod, "__path__", None)
        if isinstance(paths, list):
            for i, p in enumerate(paths):
                for old, new in remap.items():
                    if p == old or p.startswith(old + "/"):
                        paths[i] = new + p[len(old):]

    def private_mounts(owner_uid, owner_gid):
        # A private mount namespace with fresh, size-limited, noexec tmpfs on the world-writable
        # directories and on the work dir: nothing the program writes can be mapped executable
        # (no home-made extension module), fill the host's disk, or outlive the run.
        if libc.unshare(CLONE_NEWNS) != 0:
            return
        if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
            return
        flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
        for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
            if os.path.isdir(d) and not os.path.islink(d):
                libc.mount(b"tmpfs", d.encode(), b"tmpfs", flags, b"size=16m,mode=1777")
        if not os.path.isdir(workdir):
            os.makedirs(workdir, mode=0o700)
            os.chown(workdir, owner_uid, owner_gid)
        opts = "size=%dk,mode=0700,uid=%d,gid=%d" % (limits["disk_kb"], owner_uid, owner_gid)
        if libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", flags, opts.encode()) == 0:
            layers.extend(["mountns", "noexec"])
        os.chdir(workdir)

    if uid is not None:
        # -- root: namespaces and private mounts, then drop to the sandbox uid ---------------
        if libc is not None:
            if libc.unshare(CLONE_NEWNET | CLONE_NEWIPC) == 0:
                layers += ["netns", "ipcns"]
            elif libc.unshare(CLONE_NEWNET) == 0:
                layers.append("netns")
            try:
                private_mounts(uid, gid)
            except OSError as e:
                die("cannot set up private mounts: %s" % e)
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        except OSError as e:
            die("cannot drop privileges: %s" % e)
        if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
            die("privilege drop had no effect")
        if os.getgroups():
            die("supplementary groups remain")
        try:
            os.setresuid(0, 0, 0)
        except PermissionError:
            pass
        else:
            die("root could be regained")
        layers.append("uid")
    elif libc is not None:
        # -- not root: an unprivileged user namespace gives the same namespaces; its
        # capabilities are dropped again before the program runs
        ruid, rgid = os.getuid(), os.getgid()
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWIPC) == 0:
            layers += ["userns", "netns", "ipcns"]
            for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (ruid, ruid)),
                               ("gid_map", "%d %d 1" % (rgid, rgid))):
                try:
                    with open("/proc/self/" + name, "w") as f:
                        f.write(text)
                except OSError:
                    pass
            try:
                private_mounts(ruid, rgid)
            except OSError as e:
                die("cannot set up private mounts: %s" % e)

            class _Hdr(ctypes.Structure):
                _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

            class _Data(ctypes.Structure):
                _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                            ("inheritable", ctypes.c_uint32)]

            if libc.capset(ctypes.byref(_Hdr(0x20080522, 0)), (_Data * 2)()) != 0:
                die("cannot drop the capabilities of the user namespace")

    if libc is not None:
        if libc.prctl(38, 1, 0, 0, 0) == 0:  # PR_SET_NO_NEW_PRIVS
            layers.append("no_new_privs")
        if libc.prctl(4, 0, 0, 0, 0) == 0:  # PR_SET_DUMPABLE = 0
            layers.append("nondumpable")

    # -- resource limits -----------------------------------------------------------------------
    nproc = limits["max_procs"]
    if uid is None:  # RLIMIT_NPROC counts every process of the uid: leave room for the others
        me = "\t%d\t" % os.getuid()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open("/proc/%s/status" % entry) as f:
                        text = f.read()
                except OSError:
                    continue
                for line in text.splitlines():
                    if line.startswith("Uid:"):
                        nproc += (line[4:] + "\t").startswith(me)
                        break

    def cap(res, soft, hard):
        cur_hard = resource.getrlimit(res)[1]
        if cur_hard != resource.RLIM_INFINITY:
            hard = min(hard, cur_hard)
            soft = min(soft, hard)
        resource.setrlimit(res, (soft, hard))

    try:
        cap(resource.RLIMIT_CORE, 0, 0)
        cap(resource.RLIMIT_CPU, limits["cpu_s"], limits["cpu_s"] + 1)
        cap(resource.RLIMIT_NOFILE, limits["nofile"], limits["nofile"])
        cap(resource.RLIMIT_FSIZE, limits["fsize"], limits["fsize"])
        cap(resource.RLIMIT_NPROC, nproc, nproc)
        cap(resource.RLIMIT_AS, limits["memory"], limits["memory"])
    except (OSError, ValueError) as e:
        die("cannot set resource limits: %s" % e)
    layers.append("rlimits")

    # -- forget ctypes; stub what raises no audit event ----------------------------------------
    del libc, ctypes
    for name in list(_sys.modules):
        if name in ("ctypes", "_ctypes") or name.startswith("ctypes."):
            del _sys.modules[name]
    _posixsubprocess.fork_exec = _denied
    for mod in (os, posix):
        for name in ("pidfd_open", "mkfifo", "mknod", "memfd_create"):
            if hasattr(mod, name):
                setattr(mod, name, _denied)
    try:  # asyncio.run only installs its SIGINT handler over the default one
        _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
    except (OSError, ValueError):
        pass
    for name in ("pidfd_send_signal", "signal"):  # Python handlers receive the current frame
        if hasattr(_signal, name):
            setattr(_signal, name, _denied)
    if "signal" in _sys.modules:
        _sys.modules["signal"].signal = _denied

    # -- the audit hook ------------------------------------------------------------------------
    # Everything the hook uses is captured now, and only C functions or exact builtin types are
    # used: the program may monkeypatch os, posixpath or builtins before the hook runs again.
    _lstat = posix.lstat
    _stat = posix.stat
    _readlink = posix.readlink
    _getcwd = posix.getcwd
    _getpid = posix.getpid
    _decode = bytes.decode
    _int_and = int.__and__
    _type = type
    _len = len
    _str, _bytes, _int = str, bytes, int
    _OSError, _ValueError = OSError, ValueError
    Denied, ImportDenied = _SandboxDenied, _ImportDenied
    S_IFMT, S_IFLNK, S_IFDIR = 0o170000, 0o120000, 0o040000

    def resolve(text):
        # os.path.realpath from C primitives only
        if not text.startswith("/"):
            text = _getcwd() + "/" + text
        todo = text.split("/")
        todo.reverse()
        out = []
        hops = 0
        while todo:
            part = todo.pop()
            if part == "" or part == ".":
                continue
            if part == "..":
                if out:
                    out.pop()
                continue
            out.append(part)
            here = "/" + "/".join(out)
            try:
                mode = _lstat(here).st_mode
            except (_OSError, _ValueError):
                continue
            if mode & S_IFMT == S_IFLNK:
                hops += 1
                if hops > 40:
                    raise Denied("too many symbolic links: refused by the gspo sandbox")
                target = _readlink(here)
                out.pop()
                if target.startswith("/"):
                    del out[:]
                more = target.split("/")
                more.reverse()
                todo += more
        return "/" + "/".join(out)

    def is_dir(real):
        try:
            return _stat(real).st_mode & S_IFMT == S_IFDIR
        except (_OSError, _ValueError):
            return False

    def as_text(path):
        # None for a descriptor it already holds; only exact str / bytes / int are accepted,
        # since a subclass or os.PathLike could show the hook another path than the syscall
        t = _type(path)
        if t is _int:
            return None
        if t is _str:
            text = path
        elif t is _bytes:
            text = _decode(path, "utf-8", "surrogateescape")
        else:
            raise Denied("a path not exactly str, bytes or int is refused by the gspo sandbox")
        if "\x00" in text:
            raise Denied("a NUL in a path is refused by the gspo sandbox")
        return text

    work = resolve(os.getcwd())
    read_roots = tuple({resolve(p) for p in stdlib_dirs} | {work, "/usr/share/zoneinfo"})
    read_files = frozenset({"/dev/null", "/dev/zero", "/dev/urandom", "/dev/random",
                            "/etc/localtime", "/etc/timezone", "/etc/mime.types",
                            "/etc/os-release", "/usr/lib/os-release"})
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    af_unix = 1
    fatal = frozenset({
        "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "subprocess.Popen",
        "pty.spawn", "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
        "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
        "socket.getnameinfo", "socket.sethostname", "cpython.PyInterpreterState_New",
        "webbrowser.open", "ensurepip.bootstrap", "sqlite3.enable_load_extension",
        "sqlite3.load_extension"})
    refused = frozenset({
        "sys._current_frames", "sys._current_exceptions", "sys.settrace", "sys.setprofile",
        "gc.get_objects", "gc.get_referrers", "gc.get_referents", "resource.setrlimit",
        "resource.prlimit", "pdb.Pdb", "builtins.breakpoint", "os.symlink", "os.fwalk"})
    frame_attrs = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
    blocked_imports = frozenset({
        "ctypes", "_ctypes", "_ctypes_test", "_posixsubprocess", "posix", "_signal",
        "_xxsubinterpreters", "_xxinterpchannels", "_xxtestfuzz", "_testcapi",
        "_testinternalcapi", "_testbuffer", "_testmultiphase", "_testclinic",
        "_testimportmultiple", "_testsinglephase", "xxlimited", "xxlimited_35", "xxsubtype",
        "_dbm", "_gdbm", "readline", "_posixshmem", "_multiprocessing", "ossaudiodev"})
    # event: (indices of paths that must stay inside the work dir, indices of dir_fd arguments)
    path_events = {
        "os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.mkdir": ((0,), (2,)),
        "os.rename": ((0, 1), (2, 3)), "os.link": ((0, 1), (2, 3)), "os.chmod": ((0,), (2,)),
        "os.chown": ((0,), (3,)), "os.utime": ((0,), (3,)), "os.truncate": ((0,), ()),
        "os.setxattr": ((0,), ()), "os.removexattr": ((0,), ()),
        "shutil.rmtree": ((0,), (1,)), "shutil.copyfile": ((1,), ()),
        "shutil.copymode": ((1,), ()), "shutil.copystat": ((1,), ()),
        "shutil.copytree": ((1,), ()), "shutil.move": ((0, 1), ()),
        "shutil.unpack_archive": ((1,), ()), "shutil.make_archive": ((0,), ()),
        "tempfile.mkdtemp": ((0,), ()), "tempfile.mkstemp": ((0,), ()),
        "sqlite3.connect": ((0,), ())}
    # code.replace() is refused (a shorter co_consts reads out of bounds) except from
    # types.coroutine, which only sets a flag on a code object compiled from source (asyncio)
    coroutine_code = types.coroutine.__code__
    getframe = _sys._getframe
    get_ident = _thread.get_ident
    hook_inspecting = [None]  # thread id while the hook itself looks at its caller

    def kill_process(event):
        say("blocked " + event)
        _exit(86)

    def within(real, root):
        return real == root or real.startswith(root + "/")

    def may_write(path):
        text = as_text(path)
        if text is None:
            return True
        if not text.startswith("/") and ".." in text.split("/"):
            return False
        return within(resolve(text), work)

    def may_read(path):
        text = "." if path is None else as_text(path)
        if text is None:
            return True
        real = resolve(text)
        if real in read_files:
            return True
        for root in read_roots:
            if within(real, root):
                return True
        return False

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if _type(path) is _int:
                return
            if mode is not None and _type(mode) is not _str:
                raise Denied("an odd open mode is refused by the gspo sandbox")
            writing = (_type(flags) is _int and _int_and(flags, write_flags)) or (
                mode is not None and ("w" in mode or "a" in mode or "x" in mode or "+" in mode))
            if writing:
                if not may_write(path):
                    raise Denied("writing %r is refused by the gspo sandbox" % (path,))
            elif not may_read(path):
                raise Denied("reading %r is refused by the gspo sandbox" % (path,))
            if mode is None:  # os.open: no directory descriptor outside the work dir (dir_fd)
                real = resolve(as_text(path))
                if is_dir(real) and not within(real, work):
                    raise Denied("opening directory %r is refused by the gspo sandbox" % (path,))
        elif event == "os.listdir" or event == "os.scandir":
            if args and not may_read(args[0]):
                raise Denied("listing %r is refused by the gspo sandbox" % (args[0],))
        elif event in path_events:
            paths, dir_fds = path_events[event]
            for i in dir_fds:
                if i < _len(args) and args[i] is not None and args[i] != -1:
                    raise Denied(event + " with dir_fd is refused by the gspo sandbox")
            for i in paths:
                if i < _len(args) and not may_write(args[i]):
                    raise Denied("%s on %r is refused by the gspo sandbox" % (event, args[i]))
        elif event in fatal:
            kill_process(event)
        elif event == "socket.__new__":
            if _len(args) < 2 or args[1] != af_unix:
                kill_process(event)
        elif event == "os.kill" or event == "os.killpg":
            if args[0] != _getpid():  # it leads its own session and process group
                kill_process(event)
        elif event.startswith("ctypes.") or event.startswith("syslog."):
            kill_process(event)
        elif event == "sys._getframe":
            if hook_inspecting[0] != get_ident():
                raise Denied(event + " is refused by the gspo sandbox")
        elif event == "code.__new__":
            hook_inspecting[0] = get_ident()
            try:
                caller = getframe(1).f_code
            finally:
                hook_inspecting[0] = None
            if caller is not coroutine_code:
                raise Denied("creating code objects is refused by the gspo sandbox")
        elif event in refused:
            raise Denied(event + " is refused by the gspo sandbox")
        elif event == "object.__getattr__":
            if _len(args) > 1 and args[1] in frame_attrs:
                raise Denied("frame access is refused by the gspo sandbox")
        elif event == "import":
            name = args[0] if args else None
            if _type(name) is not _str:
                raise ImportDenied("an odd module name is refused by the gspo sandbox")
            if name.partition(".")[0] in blocked_imports:
                raise ImportDenied("import of %s is refused by the gspo sandbox" % name)

    if audit:
        _sys.addaudithook(hook)
        layers.append("audit")

    # -- run the program, then the tests -------------------------------------------------------
    _compile = compile
    _exec = exec
    _BaseException = BaseException
    _MemoryError = MemoryError
    _type = type
    _len = len
    _enumerate = enumerate
    builtins_mod = _sys.modules["builtins"]
    saved_builtins = dict(builtins_mod.__dict__)
    stdout, stderr = _sys.stdout, _sys.stderr
    flush_text = _type(stdout).flush
    excepthook = _sys.__excepthook__  # C implementation: prints without touching frames

    def report(prefix, exc):
        try:
            say(prefix)
            excepthook(_type(exc), exc, exc.__traceback__)
        except _BaseException:
            pass

    def emit(line):
        data = ("\n" + line + "\n").encode("ascii")
        while data:
            data = data[_write(result_fd, data):]

    try:
        emit("%s setup %s" % (nonce, ",".join(layers)))
    except _BaseException:
        _exit(70)
    module = _type(_sys)("__solution__")
    ns = module.__dict__
    ns["__builtins__"] = builtins_mod
    _sys.modules["__solution__"] = module
    _sys.argv[:] = ["<solution>"]
    status = "ok"
    n_passed = 0
    try:
        _exec(_compile(source, "<solution>", "exec"), ns)
    except _MemoryError:
        status = "memory"
    except _BaseException as exc:
        status = "error"
        report("the solution raised; no test was run", exc)
        del exc
    del source
    if status == "ok":
        try:
            bd = builtins_mod.__dict__
            for key in [k for k in bd if k not in saved_builtins]:
                del bd[key]
            bd.update(saved_builtins)
            ns["__builtins__"] = builtins_mod
        except _BaseException:
            status = "error"
    memory_hit = False
    if status == "ok":
        for index, test in _enumerate(tests):
            try:
                _exec(_compile(test, "<test %d>" % index, "exec"), ns)
            except _MemoryError:
                memory_hit = True
            except _BaseException as exc:
                report("test %d failed" % index, exc)
                del exc
            else:
                n_passed += 1
        if n_passed != _len(tests):
            status = "memory" if memory_hit and n_passed == 0 else "failed"
    for stream in (stdout, stderr):
        try:
            flush_text(stream)
        except _BaseException:
            pass
    try:
        emit("%s result %s %d %d" % (nonce, status, n_passed, _len(tests)))
    except _BaseException:
        _exit(70)
    _exit(0)


_main()
'''


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Identity:
    uid: int
    gid: int
    dedicated: bool  # only this library uses the uid, so all its processes / files may go


@dataclass(frozen=True)
class _Limits:
    wall_timeout_s: float
    cpu_s: int
    memory_mb: int
    max_procs: int
    max_output_bytes: int


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


_RECORD = re.compile(r"([0-9a-f]{32}) (setup|result)(?: ([a-z_, 0-9]*))?")


@dataclass(frozen=True)
class _Parsed:
    setup_seen: bool  # the bootstrap got as far as running the program
    layers: tuple[str, ...]
    outcome: tuple[str, int] | None  # (status, n_passed) when the result can be trusted


def _parse_result(raw: bytes, nonce: str, n_tests: int) -> _Parsed:
    """Read the result channel strictly: the setup record first, then exactly one result."""
    lines = [line for line in raw[:_RESULT_CAP].decode("ascii", "replace").split("\n") if line]
    records = []
    for line in lines:
        m = _RECORD.fullmatch(line)
        if m is None or not secrets.compare_digest(m.group(1), nonce):
            records.append(None)  # not ours: the program wrote here
        else:
            records.append((m.group(2), m.group(3) or ""))
    if not records or records[0] is None or records[0][0] != "setup":
        return _Parsed(False, (), None)
    layers = tuple(x for x in records[0][1].split(",") if x)
    untrusted = _Parsed(True, layers, None)
    if len(raw) > _RESULT_CAP or len(records) != 2 or records[1] is None:
        return untrusted
    kind, text = records[1]
    parts = text.split(" ")
    if kind != "result" or len(parts) != 3 or parts[0] not in ("ok", "failed", "error", "memory"):
        return untrusted
    if not (parts[1].isdigit() and parts[2].isdigit()):
        return untrusted
    n_passed, total = int(parts[1]), int(parts[2])
    if total != n_tests or n_passed > total or (parts[0] == "ok") != (n_passed == total):
        return untrusted
    return _Parsed(True, layers, (parts[0], n_passed))


def _status_without_result(returncode: int | None, stderr_tail: str) -> str:
    if returncode == _VIOLATION_EXIT:
        return "killed"
    if returncode is not None and returncode < 0:
        sig = -returncode
        return "timeout" if sig == signal.SIGXCPU else "killed"
    if "MemoryError" in stderr_tail:
        return "memory"
    return "error"


def _normalize_tests(tests: str | Sequence[str]) -> list[str]:
    if isinstance(tests, str):
        return [tests]
    out = list(tests)
    if not all(isinstance(t, str) for t in out):
        raise TypeError("tests must be a string or a list of strings")
    return out


def _execute(code: str, tests: str | Sequence[str], limits: _Limits, *,
             audit: bool = True) -> SandboxResult:
    """Run ``code`` then ``tests`` in the sandbox. ``audit=False`` (tests only) leaves out the
    audit hook, to check that the kernel-side layers hold on their own."""
    t0 = time.monotonic()
    tests_list = _normalize_tests(tests)
    if not isinstance(code, str):
        raise TypeError("code must be a string")
    try:
        with _identity() as ident:
            return _execute_as(ident, code, tests_list, limits, audit, t0)
    except Exception as e:
        return SandboxResult(False, "error", 0, len(tests_list), "",
                             f"gspo sandbox failure: {type(e).__name__}: {e}"[-_TAIL_BYTES:],
                             time.monotonic() - t0, (), program_ran=False)


def _execute_as(ident: _Identity | None, code: str, tests: list[str], limits: _Limits,
                audit: bool, t0: float) -> SandboxResult:
    nonce = secrets.token_hex(16)
    workdir = tempfile.mkdtemp(prefix="gspo-sandbox-")
    proc: subprocess.Popen | None = None
    result_r = -1
    try:
        if ident is not None:
            os.chown(workdir, ident.uid, ident.gid)
        os.chmod(workdir, 0o700)
        payload = json.dumps({
            "nonce": nonce, "code": code, "tests": tests, "workdir": workdir,
            "uid": None if ident is None else ident.uid,
            "gid": None if ident is None else ident.gid,
            "audit": audit,
            "limits": {"cpu_s": limits.cpu_s, "memory": limits.memory_mb << 20,
                       "max_procs": limits.max_procs, "fsize": _FSIZE_BYTES,
                       "nofile": _NOFILE, "disk_kb": _DISK_BYTES >> 10},
        }).encode("utf-8")
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
        with tempfile.TemporaryFile() as payload_file:  # unlinked: reachable only by its fd
            payload_file.write(payload)
            payload_file.flush()
            payload_file.seek(0)
            result_r, result_w = os.pipe()
            spawned = time.monotonic()  # not t0: waiting for a free sandbox uid is not run time
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-B", "-c", _BOOTSTRAP,
                     str(payload_file.fileno()), str(result_w)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    pass_fds=(payload_file.fileno(), result_w), cwd=workdir, env=env,
                    start_new_session=True, close_fds=True)
            finally:
                os.close(result_w)
        got = _collect(proc, result_r, limits, spawned + limits.wall_timeout_s)
    finally:
        returncode = _reap(proc)
        if result_r >= 0:
            os.close(result_r)
        if ident is not None and ident.dedicated:
            _kill_uid(ident.uid)
        _rmtree(workdir)
        if ident is not None and ident.dedicated:
            _sweep_files(ident.uid)
    wall = time.monotonic() - t0
    parsed = _parse_result(bytes(got.result), nonce, len(tests))
    out, err = got.out.text(), got.err.text()
    if got.output_exceeded:
        status, n_passed = "output_limit", 0
    elif got.timed_out:
        status, n_passed = "timeout", 0
    elif parsed.outcome is not None and returncode == 0:
        status, n_passed = parsed.outcome
    else:
        status, n_passed = _status_without_result(returncode, err), 0
    if status not in ("ok", "failed"):
        n_passed = 0
    return SandboxResult(status == "ok", status, n_passed, len(tests), out, err, wall,
                         parsed.layers, program_ran=parsed.setup_seen)


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


def _make_limits(*, wall_timeout_s: float = 5.0, cpu_s: int = 4, memory_mb: int = 512,
                 max_procs: int = 16, max_output_bytes: int = 64_000) -> _Limits:
    if not (isinstance(wall_timeout_s, (int, float)) and 0 < wall_timeout_s < math.inf):
        raise ValueError("wall_timeout_s must be a positive number")
    for name, value in (("cpu_s", cpu_s), ("memory_mb", memory_mb), ("max_procs", max_procs),
                        ("max_output_bytes", max_output_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer")
    if memory_mb < 64:
        raise ValueError("memory_mb below 64 cannot start an interpreter")
    return _Limits(float(wall_timeout_s), cpu_s, memory_mb, max_procs, max_output_bytes)


def run_python(code: str, tests: str | Sequence[str], *, wall_timeout_s: float = 5.0,
               cpu_s: int = 4, memory_mb: int = 512, max_procs: int = 16,
               max_output_bytes: int = 64_000) -> SandboxResult:
    """Run ``code`` and then ``tests`` in a fresh sandboxed interpreter (see module docstring).

    ``tests`` is one test program (``n_tests == 1``) or a list of test snippets, typically
    ``assert`` statements, each run separately after ``code`` in the same namespace and counted
    separately. Raises only for invalid arguments; whatever the program does ends in a
    :class:`SandboxResult`.
    """
    limits = _make_limits(wall_timeout_s=wall_timeout_s, cpu_s=cpu_s, memory_mb=memory_mb,
                          max_procs=max_procs, max_output_bytes=max_output_bytes)
    return _execute(code, tests, limits)


# --------------------------------------------------------------------------------------------
# Reward function
# --------------------------------------------------------------------------------------------
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_OPEN_FENCE = re.compile(r"```[ \t]*(?:python3?|py3?)[ \t]*\n", re.IGNORECASE)
_PY_LANGS = {"python", "python3", "py", "py3"}


def extract_code(text: str) -> str:
    """The last ```` ```python ```` block, else the last untagged ```` ``` ```` block, else an
    unterminated ```` ```python ```` block at the end (a cut-off response), else the text."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    for wanted in (lambda lang: lang in _PY_LANGS, lambda lang: lang == ""):
        chosen = [body for lang, body in blocks if wanted(lang)]
        if chosen:
            return chosen[-1]
    opening = list(_OPEN_FENCE.finditer(text))
    if opening:
        return text[opening[-1].end():]
    return text


def _row_tests(tests: Any, i: int) -> list[str] | None:
    """Row ``i`` of the ``tests`` column as a list of test snippets, or None when unusable.

    A string is one test program, except a JSON list of strings (how some datasets store
    tests): run as Python, such a list literal would be a no-op that always "passes".
    """
    try:
        row = tests[i]
    except (IndexError, KeyError, TypeError):
        return None
    if isinstance(row, str):
        if row.lstrip().startswith("["):
            with contextlib.suppress(ValueError):
                row = json.loads(row)
        if isinstance(row, str):
            return [row] if row.strip() else None
    if isinstance(row, (str, bytes, Mapping)):
        return None
    try:
        items = list(row)
    except TypeError:
        return None
    if items and all(isinstance(t, str) for t in items):
        return items
    return None


def make_code_reward(*, workers: int = _MAX_WORKERS,
                     **limits: Any) -> Callable[..., list[float | None]]:
    """A ``code_reward`` with other :func:`run_python` limits or pool size (1 or 2)."""
    workers = max(1, min(_MAX_WORKERS, int(workers)))
    checked = _make_limits(**limits)  # invalid limits fail here, at configuration time

    def reward(prompts: list[str], completions: list[str], *, tests: list,
               **_: Any) -> list[float | None]:
        def score(i: int) -> float | None:
            row = _row_tests(tests, i)
            if row is None:
                return None  # no tests: unscorable, not a program failure
            try:
                completion = completions[i]
                if not isinstance(completion, str):
                    return 0.0
                result = _execute(extract_code(completion), row, checked)
                if not result.program_ran:
                    return None  # the sandbox failed, not the program: unscorable
                value = result.fraction
                return value if math.isfinite(value) else 0.0
            except Exception:
                return 0.0

        n = len(completions)
        if workers == 1 or n <= 1:
            return [score(i) for i in range(n)]
        with ThreadPoolExecutor(max_workers=min(workers, n)) as pool:
            return list(pool.map(score, range(n)))

    reward.__name__ = "code_reward"
    return reward


def code_reward(prompts: list[str], completions: list[str], *, tests: list,
                **columns: Any) -> list[float | None]:
    """Fraction of each row's tests passed by the code in its completion.

    ``tests`` is a dataset column: per row, a list of test snippets (usually ``assert``
    statements), a JSON list of them, or one test program. Code is taken from the last
    ```` ```python ```` block (see :func:`extract_code`). Anything that goes wrong (no code,
    syntax error, exception, timeout, sandbox violation, ...) scores 0.0; a row without tests is
    None (unscorable). A row whose sandbox could not even be set up is None as well, so that a
    broken host shows up as unscorable rows rather than as a silent reward of 0. Never raises.
    Rows run on a pool of two workers, each in its own sandbox.
    """
    return _DEFAULT_REWARD(prompts, completions, tests=tests, **columns)


_DEFAULT_REWARD = make_code_reward()
