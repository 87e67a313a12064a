"""A plain twin of an FSDP2-sharded policy on the meta device.

FSDP2 modules cannot be deep-copied, so whatever holds a copy of the policy beside the
training one (the bf16 rollout copy, the async engine process's model) rebuilds it from the
policy's own class and config, and for a PEFT policy its adapter config, then fills it with
the gathered weights.
"""

from __future__ import annotations

from typing import Any

import torch


def unsharded_class(module: torch.nn.Module) -> type:
    """The class ``fully_shard`` derived ``module``'s class from (its own when not sharded)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def meta_twin(model: Any) -> torch.nn.Module:
    """A new, unsharded model of ``model``'s architecture with every tensor on the meta
    device: ``cls(config)``, and a PEFT policy's adapter added to it by its own config."""
    try:
        from peft import PeftModel, get_peft_model
    except ImportError:  # no PEFT installed: no PEFT policy either
        PeftModel = None
    if PeftModel is not None and isinstance(model, PeftModel):
        inner = model.get_base_model()
        with torch.device("meta"):
            base = unsharded_class(inner)(inner.config)
            return get_peft_model(base, model.peft_config[model.active_adapter])
    with torch.device("meta"):
        return unsharded_class(model)(model.config)
