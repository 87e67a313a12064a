"""The tests' launcher helpers (``tests/support``): ``run_session`` kills, on a timeout, every
process the command started, not only the command (torchrun's workers outlive torchrun);
``gspo_engines`` fails a block whose engines did not exit cleanly, and outlives none of them."""

import subprocess
import sys
import time

import pytest
from engine_procs import gspo_engines
from proc_session import run_session

LAUNCHER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
print("started", flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and waiting to be reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_timed_out_command_takes_the_processes_it_started_with_it(tmp_path):
    pid_file = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_session([sys.executable, "-c", LAUNCHER, str(pid_file)], timeout=5)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the launcher's child outlived the timeout"


def test_a_finished_command_returns_as_subprocess_run_does():
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    proc = run_session([sys.executable, "-c", code], timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out\n", "err\n")


def test_an_engine_that_failed_fails_the_block_with_its_error():
    with pytest.raises(AssertionError, match="address must be tcp://HOST:PORT"):
        with gspo_engines(["nonsense://x"]):
            pass


def test_no_engine_outlives_a_block_that_raised(tmp_path):
    with pytest.raises(KeyError):
        with gspo_engines([f"file://{tmp_path}/store"], timeout_s=120) as (engine,):
            raise KeyError("the test failed")
    assert engine.returncode is not None  # killed and reaped on the way out


def test_a_launched_command_can_import_what_the_tests_import():
    """A child that imports a test module (an engine unpickling a test's class) needs the
    helpers that module imports."""
    proc = run_session([sys.executable, "-c", "import engine_procs, proc_session"], timeout=60)
    assert proc.returncode == 0, proc.stderr
