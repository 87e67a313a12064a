"""The sandbox package's child program: shipped as a file, passed as its exact text, and inert
when imported (it must only ever run inside the child interpreter)."""

from __future__ import annotations

import subprocess
import sys
from importlib.resources import files

from gspo.rewards.sandbox import runner

CHILD = files("gspo.rewards.sandbox").joinpath("_child.py")

# Loads the file as an ordinary module (not as __main__), then reports whether _main exists.
IMPORT_IT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("gspo_sandbox_child", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print("imported", callable(module._main))
"""


def test_the_bootstrap_is_the_text_of_the_packaged_child_file():
    assert runner._BOOTSTRAP == CHILD.read_text(encoding="utf-8")
    assert "_main()" in runner._BOOTSTRAP


def test_importing_the_child_program_runs_nothing():
    # Were _main to run on import, it would find no payload descriptor in argv and exit 70.
    proc = subprocess.run([sys.executable, "-I", "-S", "-B", "-c", IMPORT_IT, str(CHILD)],
                          capture_output=True, text=True, timeout=30, check=False)
    assert (proc.returncode, proc.stdout.strip()) == (0, "imported True"), proc.stderr
