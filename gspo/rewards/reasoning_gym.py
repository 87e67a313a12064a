"""The ``reasoning_gym`` reward: each reasoning-gym dataset's own verifier.

A response's answer is the text of its last ``<answer>...</answer>`` block (reasoning-gym's
convention, read with ``reasoning_gym.utils.extract_answer``) or, when it has none, the whole
response stripped; the dataset's ``score_answer(answer, entry)`` scores it in [0, 1] (most
datasets give 1.0 for an exact answer, some partial credit, e.g. the default
``len(reference) / len(answer)`` when the reference is contained in the answer). Rows come
from ``task.name=reasoning_gym`` (:mod:`gspo.data.reasoning_gym`), which puts the dataset's
name, options and entry into the columns ``rg_dataset``, ``rg_options`` and ``rg_entry``.
"""

from __future__ import annotations

import json
import threading
from typing import Any

_SCORERS: dict[str, Any] = {}  # (name, options) as JSON -> the dataset instance that scores
_LOCK = threading.Lock()


def _scorer(name: str, options: dict[str, Any]) -> Any:
    """A dataset instance built like the task's (same options), whose ``score_answer`` scores."""
    key = json.dumps([name, options], sort_keys=True, default=str)
    with _LOCK:
        if key not in _SCORERS:
            import reasoning_gym

            _SCORERS[key] = reasoning_gym.create_dataset(name, seed=0, size=1, **options)
        return _SCORERS[key]


def extract(completion: str) -> str:
    """The answer a response gives: its last ``<answer>`` block, else the whole response."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(completion)
    return tagged if tagged is not None else completion.strip()


def reasoning_gym_reward(prompts: list[str], completions: list[str], *, rg_dataset: list[str],
                         rg_options: list[dict[str, Any]], rg_entry: list[dict[str, Any]],
                         **_: Any) -> list[float | None]:
    """``score_answer`` of each row's dataset; a verifier that raises makes its row unscorable."""
    out: list[float | None] = []
    for completion, name, options, entry in zip(completions, rg_dataset, rg_options, rg_entry):
        try:
            out.append(float(_scorer(name, options).score_answer(extract(completion), entry)))
        except Exception:  # a verifier bug on odd text: this row only, not the batch
            out.append(None)
    return out
