"""``gspo export RUN_DIR --merged OUT``: a LoRA run's adapter merged into full weights.

Exporting reads a run (its config and checkpoints) and loads its base model, so it lives
above both the trainer and the models layer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from gspo.config import load_config
from gspo.models.loading import PLAIN_TORCH, load_model
from gspo.trainer.checkpoint import latest_checkpoint


def _base_of(ckpt: Path, cfg_model: str) -> str:
    """The base model an adapter was trained on: the folder PEFT recorded, else the config's."""
    recorded = json.loads((ckpt / "adapter_config.json").read_text()).get(
        "base_model_name_or_path")
    if recorded and (Path(recorded) / "config.json").is_file():
        return str(recorded)
    return cfg_model


def export_merged(run_dir: str | Path, out: str | Path, *, base_model: str = "") -> Path:
    """Merge the latest checkpoint's LoRA adapter into its base model and save it to ``out``.

    ``base_model`` (a config ``model`` value) overrides the base recorded in the adapter or
    the run's ``config.yaml``; needed when the run was given an in-memory model. A checkpoint
    without an adapter (full fine-tuning) is copied as it is. Returns ``out``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, out = Path(run_dir), Path(out)
    ckpt = latest_checkpoint(run / "checkpoints")
    if ckpt is None:
        raise FileNotFoundError(f"export: no complete checkpoint in {run}")
    cfg = load_config(run / "config.yaml")
    dtype = getattr(torch, cfg.dtype)
    if (ckpt / "adapter_config.json").is_file():
        from peft import PeftModel

        base, _ = load_model(base_model or _base_of(ckpt, cfg.model), dtype=dtype, seed=cfg.seed)
        model = PeftModel.from_pretrained(base, str(ckpt)).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, **PLAIN_TORCH)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(ckpt).save_pretrained(out)
    return out


def cmd_export(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="gspo export", description="merge the latest checkpoint's LoRA adapter into the "
        "base model and write a folder from_pretrained can load")
    p.add_argument("run", metavar="RUN_DIR", help="run folder (holds checkpoints/)")
    p.add_argument("--merged", required=True, metavar="OUT", help="output folder")
    p.add_argument("--base", default="", help="base model (default: the one the run used)")
    ns = p.parse_args(argv)
    out = export_merged(ns.run, ns.merged, base_model=ns.base)
    print(f"merged weights: {out} (from_pretrained-loadable)")
    return 0
