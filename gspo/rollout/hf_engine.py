"""``rollout.engine: hf``: gspo's own sampler on the policy module itself, or on a bf16 copy.

``rollout.precision: bf16`` samples from a bfloat16 copy of the fp32 policy (parameters cast,
buffers such as the rotary frequencies kept): the reference source of train-inference mismatch
(π_rollout ≠ π_old at identical weights). The copy follows the policy after every update
(:meth:`HFEngine.sync_weights`, timed by the trainer as ``time/weight_sync_s``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from gspo.config import ConfigError
from gspo.models.tokens import eos_ids
from gspo.models.twin import meta_twin
from gspo.rollout.batch import Rollout
from gspo.rollout.engine import ENGINES, EngineCapabilities, EngineOptions
from gspo.rollout.sampler import SamplingParams, generate, onednn_refusal

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}  # rollout.precision -> the copy's dtype


def low_precision_copy(model: Any, dtype: torch.dtype) -> Any:
    """A frozen copy of ``model`` in eval mode with every parameter cast to ``dtype``
    (buffers keep theirs; tied parameters stay tied). An FSDP2 policy, which cannot be
    deep-copied, is rebuilt from its class and config and filled from its weights, which the
    caller has gathered (``Dist.full_weights``)."""
    from torch.distributed.fsdp import FSDPModule

    twin = (_rebuilt(model) if isinstance(model, FSDPModule) else copy.deepcopy(model)).eval()
    for p in twin.parameters():
        p.requires_grad_(False)
        p.data = p.data.to(dtype)
    return twin


def _rebuilt(model: Any) -> Any:
    """A plain (unsharded) model of an FSDP2 policy's own architecture, holding its gathered
    weights and buffers, matched by name."""
    twin = meta_twin(model)
    src = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    twin = twin.to_empty(device=next(iter(src.values())).device)
    if hasattr(twin, "tie_weights"):
        twin.tie_weights()  # to_empty gives tied parameters a tensor each
    dst = {**dict(twin.named_parameters()), **dict(twin.named_buffers())}
    if dst.keys() != src.keys():
        raise RuntimeError(f"rollout.precision=bf16 with FSDP2: {type(twin).__name__} rebuilt "
                           "from its config does not have the policy's tensors; use "
                           "dist.strategy=ddp")
    with torch.no_grad():
        for name, t in dst.items():
            t.copy_(src[name])
    return twin


@ENGINES.register("hf")
class HFEngine:
    """gspo's own KV-cached sampler (:func:`gspo.rollout.sampler.generate`). At
    ``precision=fp32`` it samples from the policy module itself: nothing to copy after an
    update, the log-probs are the policy's own. At ``bf16`` it samples from a bf16 copy."""

    def __init__(self, model: Any, tokenizer: Any, opts: EngineOptions) -> None:
        if opts.precision not in PRECISIONS:
            raise ValueError(f"hf engine: precision must be one of {', '.join(PRECISIONS)}, "
                             f"got {opts.precision!r}")
        dtype = PRECISIONS[opts.precision]
        self.opts = opts
        self.model = model if dtype is None else low_precision_copy(model, dtype)
        # refused here, at the start, rather than at the first rollout (the sampler's check)
        if (why := onednn_refusal(self.model, opts.decode_matmul, opts.fast_decode)) is not None:
            raise ConfigError(f"rollout.decode_matmul=onednn: {why}")
        self.eos, self.pad_id = eos_ids(model, tokenizer), tokenizer.pad_token_id
        self.capabilities = self.declared_capabilities(opts)

    @staticmethod
    def declared_capabilities(opts: EngineOptions) -> EngineCapabilities:
        own = opts.precision == "fp32"
        return EngineCapabilities(returns_logprobs=True, routing_unsupported="",
                                  precision=opts.dtype if own else "bfloat16",
                                  shares_policy_weights=own, per_rank=True)

    @classmethod
    def start(cls, model: Any, tokenizer: Any, opts: EngineOptions) -> HFEngine:
        return cls(model, tokenizer, opts)

    def generate(self, prompts: list[list[int]], *, group_size: int, params: SamplingParams,
                 seeds: list[int]) -> Rollout:
        gens = [torch.Generator().manual_seed(s) for s in seeds]  # one stream per prompt
        return generate(self.model, prompts, group_size=group_size, params=params, eos=self.eos,
                        pad_id=self.pad_id, generator=gens,
                        record_routing=self.opts.record_routing,
                        fast_decode=self.opts.fast_decode,
                        decode_matmul=self.opts.decode_matmul)

    @torch.no_grad()
    def sync_weights(self, policy: Any) -> None:
        if self.capabilities.shares_policy_weights:
            if policy is not self.model:
                raise ValueError("the hf engine samples from the policy module it was built with")
            return
        for dst, src in zip(self.model.parameters(), policy.parameters(), strict=True):
            dst.copy_(src)  # casts to the copy's dtype

    def close(self) -> None:
        pass
