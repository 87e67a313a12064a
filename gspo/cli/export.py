"""``gspo export RUN_DIR --merged OUT``: a LoRA run's adapter merged into full weights."""

from __future__ import annotations

import argparse


def cmd_export(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="gspo export", description="merge the latest checkpoint's LoRA adapter into the "
        "base model and write a folder from_pretrained can load")
    p.add_argument("run", metavar="RUN_DIR", help="run folder (holds checkpoints/)")
    p.add_argument("--merged", required=True, metavar="OUT", help="output folder")
    p.add_argument("--base", default="", help="base model (default: the one the run used)")
    ns = p.parse_args(argv)
    from gspo.models.lora import export_merged

    out = export_merged(ns.run, ns.merged, base_model=ns.base)
    print(f"merged weights: {out} (from_pretrained-loadable)")
    return 0
