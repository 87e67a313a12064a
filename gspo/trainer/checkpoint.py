"""Atomic checkpoints: a step's folder appears complete or not at all.

Layout: ``RUN/checkpoints/step_000010/`` holds the weights (safetensors, loadable with
``from_pretrained``), the tokenizer, ``optimizer.pt`` (optimizer + scheduler, tensors only, read
back with ``weights_only=True``) and ``state.json`` (step, data position, RNG). The folder is
written under a temporary name, fsynced, then renamed; ``RUN/checkpoints/latest`` names the
newest complete one and is replaced atomically too. A folder that must go (an older step pruned
by ``keep``, or the same step written again) is first renamed to ``.old-*`` and only then
deleted (a step written again: once its new folder is in place, and until then ``latest`` still
finds the old one), so a ``step_*`` folder is never seen half-deleted either; a SIGKILL at any
instant leaves every ``step_*`` folder complete and a checkpoint to resume from
(tests/trainer/test_crash_resume.py, tests/trainer/test_resume_exact.py).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gspo.models.loading import PLAIN_TORCH
from gspo.models.lora import is_peft

LATEST = "latest"
# Tests only: "PHASE:STEP" (e.g. "renamed:3") makes the write of step_STEP announce PHASE on
# stderr and then wait, so that a test can SIGKILL the trainer at that instant of the write.
PAUSE_ENV = "GSPO_TEST_CHECKPOINT_PAUSE"
PHASES = ("weights", "complete", "renamed", "pointed")


def _phase(name: str, step: int) -> None:
    if os.environ.get(PAUSE_ENV) == f"{name}:{step}":
        print(f"[checkpoint] {name} step_{step:06d}", file=sys.stderr, flush=True)
        time.sleep(600)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every file below ``path``, and ``path`` itself, to disk."""
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(path)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a temporary file beside it, flushed to
    disk, then renamed over it (a reader, or a process killed midway, never sees half a file;
    one interrupted by an exception leaves no temporary file either)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _discard(folder: Path) -> None:
    """Delete ``folder`` in a way a kill cannot leave half-done: rename it aside, then delete."""
    aside = folder.with_name(f".old-{folder.name}")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(folder, aside)
    shutil.rmtree(aside, ignore_errors=True)


def save_checkpoint(root: Path, step: int, model: Any, tokenizer: Any, optim_state: dict,
                    state: dict[str, Any], keep: int, protect: tuple[str, ...] = (),
                    state_dict: dict[str, Any] | None = None) -> Path:
    """Write ``root/step_{step}`` atomically, point ``latest`` at it, keep the last ``keep``
    (and the folders named in ``protect``, e.g. the guard's last good checkpoint)."""
    root.mkdir(parents=True, exist_ok=True)
    resumed_from = latest_checkpoint(root)
    if resumed_from is not None and resumed_from.name.startswith(".old-"):
        # a write of the same step was killed before its new folder was in place: the old one
        # is the newest checkpoint, back under its name
        os.replace(resumed_from, root / resumed_from.name.removeprefix(".old-"))
    for stale in [*root.glob(".tmp-step_*"), *root.glob(".old-step_*")]:  # a killed write's
        shutil.rmtree(stale, ignore_errors=True)
    name = f"step_{step:06d}"
    final, tmp = root / name, root / f".tmp-{name}"
    tmp.mkdir()
    model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    _phase("weights", step)  # the folder holds weights but no optimizer.pt / state.json yet
    torch.save(optim_state, tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps(state))
    fsync_tree(tmp)
    _phase("complete", step)
    aside = root / f".old-{name}"
    if final.exists():  # re-saving the same step (e.g. after a resume): replace it whole,
        # the old folder deleted only once the new one is in place (a kill in between leaves
        # it whole, and latest_checkpoint reads it while no step folder of that name exists)
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync_dir(root)
    shutil.rmtree(aside, ignore_errors=True)
    _phase("renamed", step)
    atomic_write_text(root / LATEST, name)
    _fsync_dir(root)
    _phase("pointed", step)
    prune_checkpoints(root, keep, protect)
    return final


def prune_checkpoints(root: Path, keep: int, protect: tuple[str, ...] = ()) -> None:
    """Delete the ``step_*`` folders but the newest ``keep`` and those named in ``protect``
    (each set aside first, see :func:`_discard`)."""
    for old in sorted((p for p in root.glob("step_*") if p.is_dir()), key=_step_of)[:-keep]:
        if old.name not in protect:
            _discard(old)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint; leftovers of an interrupted write are ignored."""
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        # the folder itself, or while it is being saved again its old copy, set aside whole
        for candidate in (root / name, root / f".old-{name}"):
            if (candidate / "state.json").is_file():
                return candidate
    done = sorted((p for p in root.glob("step_*") if (p / "state.json").is_file()),
                  key=_step_of)
    return done[-1] if done else None


def _step_of(path: Path) -> tuple[int, str]:
    """A ``step_N`` folder's order: by N (``step_1000000`` after ``step_999999``, which its
    name sorts before), then by name for anything that is not a number."""
    tail = path.name.removeprefix("step_")
    return (int(tail), "") if tail.isdigit() else (-1, path.name)


def load_checkpoint_state(path: Path) -> tuple[dict, dict[str, Any]]:
    optim_state = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
    return optim_state, json.loads((path / "state.json").read_text())


def checkpoint_weights(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The full state dict of the model saved in ``path``, under the live model's names: read
    with ``from_pretrained``, as a resumed run reads it, because the files' layout is not the
    module's (transformers 5 saves a Mixture-of-Experts layer's fused expert tensors as one
    tensor per expert, and maps them back when it loads)."""
    from transformers import AutoModelForCausalLM

    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True,
                                                       **PLAIN_TORCH)
    missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
    if missing or unexpected:  # from_pretrained would fill a missing weight at random
        raise ValueError(f"{path}: weights do not match the model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    return model.state_dict()


def load_weights(model: Any, path: Path, load_state: Any = None) -> None:
    """Load the weights of checkpoint ``path`` into ``model`` in place (a LoRA policy: its
    adapter). Raises if the checkpoint does not cover every parameter. ``load_state(model,
    weights)``: how a full state dict goes into the model (default ``load_state_dict``; a
    sharded model needs :func:`gspo.trainer.distributed.full_state_loader`'s), returning its
    missing and unexpected keys."""
    from safetensors.torch import load_file

    if is_peft(model):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(path / "adapter_model.safetensors"))
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"{path}: unexpected adapter keys {result.unexpected_keys[:3]}")
        return
    weights = checkpoint_weights(path, next(model.parameters()).dtype)
    missing, unexpected = (model.load_state_dict(weights, strict=False) if load_state is None
                           else load_state(model, weights))
    # save_pretrained drops tied copies (e.g. an output layer tied to the embeddings): those
    # are the only keys allowed to be missing, and loading the original fills them.
    params = model.state_dict()

    def storage(t: torch.Tensor) -> int:  # a sharded (DTensor) parameter: its local shard's
        return (t.to_local() if hasattr(t, "to_local") else t).data_ptr()

    loaded = {storage(params[k]) for k in weights if k in params}
    untied = [k for k in missing if storage(params[k]) not in loaded]
    if untied or unexpected:
        raise ValueError(f"{path}: weights do not match the model (missing {untied[:3]}, "
                         f"unexpected {list(unexpected)[:3]})")


# ---------------------------------------------------------------------- RNG state beside torch's
def seed_extra_rngs(seed: int) -> None:
    """Seed Python's and NumPy's global RNGs with the run's seed, as ``torch.manual_seed``
    seeds torch's: reward code that draws from them scores alike in two runs of one seed,
    and a resumed run (which restores them, :func:`set_extra_rng_state`) continues the
    uninterrupted run's draws."""
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)


def extra_rng_state() -> dict[str, Any]:
    """JSON-able states of Python's and NumPy's global RNGs (reward code may use them)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss]}
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def set_extra_rng_state(state: dict[str, Any]) -> None:
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def cuda_rng_state() -> list[torch.Tensor] | None:
    return torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
