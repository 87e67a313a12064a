"""The run folder's append-only logs: the reward error log, and cutting logs back on resume.

* :class:`RewardErrorLog` writes each reward function's first traceback once to
  ``RUN/reward_errors.log``.
* :func:`log_sizes` / :func:`truncate_logs`: the append-only logs are cut back on resume to what
  they held when the checkpoint was written, so no step is logged twice or lost.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

APPEND_ONLY_LOGS = ("metrics.jsonl", "samples.jsonl")


class RewardErrorLog:
    """Append each reward function's first error to ``RUN/reward_errors.log``, once per run
    (names already in the file, from before a resume, are not written again)."""

    HEADER = re.compile(r"^== reward function '(.*)' first failed at step \d+", re.M)

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "reward_errors.log"
        self.logged = set(self.HEADER.findall(self.path.read_text())) if self.path.is_file() \
            else set()

    def update(self, step: int, first_errors: dict[str, str],
               ranks: dict[str, int] | None = None) -> list[str]:
        """Write the errors not logged yet; returns the names written. ``ranks``: under
        torchrun, the rank whose rows each error comes from (named in its header)."""
        new = [n for n in first_errors if n not in self.logged]
        if new:
            with open(self.path, "a") as fh:
                for name in new:
                    where = f" on rank {ranks[name]}" if ranks and name in ranks else ""
                    fh.write(f"== reward function '{name}' first failed at step {step}{where} "
                             f"==\n{first_errors[name].rstrip()}\n\n")
            self.logged.update(new)
        return new


def log_sizes(run_dir: Path) -> dict[str, int]:
    return {name: (run_dir / name).stat().st_size if (run_dir / name).is_file() else 0
            for name in APPEND_ONLY_LOGS}


def truncate_logs(run_dir: Path, sizes: dict[str, int]) -> None:
    """Cut each append-only log back to its size at checkpoint time: the lines written after it
    (including a line cut short by a kill) belong to steps the resumed run redoes."""
    for name, size in sizes.items():
        path = run_dir / name
        if path.is_file() and path.stat().st_size > size:
            os.truncate(path, size)
