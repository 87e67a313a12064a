"""The sandbox's child program (the bootstrap): the only code the child interpreter runs before
the model's program. It starts as the parent's user (maybe root) and is trusted; everything it
reads from the payload is data.

Not a module of the library: :mod:`gspo.rewards.sandbox.runner` reads this file's text and
runs it with ``python -I -S -B -c <text> <payload fd> <result fd>`` (stdlib only, no ``site``).
Importing it runs nothing. ``_main`` stays one function on purpose: the nonce must live only in
a local variable of its frame, and every helper it defines closes over state captured before the
program's first byte runs (see the package docstring, "Faking a pass"). 86 and 70 below are
``_VIOLATION_EXIT`` and "setup failed" in :mod:`gspo.rewards.sandbox.protocol`.
"""

import sys as _sys


class _SandboxDenied(PermissionError, ValueError):
    """Refused by the gspo sandbox (a ValueError too: stdlib fallbacks for frames keep working)."""


class _ImportDenied(ImportError):
    """Import refused by the gspo sandbox."""


def _denied(*args, **kwargs):
    raise _SandboxDenied("refused by the gspo sandbox")


def _main():
    import _posixsubprocess
    import _signal
    import _thread
    import json
    import os
    import posix
    import resource
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
        die(f"bad payload: {e!r}")

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
        remap[p] = f"/proc/self/fd/{fd:d}"
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
        # libc is the enclosing frame's, deleted once setup is done (noqa: F821 below); this
        # helper only runs before that.
        if libc.unshare(CLONE_NEWNS) != 0:  # noqa: F821
            return
        if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:  # noqa: F821
            return
        flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
        for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
            if os.path.isdir(d) and not os.path.islink(d):
                libc.mount(b"tmpfs", d.encode(), b"tmpfs", flags, b"size=16m,mode=1777")  # noqa: F821
        if not os.path.isdir(workdir):
            os.makedirs(workdir, mode=0o700)
            os.chown(workdir, owner_uid, owner_gid)
        opts = f"size={limits['disk_kb']:d}k,mode=0700,uid={owner_uid:d},gid={owner_gid:d}"
        if libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", flags, opts.encode()) == 0:  # noqa: F821
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
                die(f"cannot set up private mounts: {e}")
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        except OSError as e:
            die(f"cannot drop privileges: {e}")
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
            for name, text in (("setgroups", "deny"), ("uid_map", f"{ruid:d} {ruid:d} 1"),
                               ("gid_map", f"{rgid:d} {rgid:d} 1")):
                try:
                    with open("/proc/self/" + name, "w") as f:
                        f.write(text)
                except OSError:
                    pass
            try:
                private_mounts(ruid, rgid)
            except OSError as e:
                die(f"cannot set up private mounts: {e}")

            # ctypes reads _fields_ off the class as a list: its protocol, hence the noqa
            class _Hdr(ctypes.Structure):
                _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]  # noqa: RUF012

            class _Data(ctypes.Structure):
                _fields_ = [  # noqa: RUF012
                    ("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
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
        me = f"\t{os.getuid():d}\t"
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/status") as f:
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
        die(f"cannot set resource limits: {e}")
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
        "_dbm", "_gdbm", "readline", "_posixshmem", "_multiprocessing", "ossaudiodev",
        "sqlite3", "_sqlite3"})  # sqlite opens files itself: ATTACH, VACUUM INTO, file: URIs
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
            if mode is None and not as_text(path).startswith("/"):
                # os.open: its event does not carry dir_fd, so a relative path may be resolved
                # against any directory descriptor (the stdlib's, opened above, or one of the
                # work dir used from a deeper cwd), not against the cwd that is checked here
                raise Denied(f"os.open of relative path {path!r} is refused by the gspo sandbox")
            writing = (_type(flags) is _int and _int_and(flags, write_flags)) or (
                mode is not None and ("w" in mode or "a" in mode or "x" in mode or "+" in mode))
            if writing:
                if not may_write(path):
                    raise Denied(f"writing {path!r} is refused by the gspo sandbox")
            elif not may_read(path):
                raise Denied(f"reading {path!r} is refused by the gspo sandbox")
            if mode is None:  # os.open: no directory descriptor outside the work dir (dir_fd)
                real = resolve(as_text(path))
                if is_dir(real) and not within(real, work):
                    raise Denied(f"opening directory {path!r} is refused by the gspo sandbox")
        elif event == "os.listdir" or event == "os.scandir":
            if args and not may_read(args[0]):
                raise Denied(f"listing {args[0]!r} is refused by the gspo sandbox")
        elif event in path_events:
            paths, dir_fds = path_events[event]
            for i in dir_fds:
                if i < _len(args) and args[i] is not None and args[i] != -1:
                    raise Denied(event + " with dir_fd is refused by the gspo sandbox")
            for i in paths:
                if i < _len(args) and not may_write(args[i]):
                    raise Denied(f"{event} on {args[i]!r} is refused by the gspo sandbox")
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
                raise ImportDenied(f"import of {name} is refused by the gspo sandbox")

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
        emit(f"{nonce} setup {','.join(layers)}")
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
    # the first failures only: these reports count towards max_output_bytes like the
    # program's own output, so one per failing test would turn a program that fails a few
    # hundred tests into output_limit (0) instead of partial credit
    reports_left = 8
    if status == "ok":
        for index, test in _enumerate(tests):
            try:
                _exec(_compile(test, f"<test {index:d}>", "exec"), ns)
            except _MemoryError:
                memory_hit = True
            except _BaseException as exc:
                if reports_left > 0:
                    report(f"test {index:d} failed", exc)
                elif reports_left == 0:
                    say("further failing tests are not reported")
                reports_left -= 1
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
        emit(f"{nonce} result {status} {n_passed:d} {_len(tests):d}")
    except _BaseException:
        _exit(70)
    _exit(0)


if __name__ == "__main__":  # python -c runs it as __main__; an import runs nothing
    _main()
