"""Run one program and its tests in a fresh sandboxed interpreter (the layers are described in
the package docstring): pick an identity, write the payload, start the child on the text of
``_child.py``, collect its output, clean up, and turn what came back into a
:class:`SandboxResult`."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib.resources import files

from gspo.rewards.sandbox.identity import _Identity, _identity, _kill_uid, _rmtree, _sweep_files
from gspo.rewards.sandbox.limits import _child_limits, _Limits, _make_limits
from gspo.rewards.sandbox.process import _TAIL_BYTES, _collect, _Collected, _reap
from gspo.rewards.sandbox.protocol import _parse_result, _status_without_result
from gspo.rewards.sandbox.result import SandboxResult

# The child program's text, passed to ``python -c``: it lives in a real file so that ruff reads
# it, and it is never imported here (it only ever runs inside the child interpreter).
_BOOTSTRAP = files(__package__).joinpath("_child.py").read_text(encoding="utf-8")

# A run's throwaway directory is ``<tempdir>/gspo-sandbox-<pid>-<random>``: the pid says which
# process made it (and lets that process check that it left none behind).
WORKDIR_PREFIX = "gspo-sandbox-"


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
    workdir = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-")
    proc: subprocess.Popen | None = None
    result_r = -1
    try:
        if ident is not None:
            os.chown(workdir, ident.uid, ident.gid)
        os.chmod(workdir, 0o700)
        payload = _payload(nonce, code, tests, workdir, ident, limits, audit)
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
    return _verdict(got, returncode, nonce, len(tests), time.monotonic() - t0)


def _payload(nonce: str, code: str, tests: list[str], workdir: str, ident: _Identity | None,
             limits: _Limits, audit: bool) -> bytes:
    """What the child reads from its payload descriptor before the program runs."""
    return json.dumps({
        "nonce": nonce, "code": code, "tests": tests, "workdir": workdir,
        "uid": None if ident is None else ident.uid,
        "gid": None if ident is None else ident.gid,
        "audit": audit,
        "limits": _child_limits(limits),
    }).encode("utf-8")


def _verdict(got: _Collected, returncode: int | None, nonce: str, n_tests: int,
             wall: float) -> SandboxResult:
    """The result of a finished run: trusted counts only from a clean exit with a valid record."""
    parsed = _parse_result(bytes(got.result), nonce, n_tests)
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
    return SandboxResult(status == "ok", status, n_passed, n_tests, out, err, wall,
                         parsed.layers, program_ran=parsed.setup_seen)


def run_python(code: str, tests: str | Sequence[str], *, wall_timeout_s: float = 5.0,
               cpu_s: int = 4, memory_mb: int = 512, max_procs: int = 16,
               max_output_bytes: int = 64_000) -> SandboxResult:
    """Run ``code`` and then ``tests`` in a fresh sandboxed interpreter (see the package docstring).

    ``tests`` is one test program (``n_tests == 1``) or a list of test snippets, typically
    ``assert`` statements, each run separately after ``code`` in the same namespace and counted
    separately. Raises only for invalid arguments; whatever the program does ends in a
    :class:`SandboxResult`.
    """
    limits = _make_limits(wall_timeout_s=wall_timeout_s, cpu_s=cpu_s, memory_mb=memory_mb,
                          max_procs=max_procs, max_output_bytes=max_output_bytes)
    return _execute(code, tests, limits)
