"""The code-execution reward and its sandbox: correct scoring, and hostile programs contained.

Hostile programs are scored against the trivial test ``assert True``, so any 0 comes from the
containment, not from the tests. Where a kernel-side layer is tested on its own, the audit hook
is switched off through the private ``_execute(..., audit=False)``; those assertions need root
(privilege drop) or namespaces and are skipped, with the reason, when not permitted.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest

from gspo.rewards import sandbox
from gspo.rewards.sandbox import (
    STATUSES,
    SandboxResult,
    code_reward,
    extract_code,
    identity,
    protocol,
    run_python,
    runner,
)
from gspo.rewards.sandbox.limits import _make_limits

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="privilege drop to a sandbox uid needs root")
TRIVIAL = ["assert True"]


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------
def _sandbox_uids() -> list[int]:
    return [i.uid for i in identity._identities() if i.dedicated] if IS_ROOT else []


# (uid, first, last clock tick) of every sandbox run of this process: a process of a sandbox
# uid that started within one of them is this process's doing; others are another process's
# (a trainer, a second pytest), which may be running as that uid right now.
_RUNS: list[tuple[int, int, int]] = []


def _ticks() -> int:
    """Now, in the clock ticks since boot that ``/proc/PID/stat`` gives a start time in."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


@contextlib.contextmanager
def _recorded_identity() -> Iterator[identity._Identity | None]:
    """``identity._identity``, recording when this process held the uid (its lock)."""
    with identity._identity() as ident:
        first = _ticks()
        try:
            yield ident
        finally:
            if ident is not None:
                _RUNS.append((ident.uid, first, _ticks() + 1))


def _started_in_our_run(pid: int, uid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            started = int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return False
    return any(u == uid and first <= started <= last for u, first, last in _RUNS)


def _multiprocessing_helper(pid: str) -> bool:
    """Whether ``pid`` is multiprocessing's resource tracker or forkserver: started once by an
    earlier test of the session that spawned a process (an async engine), and kept for the
    life of the test process by design; the sandbox starts neither."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    return any(b"from multiprocessing.%s import main" % m in cmd
               for m in (b"resource_tracker", b"forkserver"))


def _leftover_processes() -> list[str]:
    """Live children of this test process, and any process of a dedicated sandbox uid that
    started during one of this process's sandbox runs."""
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        state, ppid = fields[0], int(fields[1])
        if ppid == me and state != b"Z" and not _multiprocessing_helper(entry):
            found.append(f"child {entry}")
    for uid in _sandbox_uids():
        found += [f"uid {uid}: pid {pid}" for pid in identity._sandbox_processes(uid)
                  if _started_in_our_run(pid, uid)]
    return found


def _sandbox_dirs() -> set[str]:
    """This process's sandbox work dirs (other processes may be running the sandbox too)."""
    mine = f"{runner.WORKDIR_PREFIX}{os.getpid()}-"
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(mine)}


@pytest.fixture(autouse=True)
def _no_side_effects(monkeypatch):
    """Every test: no new sandbox dir, no process left, /tmp's mode untouched. Only what this
    process made counts: another process on the machine may be using the sandbox meanwhile."""
    monkeypatch.setattr(runner, "_identity", _recorded_identity)
    before_dirs = _sandbox_dirs()
    tmp_mode = os.stat(tempfile.gettempdir()).st_mode
    yield
    assert _sandbox_dirs() - before_dirs == set()
    assert _leftover_processes() == []
    assert os.stat(tempfile.gettempdir()).st_mode == tmp_mode


def hostile(code: str, **limits) -> SandboxResult:
    """Run a hostile program against a trivial test; it must not pass and must score 0."""
    limits.setdefault("wall_timeout_s", 3.0)
    r = run_python(code, TRIVIAL, **limits)
    assert r.status in STATUSES
    assert not r.passed and r.fraction == 0.0, r
    assert r.program_ran  # its own doing: code_reward gives 0.0, never an "unscorable" None
    return r


def kernel_only(code: str, tests=TRIVIAL, **limits) -> SandboxResult:
    """Run without the audit hook: only the process, identity, rlimit and namespace layers."""
    limits.setdefault("wall_timeout_s", 3.0)
    r = runner._execute(code, tests, _make_limits(**limits), audit=False)
    assert "audit" not in r.isolation
    return r


def fenced(code: str) -> str:
    return f"Here you go:\n```python\n{code}\n```\nHope this helps."


# ------------------------------------------------------------------------------------------
# scoring
# ------------------------------------------------------------------------------------------
def test_correct_wrong_and_partial_programs():
    right = "def add(a, b):\n    return a + b\n"
    wrong = "def add(a, b):\n    return a - b\n"
    tests = ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"]
    r = run_python(right, tests)
    assert (r.passed, r.status, r.n_passed, r.n_tests, r.fraction) == (True, "ok", 3, 3, 1.0)
    assert "uid" in r.isolation or not IS_ROOT
    r = run_python(wrong, tests)
    assert (r.passed, r.status, r.n_passed) == (False, "failed", 1)  # add(0, 0) still holds
    assert "test 0 failed" in r.stderr_tail
    # one test program counts as one test
    r = run_python(right, "def check(f):\n    assert f(2, 2) == 4\ncheck(add)\n")
    assert (r.passed, r.n_tests) == (True, 1)

    half = ["assert add(1, 1) == 2", "assert add(1, 1) == 3"]
    rewards = code_reward(["p"] * 4,
                          [fenced(right), fenced(wrong), "no code at all", fenced(right)],
                          tests=[tests, tests, tests, half])
    assert rewards == [1.0, pytest.approx(1 / 3), 0.0, 0.5]


def test_many_failing_tests_keep_partial_credit():
    """The sandbox's own reports of failing tests must not use up the program's output budget:
    a silent program that fails 500 of 1000 tests scores 0.5, not ``output_limit`` (0)."""
    program = "def f(x):\n    return 2 * x if x % 2 == 0 else 0\n"
    r = run_python(program, [f"assert f({i}) == {2 * i}" for i in range(1000)])
    assert (r.status, r.n_passed, r.fraction) == ("failed", 500, 0.5), r.status
    assert "test 1 failed" in r.stderr_tail and "not reported" in r.stderr_tail


def test_program_errors_score_zero_and_reward_never_raises():
    assert run_python("def f(:\n", TRIVIAL).status == "error"  # syntax error
    r = run_python("raise ValueError('boom')", TRIVIAL)
    assert r.status == "error" and "ValueError: boom" in r.stderr_tail
    assert run_python("print('hi')", TRIVIAL).stdout_tail == "hi\n"
    # rows without tests are unscorable (None); odd columns and completions never raise
    out = code_reward(["p"] * 4, ["x = 1", None, "x = 1", "x = 1"],  # type: ignore[list-item]
                      tests=[None, ["assert True"], [], ["assert x == 1"]])
    assert out == [None, 0.0, None, 1.0]
    assert code_reward(["p"] * 2, ["x = 1", "x = 1"], tests=[["assert True"]]) == [1.0, None]
    # a JSON list of tests is a list, not a (no-op, always passing) list literal
    assert code_reward(["p"] * 2, ["x = 1"] * 2,
                       tests=['["assert x == 2", "assert x == 1"]', ("assert x == 1",)]) \
        == [0.5, 1.0]
    assert code_reward([], [], tests=[]) == []
    with pytest.raises(ValueError):
        run_python("", TRIVIAL, wall_timeout_s=0)


def test_json_tests_other_than_a_list_never_pass_as_a_program():
    """APPS/TACO store stdin/stdout cases as a JSON string ``{"inputs": ..., "outputs": ...}``:
    run as a test program that dict literal is a no-op, so every program "passed" (1.0). It is
    unscorable, as the same dict unencoded is; a JSON string is its program; nested brackets
    past the JSON parser's depth do not make the reward raise."""
    io = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
    tests = [io, json.dumps(io), "5", '"assert x == 2"', '"assert x == 1"', "[" * 100_000]
    assert code_reward(["p"] * 6, ["x = 1"] * 6, tests=tests) == [None, None, None, 0.0, 1.0,
                                                                   0.0]


def test_stdlib_still_works_inside_the_sandbox():
    program = """
import asyncio, collections, dataclasses, enum, logging, os, tempfile, typing, threading

Point = collections.namedtuple("Point", "x y")          # uses sys._getframe internally
class Row(typing.NamedTuple):
    a: int
@dataclasses.dataclass
class Box:
    items: list = dataclasses.field(default_factory=list)
Color = enum.Enum("Color", "RED GREEN")
logging.getLogger("x").warning("logging works")

async def work():
    await asyncio.sleep(0)
    return 3

with open("scratch.txt", "w") as f:                       # its own directory is writable
    f.write("ok")
with tempfile.TemporaryDirectory() as d:
    open(os.path.join(d, "t"), "w").close()
t = threading.Thread(target=print, args=("thread",))
t.start(); t.join()
value = asyncio.run(work()) + Point(1, 2).x + Row(1).a
"""
    r = run_python(program, ["assert value == 5", "assert open('scratch.txt').read() == 'ok'"])
    assert r.passed, r.stderr_tail
    assert "thread" in r.stdout_tail and "logging works" in r.stderr_tail


def test_a_broken_sandbox_is_unscorable_not_zero(monkeypatch):
    monkeypatch.setattr(runner, "_BOOTSTRAP", "import os\nos._exit(70)")  # setup fails
    r = run_python("x = 1", TRIVIAL)
    assert (r.passed, r.status, r.program_ran) == (False, "error", False)
    assert code_reward(["p"], ["x = 1"], tests=[TRIVIAL]) == [None]
    monkeypatch.setattr(runner.sys, "executable", "/nonexistent/python")  # cannot even start
    r = run_python("x = 1", TRIVIAL)
    assert (r.status, r.program_ran) == ("error", False) and "sandbox failure" in r.stderr_tail


def test_result_channel_is_parsed_strictly():
    nonce, other = "a" * 32, "b" * 32
    parse = protocol._parse_result
    good = f"\n{nonce} setup uid,audit\n\n{nonce} result failed 1 2\n".encode()
    assert parse(good, nonce, 2) == protocol._Parsed(True, ("uid", "audit"), ("failed", 1))
    assert parse(good, nonce, 3).outcome is None  # a different number of tests
    setup = f"{nonce} setup uid\n"
    for tampered in (f"{setup}junk\n{nonce} result ok 1 1",  # the program wrote to the pipe
                     f"{setup}{nonce} result ok 1 1\n{nonce} result ok 1 1",  # twice
                     f"{setup}{other} result ok 1 1",  # a guessed nonce
                     f"{setup}{nonce} result ok 0 1",  # inconsistent
                     f"{setup}{nonce} result ok 1 1 \xff",
                     f"{setup}{nonce} result ok 1 1" + " " * 5000):  # over the cap
        parsed = parse(tampered.encode("latin-1"), nonce, 1)
        assert parsed.setup_seen and parsed.outcome is None, tampered
    assert not parse(f"{nonce} result ok 1 1\n{setup}".encode(), nonce, 1).setup_seen
    assert not parse(b"", nonce, 1).setup_seen


def test_a_run_without_tests_reports_memory_as_memory():
    """tests=[] (the python tool's runs): the child's "memory 0 0" record was taken for
    tampering (0 of 0 passed read as "all passed", which only "ok" may say), so a program out
    of memory came back as status "error" with nothing on stderr."""
    nonce, setup = "a" * 32, f"{'a' * 32} setup uid\n"
    for status in ("memory", "error", "ok"):
        raw = f"{setup}{nonce} result {status} 0 0\n".encode()
        assert protocol._parse_result(raw, nonce, 0).outcome == (status, 0)
    for tampered in ("failed 0 0", "error 1 2", "memory 1 1", "failed 2 2"):
        raw = f"{setup}{nonce} result {tampered}\n".encode()
        assert protocol._parse_result(raw, nonce, int(tampered[-1])).outcome is None, tampered
    r = run_python("x = bytearray(10**9)", [], memory_mb=256)
    assert (r.status, r.program_ran, r.fraction) == ("memory", True, 0.0)


def test_code_extraction():
    assert extract_code("```python\na = 1\n```\ntext\n```python\nb = 2\n```") == "b = 2\n"
    assert extract_code("```\nx = 1\n```\n```bash\nls\n```") == "x = 1\n"
    assert extract_code("```py\ny = 1\n```") == "y = 1\n"
    assert extract_code("Intro\n```python\ncut = 1\noff") == "cut = 1\noff"  # truncated answer
    assert extract_code("z = 3") == "z = 3"
    assert code_reward(["p"], [fenced("def f():\n    return 7")], tests=[["assert f() == 7"]]) \
        == [1.0]


def test_worker_pool_and_workdir_removed():
    reward = sandbox.make_code_reward(workers=2, wall_timeout_s=3.0)
    comps = [fenced(f"import os\nprint(os.getcwd())\nv = {i}") for i in range(4)]
    assert reward(["p"] * 4, comps, tests=[["assert v == 0"], ["assert v == 1"],
                                           ["assert v == 9"], ["assert v == 3"]]) \
        == [1.0, 1.0, 0.0, 1.0]
    r = run_python("import os\nopen('f', 'w').write('x')\nprint(os.getcwd())", TRIVIAL)
    workdir = r.stdout_tail.strip()
    assert workdir.startswith(tempfile.gettempdir()) and not os.path.exists(workdir)


# ------------------------------------------------------------------------------------------
# hostile programs
# ------------------------------------------------------------------------------------------
def test_infinite_loop_is_killed_on_time():
    t0 = time.monotonic()
    r = hostile("while True:\n    pass\n", wall_timeout_s=1.0, cpu_s=30)
    assert r.status == "timeout"
    assert time.monotonic() - t0 < 1.0 + 1.5
    # a sleeping loop burns no CPU: the parent's wall clock still ends it
    assert hostile("import time\nwhile True:\n    time.sleep(1)", wall_timeout_s=1.0).status \
        == "timeout"
    # RLIMIT_CPU, independently of the wall clock
    t0 = time.monotonic()
    assert hostile("while True:\n    pass\n", wall_timeout_s=20, cpu_s=1).status == "timeout"
    assert time.monotonic() - t0 < 6


def test_fork_bomb_and_subprocess_loop():
    r = hostile("import os\nwhile True:\n    os.fork()\n")
    assert r.status == "killed" and "blocked os.fork" in r.stderr_tail
    r = hostile("import subprocess\nwhile True:\n    subprocess.Popen(['/bin/sleep', '60'])\n")
    assert r.status == "killed" and "blocked subprocess.Popen" in r.stderr_tail
    r = hostile("import _posixsubprocess\n_posixsubprocess.fork_exec()\n")  # no audit event
    assert r.status == "error" and "refused" in r.stderr_tail
    r = hostile("import os\nos.system('sleep 60')")
    assert r.status == "killed"


@needs_root
def test_fork_bomb_without_audit_is_bounded_and_cleaned_up(monkeypatch):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    r = kernel_only(bomb, wall_timeout_s=1.5, max_procs=8)
    assert r.status == "timeout" and not r.passed
    # escaping the process group does not escape the uid sweep (checked by the fixture too)
    escape = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(60)
    os._exit(0)
os.wait()
"""
    seen: list[int] = []
    real_kill_uid = identity._kill_uid

    def spy(uid: int) -> None:
        seen.extend(identity._sandbox_processes(uid))
        real_kill_uid(uid)

    monkeypatch.setattr(runner, "_kill_uid", spy)
    r = kernel_only(escape)
    assert r.passed  # nothing hostile is visible to the tests ...
    assert len(seen) == 1  # ... but the sleeper outlived its process group, and the sweep ...
    assert _leftover_processes() == []  # ... killed it


def test_memory_hog():
    r = hostile("x = bytearray(10 * 1024 ** 3)\n")
    assert r.status == "memory"
    r = hostile("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 24))\n")
    assert r.status == "memory"


@pytest.mark.parametrize("program", [
    "while True:\n    print('x' * 1000)",
    "import sys\nwhile True:\n    sys.stderr.write('e' * 1000)",
    "print('y' * 100_000_000)",
])
def test_huge_output_is_capped(program):
    t0 = time.monotonic()
    r = hostile(program, max_output_bytes=64_000)
    assert r.status == "output_limit"
    assert len(r.stdout_tail) <= 4096 and len(r.stderr_tail) <= 4096
    assert time.monotonic() - t0 < 3.0


def test_writing_appending_and_deleting_outside_its_directory(tmp_path):
    sentinel = tmp_path / "created_by_sandbox.txt"
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    victim_dir = tmp_path / "victim_dir"
    victim_dir.mkdir()
    (victim_dir / "keep").write_text("k")
    programs = {
        "create": f"open({str(sentinel)!r}, 'w').write('pwned')",
        "append": f"open({str(victim)!r}, 'a').write('pwned')",
        "os.open": f"import os\nos.open({str(sentinel)!r}, os.O_WRONLY | os.O_CREAT)",
        "relative": "import os\nn = os.getcwd().count('/')\n"
                    f"open('../' * n + {str(sentinel)[1:]!r}, 'w').write('pwned')",
        "remove": f"import os\nos.remove({str(victim)!r})",
        "rename": f"import os\nos.rename({str(victim)!r}, {str(sentinel)!r})",
        "rmtree": f"import shutil\nshutil.rmtree({str(victim_dir)!r})",
        "symlink": f"import os\nos.symlink({str(victim)!r}, 'link')\nopen('link', 'a').write('x')",
        "chmod": f"import os\nos.chmod({str(victim)!r}, 0o777)",
    }
    for name, program in programs.items():
        r = hostile(program)
        assert r.status == "error", (name, r)
        assert "PermissionError" in r.stderr_tail or "refused" in r.stderr_tail, name
    assert not sentinel.exists()
    assert victim.read_text() == "original"
    assert stat.S_IMODE(victim.stat().st_mode) != 0o777
    assert (victim_dir / "keep").read_text() == "k"
    if not IS_ROOT:
        pytest.skip("without root the kernel does not protect the user's own files")
    for name, program in programs.items():
        r = kernel_only(program)
        assert not r.passed, name
    assert not sentinel.exists()
    assert victim.read_text() == "original"
    assert (victim_dir / "keep").read_text() == "k"


def test_reading_secrets_from_the_environment(monkeypatch):
    secret = "gspo-test-secret-" + os.urandom(8).hex()
    monkeypatch.setenv("GSPO_TEST_SECRET", secret)
    program = f"""
import os
print(dict(os.environ))
for path in ("/proc/self/environ", "/proc/%d/environ" % os.getppid()):
    try:
        print(open(path, "rb").read())
    except OSError as e:
        print("refused", path)
assert os.environ.get("GSPO_TEST_SECRET") == {secret!r}
"""
    r = hostile(program)
    assert r.status == "error"
    assert secret not in r.stdout_tail and secret not in r.stderr_tail
    assert "'PATH': '/usr/bin:/bin'" in r.stdout_tail
    assert r.stdout_tail.count("refused") == 2
    if IS_ROOT:
        r = kernel_only(program)
        assert not r.passed and secret not in r.stdout_tail


@pytest.fixture
def tcp_server():
    """A listening socket on 127.0.0.1; yields (port, list of accepted peers)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    accepted: list = []
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            try:
                conn, peer = server.accept()
            except (TimeoutError, OSError):
                continue
            accepted.append(peer)
            conn.close()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


def test_network(tcp_server):
    port, accepted = tcp_server
    connect = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
               "s.sendall(b'exfiltrated')\n")
    r = hostile(connect)
    assert r.status == "killed" and "blocked socket" in r.stderr_tail
    r = hostile("import socket\nsocket.getaddrinfo('example.com', 80)")
    assert r.status == "killed"
    r = hostile(f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/')")
    assert r.status == "killed"
    time.sleep(0.2)
    assert accepted == []
    if "netns" not in run_python("pass", []).isolation:
        pytest.skip("network namespaces are not permitted here: only the audit hook holds")
    r = kernel_only(connect)
    assert not r.passed and "Network is unreachable" in r.stderr_tail
    time.sleep(0.2)
    assert accepted == []


def test_killing_its_parent():
    for program in ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
                    "import os, signal\nos.killpg(os.getpgid(os.getppid()), signal.SIGKILL)",
                    "import os, signal\nos.kill(-1, signal.SIGKILL)",
                    "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)"):
        r = hostile(program)
        assert r.status == "killed" and "blocked os.kill" in r.stderr_tail
    r = hostile("import os, signal\nfd = os.pidfd_open(os.getppid())\n"
                "signal.pidfd_send_signal(fd, signal.SIGKILL)")
    assert r.status == "error"
    if IS_ROOT:  # another uid: the kernel refuses the signal too
        for program in ("import os\nos.kill(os.getppid(), 9)",
                        "import os\nos.killpg(os.getpgid(os.getppid()), 9)"):
            r = kernel_only(program)
            assert r.status == "error" and "PermissionError" in r.stderr_tail
    assert os.getpid() > 0  # still here


def test_ctypes_tricks(tmp_path):
    sentinel = tmp_path / "ctypes_sentinel"
    program = f"import ctypes\nctypes.CDLL(None).system(b'touch {sentinel}')\n"
    r = hostile(program)
    assert r.status == "error" and "import of ctypes is refused" in r.stderr_tail
    r = hostile("import _ctypes\nprint(_ctypes)\n")
    assert r.status == "error"
    r = hostile("import sys\nsys.modules.pop('ctypes', None)\n__import__('ctypes')")
    assert r.status == "error"
    assert not sentinel.exists()
    if IS_ROOT:  # without the hook, system() runs, but as the sandbox uid
        r = kernel_only(program)
        assert not sentinel.exists()


def test_sys_exit_and_os_exit_before_tests_do_not_pass():
    for program in ("import sys\nsys.exit(0)\ndef f():\n    return 1\n",
                    "import os\nos._exit(0)\n",
                    "def f():\n    return 1\nraise SystemExit(0)\n"):
        r = run_python(program, ["assert f() == 1"])
        assert not r.passed and r.status == "error"
    r = run_python("import sys\ndef f():\n    sys.exit(0)\n", ["assert f() == 1"])
    assert (r.passed, r.status) == (False, "failed")


def test_faking_a_pass():
    wrong = "def f():\n    return 2\n"
    tricks = {
        "AssertionError": "import builtins\nbuiltins.AssertionError = type('N', (Exception,), {})",
        "exec/compile": "import builtins\nbuiltins.exec = lambda *a, **k: None\n"
                        "builtins.compile = lambda *a, **k: None",
        "__builtins__": "__builtins__ = {}",
        "excepthook": "import sys\nsys.excepthook = lambda *a: None",
        "print nonce": "print('\\n' + '0' * 32 + ' result ok 1 1')",
        "all fds": "import os\nfor fd in range(3, 64):\n    try:\n"
                   "        os.write(fd, b'\\n' + b'a' * 32 + b' result ok 1 1\\n')\n"
                   "    except OSError:\n        pass",
        "fds then exit": "import os\nfor fd in range(3, 64):\n    try:\n"
                         "        os.write(fd, b'\\n' + b'a' * 32 + b' result ok 1 1\\n')\n"
                         "    except OSError:\n        pass\nos._exit(0)",
        "close fds": "import os\nos.closerange(3, 64)",
    }
    for name, trick in tricks.items():
        r = run_python(wrong + trick, ["assert f() == 1"])
        assert not r.passed and r.fraction == 0.0, (name, r)


def test_the_nonce_cannot_be_found():
    """Every route from the program to the bootstrap's locals is refused."""
    program = r'''
import gc, os, re, sys
NONCE = re.compile(r"[0-9a-f]{32}")
found = set()

def harvest(frame):
    while frame is not None:
        for value in list(frame.f_locals.values()):
            if isinstance(value, str) and NONCE.fullmatch(value):
                found.add(value)
        frame = frame.f_back

def via_getframe():
    harvest(sys._getframe())

def via_traceback():
    try:
        raise RuntimeError
    except RuntimeError as e:
        harvest(e.__traceback__.tb_frame)

def via_sys_exc_info():
    try:
        raise RuntimeError
    except RuntimeError:
        harvest(sys.exc_info()[2].tb_frame)

def via_generator():
    def gen():
        yield
    g = gen()
    harvest(g.gi_frame)

def via_gc():
    for obj in gc.get_objects():
        if isinstance(obj, dict):
            for v in obj.values():
                if isinstance(v, str) and NONCE.fullmatch(v):
                    found.add(v)

def via_referrers():
    gc.get_referrers(sys.modules["__solution__"].__dict__)

def via_current_frames():
    for frame in sys._current_frames().values():
        harvest(frame)

def via_settrace():
    sys.settrace(lambda frame, event, arg: harvest(frame))

def via_signal():
    import signal
    signal.signal(signal.SIGALRM, lambda signum, frame: harvest(frame))

def via_inspect():
    import inspect
    harvest(inspect.currentframe())

def via_proc_mem():
    open("/proc/self/mem", "rb")

def via_ctypes():
    import ctypes

def via_bytecode():
    (lambda: 0).__code__.replace(co_consts=())

refused = []
for name, fn in list(globals().items()):
    if name.startswith("via_"):
        try:
            fn()
        except Exception:
            refused.append(name)
for value in found:
    for fd in range(3, 64):
        try:
            os.write(fd, ("\n%s result ok 1 1\n" % value).encode())
        except OSError:
            pass
print("refused:", ",".join(sorted(refused)))
print("found:", len(found))
'''
    r = run_python(program, ["assert False"])
    assert not r.passed and r.status == "failed"
    assert "found: 0" in r.stdout_tail
    routes = [n for n in program.split() if n.startswith("via_") and n.endswith("():")]
    refused = r.stdout_tail.split("refused: ")[1].split("\n")[0].split(",")
    assert sorted(refused) == sorted(n[:-3] for n in set(routes))


def test_code_reward_scores_hostile_rows_zero():
    reward = sandbox.make_code_reward(workers=2, wall_timeout_s=1.0)
    rows = ["import os\nos.fork()", "while True: pass", "import os\nos.kill(os.getppid(), 9)",
            "x = bytearray(10 ** 10)", "print('x' * 10 ** 6)", "import sys\nsys.exit(0)"]
    assert reward(["p"] * len(rows), [fenced(c) for c in rows], tests=[TRIVIAL] * len(rows)) \
        == [0.0] * len(rows)


def test_misc_hostile_programs_leave_the_parent_intact():
    # a C stack overflow crashes the interpreter (SIGSEGV): the parent only sees a dead child
    r = hostile("import sys, json\nsys.setrecursionlimit(10 ** 7)\n"
                "json.loads('[' * 10 ** 6 + ']' * 10 ** 6)")
    assert r.status == "killed"
    # a thread outliving the tests, and atexit handlers, do not matter
    r = run_python("import threading, time, atexit\natexit.register(print, 'bye')\n"
                   "threading.Thread(target=time.sleep, args=(60,), daemon=False).start()\n",
                   TRIVIAL)
    assert r.passed and r.wall_s < 3
    # reading files outside the stdlib and its directory is refused
    r = hostile("print(open('/etc/passwd').read())")
    assert r.status == "error" and "root:" not in r.stdout_tail
    # subinterpreters would run without the audit hook
    r = hostile("import _xxsubinterpreters as s\ns.create()")
    assert r.status == "error"
    # sockets are refused even before connecting
    r = hostile("import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM)")
    assert r.status == "killed"
    # lowering its own limits is fine, raising them is refused
    r = hostile("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))")
    assert r.status == "error"


@needs_root
def test_files_left_in_world_writable_dirs_are_swept():
    name = "gspo-litter-" + os.urandom(6).hex()
    program = (f"for d in ('/tmp', '/dev/shm', '/var/tmp'):\n"
               f"    try:\n        open(d + '/{name}', 'w').write('x')\n"
               f"    except OSError:\n        pass\n")
    r = run_python(program + "print('done')", TRIVIAL)  # refused by the audit hook ...
    assert r.passed and r.stdout_tail == "done\n"
    for d in ("/tmp", "/dev/shm", "/var/tmp"):
        assert not os.path.exists(os.path.join(d, name))
    kernel_only(program)  # ... allowed by the kernel, but removed by the sweep afterwards
    for d in ("/tmp", "/dev/shm", "/var/tmp"):
        assert not os.path.exists(os.path.join(d, name))


def test_many_runs_leave_nothing_behind():
    programs = ["x = 1", "import os\nos.fork()", "while True: pass", "print('z' * 10 ** 6)",
                "import os, signal\nos.kill(os.getppid(), signal.SIGTERM)",
                "import sys\nsys.exit(3)"]
    for i in range(12):
        r = run_python(programs[i % len(programs)], TRIVIAL, wall_timeout_s=0.8)
        assert r.status in STATUSES
    assert _leftover_processes() == []
    assert os.getpid() > 0 and signal.getsignal(signal.SIGTERM) is not None


OTHER_RUN = """
import sys
from gspo.rewards.sandbox import run_python
r = run_python("import time\\ntime.sleep(4)", ["assert True"], wall_timeout_s=20)
open(sys.argv[1], "w").write(r.status)
"""


def test_leak_checks_count_only_this_process(tmp_path):
    """Another process using the sandbox meanwhile (a trainer, a second pytest) leaves a work
    dir and, as root, processes of a sandbox uid while it runs: not leaks of this process."""
    done = tmp_path / "done"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    # started through a shell that exits at once: not a child of this process
    subprocess.run(["sh", "-c", '"$0" -c "$1" "$2" >/dev/null 2>&1 &', sys.executable,
                    OTHER_RUN, str(done)], env=env, check=True, timeout=30)
    tmp, mine = tempfile.gettempdir(), f"{runner.WORKDIR_PREFIX}{os.getpid()}-"
    deadline = time.monotonic() + 60
    while not any(n.startswith(runner.WORKDIR_PREFIX) and n[len(runner.WORKDIR_PREFIX)].isdigit()
                  and not n.startswith(mine) for n in os.listdir(tmp)):
        assert time.monotonic() < deadline and not done.exists(), "the other run never started"
        time.sleep(0.05)
    while IS_ROOT and not any(identity._sandbox_processes(uid) for uid in _sandbox_uids()):
        assert time.monotonic() < deadline and not done.exists()
        time.sleep(0.05)
    assert not done.exists()  # the other run is still going
    assert _sandbox_dirs() == set()
    assert _leftover_processes() == []
    while not done.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert done.read_text() == "ok"


def test_written_native_code_cannot_be_loaded():
    """A program that writes a shared object and loads it would run native code unaudited."""
    program = """
import glob, importlib.machinery, importlib.util, shutil, sys
src = [p for d in sys.path for p in glob.glob(d + '/_bisect*.so')][0]
shutil.copyfile(src, 'evil.so')                       # stands in for home-made machine code
spec = importlib.util.spec_from_file_location('_bisect', 'evil.so')
module = importlib.util.module_from_spec(spec)        # dlopen()
print('loaded', module)
"""
    r = hostile(program)
    if "noexec" not in r.isolation:
        pytest.skip("mount namespaces are not permitted here: a written .so can be loaded")
    assert r.status == "error" and "failed to map segment" in r.stderr_tail
    r = kernel_only(program)
    assert r.status == "error" and "failed to map segment" in r.stderr_tail


def test_disk_use_is_bounded():
    r = hostile("open('big', 'wb').write(b'x' * (20 << 20))")  # RLIMIT_FSIZE (16 MiB)
    assert r.status == "error" and "File too large" in r.stderr_tail
    r = run_python("for i in range(8):\n    open(f'f{i}', 'wb').write(b'x' * (15 << 20))", TRIVIAL,
                   memory_mb=1024)
    if "mountns" not in r.isolation:
        pytest.skip("mount namespaces are not permitted here: only RLIMIT_FSIZE bounds files")
    assert r.status == "error" and "No space left on device" in r.stderr_tail


def test_monkeypatching_the_hook_helpers_does_not_help(tmp_path):
    """The hook uses only C primitives captured before the program ran, and exact types."""
    sentinel = str(tmp_path / "sentinel")
    write = f"open({sentinel!r}, 'w').write('pwned')"
    tricks = {
        "realpath": "import os, posixpath\n"
                    "posixpath.realpath = os.path.realpath = lambda p, **k: os.getcwd() + '/x'\n"
                    + write,
        "lstat": "import os\nos.lstat = os.stat = os.readlink = lambda *a, **k: 1 / 0\n" + write,
        "builtins": "import builtins\nbuiltins.isinstance = lambda *a: False\n"
                    "builtins.len = lambda x: 0\nbuiltins.any = lambda x: True\n" + write,
        "str subclass": "class S(str):\n    def startswith(self, *a):\n        return True\n"
                        "    def split(self, *a):\n        return ['x']\n"
                        f"open(S({sentinel!r}), 'w')",
        "PathLike": "class P:\n    n = 0\n    def __fspath__(self):\n        P.n += 1\n"
                    f"        return 'inside' if P.n % 2 == 0 else {sentinel!r}\n"
                    "open(P(), 'w')",
        "os.open PathLike": "import os\nclass P:\n    n = 0\n    def __fspath__(self):\n"
                            "        P.n += 1\n"
                            f"        return 'inside' if P.n % 2 == 0 else {sentinel!r}\n"
                            "os.open(P(), os.O_WRONLY | os.O_CREAT)",
    }
    for name, program in tricks.items():
        r = hostile(program)
        assert r.status == "error" and "refused by the gspo sandbox" in r.stderr_tail, (name, r)
        assert not os.path.exists(sentinel), name
    # pathlib still works: open() turns the path into a str before the audited FileIO
    r = run_python("import pathlib\npathlib.Path('a.txt').write_text('x')",
                   ["import pathlib\nassert pathlib.Path('a.txt').read_text() == 'x'"])
    assert r.passed


def test_directory_descriptors_do_not_bypass_the_path_checks():
    """``os.open``'s audit event does not show ``dir_fd``: a relative path resolved against a
    directory descriptor (here the work dir's, used from a deeper cwd; or the stdlib's, which
    the bootstrap keeps open) must not reach files the hook would refuse by name. As non-root
    the same route read and wrote the user's own files (``~/.netrc``, ``~/.bashrc``)."""
    program = ("import os\nwork = os.getcwd()\nn = work.count('/')\n"
               "fd = os.open(work, os.O_RDONLY)\n"
               "deep = '/'.join(['d'] * (n + 2))\nos.makedirs(deep)\nos.chdir(deep)\n"
               "print(os.read(os.open('../' * n + 'etc/passwd', os.O_RDONLY, dir_fd=fd), 64))")
    r = hostile(program)
    assert r.status == "error" and "refused by the gspo sandbox" in r.stderr_tail, r
    assert "root:" not in r.stdout_tail
    # the stdlib's descriptors the program inherits: nothing may be created through them
    program = ("import os, stat\n"
               "for fd in range(3, 64):\n"
               "    try:\n        is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)\n"
               "    except OSError:\n        continue\n"
               "    if is_dir:\n"
               "        os.open('gspo_sandbox_probe.py', os.O_WRONLY | os.O_CREAT, dir_fd=fd)\n")
    r = hostile(program)
    assert r.status == "error" and "refused by the gspo sandbox" in r.stderr_tail, r
    # an absolute path still works with os.open
    r = run_python("import os\nos.close(os.open(os.path.abspath('f'), os.O_WRONLY | os.O_CREAT))",
                   ["import os\nassert os.path.exists('f')"])
    assert r.passed, r.stderr_tail


def test_sqlite_cannot_open_files_outside_its_directory():
    """sqlite opens files from C: ``ATTACH``, ``VACUUM INTO`` and ``file:`` URIs show the audit
    hook no path (or one it reads as relative). Without root the kernel protects none of the
    user's files, so such a program created databases anywhere the user may write."""
    target = "/dev/shm/gspo-sandbox-sqlite-probe.db"  # visible to an unprivileged parent too
    programs = {
        "attach": f"import sqlite3\nc = sqlite3.connect(':memory:')\n"
                  f"c.execute(\"ATTACH DATABASE '{target}' AS x\")\n"
                  "c.execute('create table x.t(a)')\nc.commit()",
        "uri": f"import sqlite3\nc = sqlite3.connect('file:{target}', uri=True)\n"
               "c.execute('create table t(a)')\nc.commit()",
    }
    for name, program in programs.items():
        r = hostile(program)
        assert r.status == "error" and "refused by the gspo sandbox" in r.stderr_tail, (name, r)
        assert not os.path.exists(target), name
