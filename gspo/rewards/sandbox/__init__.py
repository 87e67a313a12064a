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

Modules
-------
``_child.py`` the bootstrap, the child interpreter's own program (never imported by the parent);
``runner`` starts it and turns what comes back into a result; ``identity`` (sandbox uids, the
sweeps after a run), ``limits``, ``process`` (output collection, killing, reaping) and
``protocol`` (the result channel) are its parts; ``reward`` is the reward function.

Threat model
------------
The program is hostile: it may loop, fork, allocate, print without end, write or delete files,
read secrets, open sockets, signal other processes, load native code, or try to *fake a pass*.
The parent (a trainer or pytest, possibly root, possibly holding a GPU) must survive all of it
and score such a program 0. No single layer below is trusted on its own; each says what it does
NOT stop.

Layers, outermost first
-----------------------
1. **Separate process.** ``subprocess.Popen`` starts ``sys.executable -I -S -B -c BOOTSTRAP``
   (the text of ``_child.py``); nothing of the program is ever exec'd, eval'd or unpickled in
   the parent. ``-I`` ignores ``PYTHON*`` variables, the user site and the current directory
   on ``sys.path``; ``-S`` skips ``site`` (so third-party packages are not importable: stdlib
   only); ``-B`` writes no ``.pyc``.
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
     sub-interpreters (they would run without the hook), ``readline``/``dbm``/``sqlite3``/
     shared-memory modules (C-level file access: sqlite's ``ATTACH``, ``VACUUM INTO`` and
     ``file:`` URIs open paths that no audit event shows), every ``ctypes.*`` event,
     ``os.memfd_create`` (stubbed); constructing code objects (``code.__new__``/``replace``,
     except ``types.coroutine``'s flag change), so no hand-made bytecode;
   - writing, creating, deleting, renaming, truncating, chmod-ing outside the working
     directory (paths are resolved; relative paths may not contain ``..``; ``dir_fd``
     variants, ``os.fwalk``, symlink creation and opening directories outside the work dir are
     refused, and so is ``os.open`` of a relative path, since its audit event does not show
     ``dir_fd``: give it an absolute path), reading outside the stdlib, the work dir and a
     few harmless files (``/dev/urandom``, zoneinfo...), and all of ``/proc`` (so
     ``/proc/self/mem``);
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

from gspo.rewards.sandbox.result import STATUSES, SandboxResult
from gspo.rewards.sandbox.reward import code_reward, extract_code, make_code_reward
from gspo.rewards.sandbox.runner import run_python

__all__ = [
    "STATUSES",
    "SandboxResult",
    "code_reward",
    "extract_code",
    "make_code_reward",
    "run_python",
]
