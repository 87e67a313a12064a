"""Randomness a model applies only in training mode: dropout, LayerDrop and MoE router jitter.

The trainer computes π_old without gradients and π_θ in training mode. Any noise that training
mode adds makes π_θ ≠ π_old at θ = θ_old, so every ratio carries it: a dropout of 0.05 moves a
sequence's mean log-ratio by far more than GSPO's clip range (ε ≈ 3e-4). ``disable_dropout``
(on by default, as TRL's DPO trainer does) removes it when the policy is built.

Three places hold such noise in a Hugging Face model:

- ``torch.nn.Dropout`` modules (residual and MLP dropout, PEFT's ``lora_dropout``);
- float attributes of modules read in ``forward`` (``attention_dropout``, passed to the attention
  function; Mixtral's and MiniMax's router ``jitter_noise``; the ``layerdrop`` of OPT's, XGLM's
  and BioGPT's decoders, the probability of skipping a whole layer);
- the model's config (``attention_dropout``, ``router_jitter_noise``, ``layerdrop``, ...), which
  some modules read at call time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

_NOISY = ("dropout", "jitter", "layerdrop")


def _noisy_name(name: str) -> bool:
    return any(word in name for word in _NOISY)


def _positive_float(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _configs(model: Any) -> list[Any]:
    """The model's config and its sub-configs (e.g. a multimodal model's ``text_config``)."""
    root = getattr(model, "config", None)
    if root is None or not hasattr(root, "to_dict"):
        return []
    found, todo = [], [root]
    while todo:
        config = todo.pop()
        found.append(config)
        todo += [v for v in vars(config).values() if hasattr(v, "to_dict") and v is not config]
    return found


def _sources(model: Any) -> Iterator[tuple[Any, str, str]]:
    """Every noise source of ``model`` with a positive value: (its holder, the attribute,
    a label such as ``"model.layers.0.self_attn.attention_dropout=0.1"``)."""
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            yield module, "p", f"{prefix}p={module.p}"
        for k, v in vars(module).items():
            if _noisy_name(k) and _positive_float(v):
                yield module, k, f"{prefix}{k}={v}"
    for config in _configs(model):
        for k, v in vars(config).items():
            if _noisy_name(k) and _positive_float(v):
                yield config, k, f"config.{k}={v}"


def train_noise(model: Any) -> list[str]:
    """Where ``model`` draws random numbers in training mode, e.g.
    ``["model.layers.0.self_attn.attention_dropout=0.1", "config.router_jitter_noise=0.01"]``;
    empty when training mode is deterministic."""
    return [label for _, _, label in _sources(model)]


def disable_train_noise(model: Any) -> list[str]:
    """Set every source :func:`train_noise` finds to zero, in place; returns what was set."""
    found = list(_sources(model))
    for holder, attr, _ in found:
        setattr(holder, attr, 0.0)
    return [label for _, _, label in found]
