"""The result channel between child and parent (see "Faking a pass" in the package docstring):
the records the child writes, read strictly, and the status of a run that left no trusted
result."""

from __future__ import annotations

import re
import secrets
import signal
from dataclasses import dataclass

_VIOLATION_EXIT = 86  # the audit hook ended the process (literal in _child.py; 70 = setup failed)
_RESULT_CAP = 4096  # the result channel carries two short lines; more is tampering

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
    # ok: every test passed; failed: not all did; error, memory: the program (or the first
    # tests) never got that far, none passed, which with no tests at all is 0 of 0 too
    consistent = {"ok": n_passed == total, "failed": n_passed < total,
                  "error": n_passed == 0, "memory": n_passed == 0}[parts[0]]
    if total != n_tests or n_passed > total or not consistent:
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
