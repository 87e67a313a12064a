"""The tests' launcher helper (``tests/support/proc_session.py``): on a timeout it kills every
process the command started, not only the command (torchrun's workers outlive torchrun)."""

import subprocess
import sys
import time

import pytest
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
