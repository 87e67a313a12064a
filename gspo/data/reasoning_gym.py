"""``task.name=reasoning_gym``: procedural problems from the `reasoning-gym` package.

``task.subset`` names one of its datasets (``chain_sum``, ``leg_counting``, ...; the package
lists them in ``reasoning_gym.factory.DATASETS``), ``task.options`` are passed through to that
dataset's config (its difficulty fields, e.g. ``min_terms`` / ``max_terms`` for ``chain_sum``).
Every problem comes with the dataset's own entry, so the ``reasoning_gym`` reward
(:mod:`gspo.rewards.reasoning_gym`) scores a response with the dataset's own verifier.

The held-out split is disjoint from training by construction, as for the built-in tasks: a
problem is held out when a hash of its question says so (:func:`gspo.data.base.is_held_out`),
whatever the seed. The seed picks which problems each side draws: training walks a stream of
problems derived from ``seed`` index by index, the held-out set takes the first
``task.eval_size`` distinct held-out questions of another. A stream is a sequence of datasets
of :data:`CHUNK` problems, each built with a seed hashed from the side (train or eval), the
run's seed and its place in the stream: a reasoning-gym dataset draws problem ``i`` from
``Random(seed + i)``, so datasets built with consecutive seeds hold the same problems shifted
by one, and some datasets (acre, gsm_symbolic, list_functions, word_ladder) build or refuse
all ``size`` problems when created.

Install with ``pip install 'gspo[reasoning_gym]'``; it is imported when the task is built.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from typing import Any

from gspo.config import import_optional
from gspo.data.base import DataError, Example, is_held_out

CHUNK = 1000  # problems per dataset built (acre, gsm_symbolic, ... build all of them up front)
MAX_SKIPS = 1000  # consecutive held-out draws before a training draw gives up
EVAL_TRIES = 50  # draws per wanted held-out problem before the held-out set stays smaller


def import_reasoning_gym() -> Any:
    return import_optional("reasoning_gym", "task.name=reasoning_gym",
                           "the reasoning-gym package (pip install 'gspo[reasoning_gym]')")


def create(name: str, options: dict[str, Any], seed: int, size: int = CHUNK) -> Any:
    """``reasoning_gym.create_dataset(name, seed=seed, size=size, **options)`` with the
    package's errors (unknown dataset, unknown or invalid option) as one-line DataErrors."""
    rg = import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise DataError(f"task.subset: '{name}' is not a reasoning-gym dataset "
                        f"(e.g. {', '.join(sorted(DATASETS)[:6])}, ...; "
                        "see reasoning_gym.factory.DATASETS)")
    for reserved, why in (("seed", "the run's seed= picks the problems"),
                          ("size", "problems are drawn as the run needs them")):
        if reserved in options:
            raise DataError(f"task.options.{reserved}: set by gspo ({why})")
    try:
        return rg.create_dataset(name, seed=seed, size=size, **options)
    except (TypeError, ValueError, AssertionError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"task.options for reasoning-gym '{name}': {why}") from None


def _chunk_seed(stream: str, chunk: int) -> int:
    digest = hashlib.sha256(f"reasoning-gym-{stream}-{chunk}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


class _Stream:
    """Problem ``i`` of an endless seeded stream: problem ``i % CHUNK`` of the dataset of
    :data:`CHUNK` problems built with the seed hashed from (``stream``, ``i // CHUNK``)."""

    def __init__(self, name: str, options: dict[str, Any], stream: str) -> None:
        self.name, self.options, self.stream = name, options, stream
        self.chunk, self.dataset = 0, self._build(0)  # bad options fail here, at build time

    def _build(self, chunk: int) -> Any:
        return create(self.name, self.options, _chunk_seed(self.stream, chunk))

    def __getitem__(self, i: int) -> dict[str, Any]:
        chunk, k = divmod(i, CHUNK)
        if chunk != self.chunk:
            self.chunk, self.dataset = chunk, self._build(chunk)
        return self.dataset[k]


class ReasoningGymTask:
    """Problems of one reasoning-gym dataset; the :class:`gspo.data.base.Task` contract.

    Each :class:`Example` carries the columns the ``reasoning_gym`` reward reads:
    ``rg_dataset`` (the name), ``rg_options`` (the config fields) and ``rg_entry`` (the
    dataset's entry: question, answer, metadata).
    """

    def __init__(self, name: str, options: dict[str, Any], eval_size: int, seed: int) -> None:
        if os.environ.get("PYTHONHASHSEED", "random") == "random":
            warnings.warn("task.name=reasoning_gym in a process whose string hashing is random "
                          "(PYTHONHASHSEED unset): some reasoning-gym datasets (ransom_note, "
                          "word_ladder, ...) draw their problems in the order of Python sets, so "
                          "another process (a torchrun rank, a resumed run, another arm of a "
                          "comparison) draws other problems with the same seed; the gspo command "
                          "sets PYTHONHASHSEED=0, from Python start with it set", stacklevel=2)
        self.name, self.options = name, dict(options)
        self.train = _Stream(name, self.options, f"train-{seed}")
        self.index = 0
        held = _Stream(name, self.options, f"eval-{seed}")
        seen: set[str] = set()
        self.eval_examples: list[Example] = []
        for i in range(eval_size * EVAL_TRIES):
            if len(self.eval_examples) >= eval_size:
                break
            entry = held[i]
            q = str(entry["question"])
            if q not in seen and is_held_out(q):
                seen.add(q)
                self.eval_examples.append(self._example(entry))

    def _example(self, entry: dict[str, Any]) -> Example:
        return Example(str(entry["question"]), str(entry["answer"]),
                       {"rg_dataset": self.name, "rg_options": self.options, "rg_entry": entry})

    def sample(self, n: int) -> list[Example]:
        out: list[Example] = []
        skips = 0
        while len(out) < n:
            entry = self.train[self.index]
            self.index += 1
            if is_held_out(str(entry["question"])):
                skips += 1
                if skips > MAX_SKIPS:
                    raise DataError(f"reasoning-gym '{self.name}': {MAX_SKIPS} draws in a row "
                                    "were held-out problems (too few distinct problems?)")
                continue
            skips = 0
            out.append(self._example(entry))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = int(state["index"])
