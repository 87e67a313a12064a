"""LoRA through PEFT: wrap the policy, get reference log-probs with the adapter off.

With ``lora.r > 0`` the trainer trains only the adapter. The reference policy π_ref for the
KL term is the frozen base model, so it costs no second copy of the weights: it is the same
model run with the adapter disabled (:func:`reference_logprobs`). Checkpoints hold the adapter
only (``adapter_model.safetensors`` + ``adapter_config.json``); ``gspo export``
(:func:`gspo.cli.export.export_merged`) folds it into the base weights.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gspo.config import ConfigError, import_optional
from gspo.models.loading import ModelError
from gspo.models.logprobs import token_logprobs
from gspo.models.twin import meta_twin


def is_peft(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def unwrap(model: Any) -> Any:
    """The transformers model inside a PEFT wrapper (adapter layers included), else ``model``.

    :func:`gspo.models.logprobs.token_logprobs` needs it: on a ``PeftModel`` its fast path would
    take the whole causal LM for the backbone.
    """
    return model.get_base_model() if is_peft(model) else model


def apply_lora(model: Any, cfg: Any, *, adapter_dir: str | Path | None = None) -> Any:
    """Wrap ``model`` in a PEFT LoRA adapter (:class:`gspo.config.LoRAConfig` ``cfg``); only
    the adapter is trainable. ``adapter_dir`` resumes a saved adapter instead of a fresh one."""
    peft = import_optional("peft", "lora.r > 0", "the peft package (pip install peft)")
    PeftModel, get_peft_model = peft.PeftModel, peft.get_peft_model
    if is_peft(model):
        raise ValueError("the model already carries a PEFT adapter; set lora.r=0 to train it")
    if adapter_dir is not None:
        _check_saved_adapter(Path(adapter_dir), cfg, model)
        return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
    targets = cfg.target_modules
    if targets != ["all-linear"]:  # checked first: get_peft_model changes ``model`` in place
        check_targets(model, targets)
    try:
        return get_peft_model(model, _lora_config(cfg))
    except ValueError as e:  # e.g. no module matches target_modules
        raise ModelError(_peft_refusal(e)) from None


def check_lora(model: Any, cfg: Any) -> None:
    """Whether PEFT can wrap ``model`` (its real weights or its meta-device skeleton) in the
    adapter of :class:`gspo.config.LoRAConfig` ``cfg``: :func:`check_targets`, then PEFT
    itself on a meta-device twin, which refuses a target that is not a layer it adapts (a
    whole MLP block, a norm) and ``lora.dropout > 0`` on what it adapts as parameters (the
    routers and fused experts ``all-linear`` takes on an MoE model), as :func:`apply_lora`
    would. A :class:`ModelError`. ``gspo validate`` runs it on the model's architecture
    (:func:`gspo.models.loading.model_skeleton`)."""
    get_peft_model = import_optional("peft", "lora.r > 0",
                                     "the peft package (pip install peft)").get_peft_model
    if cfg.target_modules != ["all-linear"]:
        check_targets(model, cfg.target_modules)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            get_peft_model(meta_twin(model), _lora_config(cfg))
    except ValueError as e:
        raise ModelError(_peft_refusal(e)) from None


def _peft_refusal(e: ValueError) -> str:
    """PEFT's refusal on one line, a module it cannot adapt named by its class (PEFT quotes
    its whole multi-line ``repr``)."""
    text = " ".join(str(e).split())
    text = re.sub(r"Target module (\w+)\(.*?\) is not supported", r"Target module \1 is not "
                  "supported", text)
    if "ParamWrapper" in text and "lora_dropout" in text:
        text += (" (the MoE routers and fused experts that all-linear adapts are parameters: set "
                 "lora.dropout=0, or list target_modules without them)")
    return f"lora: {text}"


def _lora_config(cfg: Any) -> Any:
    """PEFT's ``LoraConfig`` for :class:`gspo.config.LoRAConfig` ``cfg``."""
    from peft import LoraConfig

    targets = cfg.target_modules
    return LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                      target_modules="all-linear" if targets == ["all-linear"] else list(targets))


def _recorded_targets(config: Any) -> tuple[list[str], list[str]]:
    """The (modules, parameters) a PEFT ``LoraConfig`` (or its saved ``adapter_config.json``
    dict) records as adapted."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    return sorted(get("target_modules") or []), sorted(get("target_parameters") or [])


def check_targets(model: Any, targets: list[str]) -> None:
    """Every name in ``targets`` names modules of ``model`` as PEFT matches a list (the whole
    name, or its end after a dot): PEFT refuses only a list of which *no* name matches, so a
    misspelt name beside a good one would silently adapt fewer layers. An output layer and
    input embeddings that share their weight (``tie_word_embeddings``) cannot be adapted:
    merging the adapter of one (``gspo export``, the weights sent to vLLM) would change the
    other too, which the policy trained without. A :class:`ModelError`. ``gspo validate``
    runs it on the model's architecture (:func:`gspo.models.loading.model_skeleton`)."""
    names = [n for n, _ in model.named_modules()]
    hits = lambda t: [n for n in names if n == t or n.endswith(f".{t}")]  # noqa: E731
    unmatched = [t for t in targets if not hits(t)]
    if unmatched:
        raise ModelError(f"lora: target_modules {unmatched} match no module of "
                         f"{type(model).__name__}")
    head, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or inputs is None or head.weight is not inputs.weight:
        return
    for layer, what, other in ((head, "the output layer", "the input embeddings"),
                               (inputs, "the input embeddings", "the output layer")):
        name = next(n for n, m in model.named_modules() if m is layer)
        if any(name in hits(t) for t in targets):
            raise ModelError(f"lora: target_modules adapts {what} {name}, whose weight "
                             f"{type(model).__name__} shares with {other} "
                             "(tie_word_embeddings): merging the adapter (gspo export, vLLM) "
                             f"would change {other} too; leave it out")


def _check_saved_adapter(adapter_dir: Path, cfg: Any, model: Any) -> None:
    """A resumed run keeps its saved adapter's shape: ``lora.*`` values that differ from it
    would be ignored, so they are a :class:`gspo.config.ConfigError`. The targets are compared
    as PEFT records them, which is not as they are given: ``all-linear`` becomes the names it
    chose, and an MoE router or fused experts (``gate``, ``all-linear`` on Qwen3-MoE) become
    ``target_parameters``; so ``cfg`` is applied to a meta-device twin of ``model`` first."""
    from peft import get_peft_model

    saved = json.loads((adapter_dir / "adapter_config.json").read_text())
    pairs = [("r", cfg.r, saved.get("r")), ("alpha", cfg.alpha, saved.get("lora_alpha")),
             ("dropout", cfg.dropout, saved.get("lora_dropout"))]
    try:
        with warnings.catch_warnings():  # e.g. PEFT's unmatched rank_pattern keys
            warnings.simplefilter("ignore")
            twin = get_peft_model(meta_twin(model), _lora_config(cfg))
        wanted = _recorded_targets(twin.peft_config[twin.active_adapter])
    except (TypeError, ValueError):  # e.g. no module matches: compare the names as given
        wanted = (sorted(cfg.target_modules), [])
    have = _recorded_targets(saved)
    if wanted != have:
        pairs.append(("target_modules", f"{cfg.target_modules} (adapting {_shown(wanted)})",
                      _shown(have)))
    for key, want, have in pairs:
        if want != have:
            raise ConfigError(f"resume: lora.{key}={want} but the checkpoint's adapter has "
                              f"{have}; a resumed run keeps its adapter (drop the override, or "
                              "start a new run)")


def _shown(targets: tuple[list[str], list[str]]) -> str:
    """Adapted modules (their names' last part, as ``all-linear`` records every layer's) and
    parameters, for a message."""
    modules = sorted({name.rpartition(".")[2] for name in targets[0]})
    return f"modules {modules}" + (f" and parameters {targets[1]}" if targets[1] else "")


@torch.no_grad()
def merged_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of a LoRA policy's weights with the adapter folded in, as
    ``merge_and_unload`` would leave them (each adapted weight ``W + ΔW``, ``ΔW`` PEFT's own
    ``get_delta_weight``), computed out of place: the policy keeps its own weights. For an
    engine that holds plain weights (vLLM)."""
    base = model.get_base_model()
    modules = dict(base.named_modules())
    for name, t in base.state_dict().items():
        if ".lora_" in name:
            continue
        if ".modules_to_save." in name or ".original_module." in name:
            raise NotImplementedError(f"merged_weights: {name}: PEFT modules_to_save are not "
                                      "folded in")
        owner, _, attr = name.rpartition(".")
        parts = owner.split(".")
        # Each ``base_layer`` follows a LoRA layer: a module's (its ``weight``), or PEFT's
        # ParamWrapper of one parameter (``parameter_name``; nested, one per parameter, e.g.
        # the fused experts' ``gate_up_proj`` and ``down_proj`` of an MoE layer).
        for i in (i for i, part in enumerate(parts) if part == "base_layer"):
            layer = modules[".".join(parts[:i])]
            if attr == getattr(layer, "parameter_name", "weight"):
                for adapter in layer.active_adapters:
                    # in the weight's dtype, as merging in place leaves it: PEFT keeps a bf16
                    # model's adapter in fp32, and W + ΔW would be an fp32 tensor
                    t = (t + layer.get_delta_weight(adapter)).to(t.dtype)
        yield ".".join([*(part for part in parts if part != "base_layer"), attr]), t.detach()


@torch.no_grad()
def reference_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       target_mask: torch.Tensor, *, temperature: float = 1.0,
                       chunk: int = 256) -> torch.Tensor:
    """log π_ref [B, T] (fp32) of a LoRA policy: the base model, i.e. the adapter disabled.

    Same arguments as :func:`gspo.models.logprobs.token_logprobs`; no gradient.
    """
    was_training = model.training
    model.eval()
    try:
        with model.disable_adapter():
            lp, _ = token_logprobs(unwrap(model), input_ids, attention_mask, target_mask,
                                   temperature=temperature, chunk=chunk)
    finally:
        model.train(was_training)
    return lp
