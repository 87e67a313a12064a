"""gspo.models.twin: the meta-device twin a copy of an FSDP2 policy is rebuilt from. Here on
unsharded policies (the same code path past the class lookup); the sharded ones run in the
slow torchrun tests (tests/trainer/test_torchrun_train.py)."""

from __future__ import annotations

import pytest
import torch

from gspo.config import LoRAConfig
from gspo.models import load_model
from gspo.models.lora import apply_lora
from gspo.models.twin import meta_twin, unsharded_class


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    named = [*model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]
    return {n: tuple(t.shape) for n, t in named}


@pytest.mark.parametrize("name", ["tiny:llama", "tiny:qwen3_moe"])
def test_the_twin_has_every_tensor_of_the_policy_on_the_meta_device(name):
    model, _ = load_model(name, seed=0)
    twin = meta_twin(model)
    assert type(twin) is type(model) is unsharded_class(model)
    assert _shapes(twin) == _shapes(model)
    assert all(t.device.type == "meta" for t in twin.parameters())


def test_a_peft_policys_twin_carries_its_adapter():
    pytest.importorskip("peft")
    model, _ = load_model("tiny:llama", seed=0)
    model = apply_lora(model, LoRAConfig(r=4))
    twin = meta_twin(model)
    assert type(twin) is type(model)
    assert _shapes(twin) == _shapes(model)
    assert any("lora_A" in n for n, _ in twin.named_parameters())
