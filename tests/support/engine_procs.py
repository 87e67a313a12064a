"""``gspo engine`` processes for the tests that train against an engine started elsewhere."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from proc_session import with_support


@contextlib.contextmanager
def gspo_engines(addresses: list[str], *, timeout_s: float = 300, exit_s: float = 60,
                 **popen: Any) -> Iterator[list[subprocess.Popen]]:
    """``gspo engine ADDRESS --timeout timeout_s`` for each address, in processes of their own.

    When the block ends without an error, every engine must exit with code 0 within
    ``exit_s`` (its trainer has closed it); the failure shows the end of its stderr. However
    the block ends, no engine outlives it; when the block fails, each engine's stderr is
    printed into the test's output. Stderr goes to a file, not a pipe that nobody reads while
    the block runs (a full pipe would stall a talkative engine, vLLM's)."""
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in addresses]
        popen["env"] = with_support(popen.get("env"))  # it may import the test's module
        procs = [subprocess.Popen([sys.executable, "-m", "gspo", "engine", a,
                                   "--timeout", str(timeout_s)], stderr=log, text=True, **popen)
                 for a, log in zip(addresses, logs)]
        try:
            yield procs
            for proc, log in zip(procs, logs):
                code = proc.wait(timeout=exit_s)
                log.seek(0)
                assert code == 0, log.read()[-3000:]
        except BaseException:  # the block failed: what each engine said, in the test's output
            for address, log in zip(addresses, logs):
                log.seek(0)
                print(f"--- gspo engine {address}, stderr:\n{log.read()[-3000:]}")
            raise
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
