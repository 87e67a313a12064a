"""``gspo export RUN_DIR --merged OUT``: a LoRA run's adapter merged into full weights.

Exporting reads a run (its config and checkpoints) and loads its base model, so it lives
above both the trainer and the models layer.

``OUT`` appears complete or not at all: the model and its tokenizer are written into a hidden
sibling folder that is renamed to ``OUT`` at the end. An ``OUT`` that exists and holds anything
is refused, unless ``force`` is given and it holds a saved model (not a run's checkpoint): it is
then replaced by the same rename, after the new folder is complete.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from gspo.config import ConfigError, load_config
from gspo.models import ModelError
from gspo.models.loading import PLAIN_TORCH, load_model
from gspo.trainer.checkpoint import fsync_tree, latest_checkpoint

ADAPTER_WEIGHTS = "adapter_model.safetensors"
CHECKPOINT_ONLY = ("state.json", "optimizer.pt")  # files of a training checkpoint, not an export


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _base_of(ckpt: Path, cfg_model: str) -> str:
    """The base model an adapter was trained on: the folder PEFT recorded, else the config's."""
    recorded = json.loads((ckpt / "adapter_config.json").read_text()).get(
        "base_model_name_or_path")
    if recorded and (Path(recorded) / "config.json").is_file():
        return str(recorded)
    return cfg_model


def _check_out(out: Path, force: bool) -> None:
    """Refuse an ``out`` that would lose something: a file, or a folder with contents (with
    ``force``: a folder with contents that is not a saved model, or is a run's checkpoint)."""
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise FileExistsError(f"export: {out} exists and is not a folder")
    if not any(out.iterdir()):
        return  # an empty folder: replaced by the finished one
    if not force:
        raise FileExistsError(f"export: {out} exists and is not empty (choose another OUT, "
                              "or --force to replace a model folder)")
    if not (out / "config.json").is_file() or any((out / f).exists() for f in CHECKPOINT_ONLY):
        raise FileExistsError(f"export: --force replaces only a saved model folder, and {out} "
                              "is not one (no config.json, or a run's checkpoint)")


def _put_in_place(tmp: Path, out: Path, force: bool) -> None:
    """Rename the complete ``tmp`` to ``out``; with ``force`` an existing ``out`` is first
    renamed aside (and deleted once ``tmp`` took its place; put back if that fails)."""
    aside = None
    if force and out.is_dir() and any(out.iterdir()):
        aside = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
        os.replace(out, aside)
    try:
        os.replace(tmp, out)  # onto a missing or empty folder: atomic
    except OSError:
        if aside is not None:
            os.replace(aside, out)  # the old folder back where it was
        elif out.is_dir() and any(out.iterdir()):  # filled in by someone else meanwhile
            raise FileExistsError(f"export: {out} was filled while exporting; nothing "
                                  "written") from None
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _merged_adapter(ckpt: Path, base_name: str, *, flag: str, dtype: torch.dtype,
                    seed: int) -> Any:
    """The base model ``base_name`` with the adapter of ``ckpt`` merged in. A base the adapter
    does not fit (another architecture or size) is a one-line :class:`ModelError` naming
    ``flag`` (how the base was chosen) and the adapter."""
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict

    base, _ = load_model(base_name, dtype=dtype, seed=seed)
    what = f"{flag} {base_name}"
    trained_on = (json.loads((ckpt / "adapter_config.json").read_text()).get("auto_mapping")
                  or {}).get("base_model_class")
    if trained_on and trained_on != type(base).__name__:
        raise ModelError(f"export: {what} is a {type(base).__name__}, but the LoRA adapter in "
                         f"{ckpt} was trained on a {trained_on}")
    try:
        with warnings.catch_warnings():  # missing or unused adapter keys: checked below
            warnings.filterwarnings("ignore", module=r"peft\.")
            model = PeftModel.from_pretrained(base, str(ckpt))
    except (RuntimeError, ValueError, KeyError) as e:  # "Error(s) in loading state_dict ..."
        detail = next((line.strip() for line in str(e).splitlines() if "mismatch" in line),
                      _first_line(e))  # the first "size mismatch for ...", else the first line
        raise ModelError(f"export: {what} does not fit the LoRA adapter in {ckpt} "
                         f"({detail})") from None
    if (ckpt / ADAPTER_WEIGHTS).is_file():
        from safetensors import safe_open

        with safe_open(str(ckpt / ADAPTER_WEIGHTS), "pt") as f:
            saved = set(f.keys())
        placed = set(get_peft_model_state_dict(model))
        if saved != placed:
            raise ModelError(
                f"export: {what} does not fit the LoRA adapter in {ckpt} ({len(saved - placed)} "
                f"of its {len(saved)} tensors have no place in that model, "
                f"{len(placed - saved)} of the model's adapter tensors are missing)")
    return model.merge_and_unload()


def export_merged(run_dir: str | Path, out: str | Path, *, base_model: str = "",
                  force: bool = False) -> Path:
    """Merge the latest checkpoint's LoRA adapter into its base model and save it to ``out``.

    ``base_model`` (a config ``model`` value) overrides the base recorded in the adapter or
    the run's ``config.yaml``; needed when the run was given an in-memory model; an error for
    a full fine-tuning run, whose checkpoint is copied as it is. ``out`` must not exist or be
    empty; ``force``: an ``out`` holding a saved model is replaced. Either way ``out`` is
    written atomically (module docstring). Returns ``out``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, out = Path(run_dir), Path(out)
    ckpt = latest_checkpoint(run / "checkpoints")
    if ckpt is None:
        raise FileNotFoundError(f"export: no complete checkpoint in {run}")
    lora = (ckpt / "adapter_config.json").is_file()
    if base_model and not lora:
        raise ConfigError(f"export: --base is for LoRA runs; {ckpt} holds full weights (a run "
                          "without lora.r), exported as they are")
    _check_out(out, force)
    cfg = load_config(run / "config.yaml")
    dtype = getattr(torch, cfg.dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(ckpt)
    except (OSError, ValueError) as e:  # before anything is written
        raise ModelError(f"export: cannot load the tokenizer saved in {ckpt} "
                         f"({_first_line(e)})") from None
    if lora:
        flag = "--base" if base_model else "base model"
        model = _merged_adapter(ckpt, base_model or _base_of(ckpt, cfg.model), flag=flag,
                                dtype=dtype, seed=cfg.seed)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, **PLAIN_TORCH)
        except (OSError, ValueError) as e:
            raise ModelError(f"export: cannot load the weights in {ckpt} "
                             f"({_first_line(e)})") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.mkdir()  # not mkdtemp: OUT gets the permissions of a folder made by hand
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        fsync_tree(tmp)
        _check_out(out, force)  # again: another process may have filled it meanwhile
        _put_in_place(tmp, out, force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def cmd_export(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="gspo export", description="merge the latest checkpoint's LoRA adapter into the "
        "base model and write a folder from_pretrained can load")
    p.add_argument("run", metavar="RUN_DIR", help="run folder (holds checkpoints/)")
    p.add_argument("--merged", required=True, metavar="OUT",
                   help="output folder; must not exist or be empty (see --force)")
    p.add_argument("--base", default="", help="LoRA runs: base model (default: the one the run "
                   "used)")
    p.add_argument("--force", action="store_true", help="replace an OUT that holds a saved "
                   "model (the new one takes its place once complete)")
    ns = p.parse_args(argv)
    out = export_merged(ns.run, ns.merged, base_model=ns.base, force=ns.force)
    print(f"merged weights: {out} (from_pretrained-loadable)")
    return 0
