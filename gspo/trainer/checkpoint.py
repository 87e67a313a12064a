"""Atomic checkpoints: a step's folder appears complete or not at all.

Layout: ``RUN/checkpoints/step_000010/`` holds the weights (safetensors, loadable with
``from_pretrained``), the tokenizer, ``optimizer.pt`` (optimizer + scheduler, tensors only, read
back with ``weights_only=True``) and ``state.json`` (step, data position, RNG). The folder is
written under a temporary name, fsynced, then renamed; ``RUN/checkpoints/latest`` names the
newest complete one and is replaced atomically too.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

LATEST = "latest"


def _fsync_tree(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def save_checkpoint(root: Path, step: int, model: Any, tokenizer: Any, optim_state: dict,
                    state: dict[str, Any], keep: int) -> Path:
    """Write ``root/step_{step}`` atomically, point ``latest`` at it, keep the last ``keep``."""
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:06d}"
    final, tmp = root / name, root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    torch.save(optim_state, tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps(state))
    _fsync_tree(tmp)
    if final.exists():  # re-saving the same step (e.g. after a rollback): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(root / LATEST, name)
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint; leftovers of an interrupted write are ignored."""
    pointer = root / LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / "state.json").is_file():
            return candidate
    done = sorted(p for p in root.glob("step_*") if (p / "state.json").is_file())
    return done[-1] if done else None


def load_checkpoint_state(path: Path) -> tuple[dict, dict[str, Any]]:
    optim_state = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
    return optim_state, json.loads((path / "state.json").read_text())
