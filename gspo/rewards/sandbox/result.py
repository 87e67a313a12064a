"""What one sandboxed run reports: :class:`SandboxResult` and its statuses."""

from __future__ import annotations

from dataclasses import dataclass

STATUSES = ("ok", "failed", "timeout", "memory", "output_limit", "error", "killed")


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
