"""``rollout.engine: hf``: gspo's own sampler on the policy module itself."""

from __future__ import annotations

from typing import Any

import torch

from gspo.models.tokens import eos_ids
from gspo.rollout.batch import Rollout
from gspo.rollout.engine import ENGINES, EngineCapabilities, EngineOptions
from gspo.rollout.sampler import SamplingParams, generate


@ENGINES.register("hf")
class HFEngine:
    """gspo's own KV-cached sampler (:func:`gspo.rollout.sampler.generate`) on the policy module
    itself: nothing to copy after an update, the log-probs are the policy's own in fp32."""

    def __init__(self, model: Any, tokenizer: Any, opts: EngineOptions) -> None:
        self.model, self.opts = model, opts
        self.eos, self.pad_id = eos_ids(model, tokenizer), tokenizer.pad_token_id
        self.capabilities = self.declared_capabilities(opts)

    @staticmethod
    def declared_capabilities(opts: EngineOptions) -> EngineCapabilities:
        return EngineCapabilities(returns_logprobs=True, routing_unsupported="",
                                  precision=opts.dtype, shares_policy_weights=True,
                                  per_rank=True)

    @classmethod
    def start(cls, model: Any, tokenizer: Any, opts: EngineOptions) -> HFEngine:
        return cls(model, tokenizer, opts)

    def generate(self, prompts: list[list[int]], *, group_size: int, params: SamplingParams,
                 seeds: list[int]) -> Rollout:
        gens = [torch.Generator().manual_seed(s) for s in seeds]  # one stream per prompt
        return generate(self.model, prompts, group_size=group_size, params=params, eos=self.eos,
                        pad_id=self.pad_id, generator=gens,
                        record_routing=self.opts.record_routing,
                        fast_decode=self.opts.fast_decode)

    def sync_weights(self, policy: Any) -> None:
        if policy is not self.model:
            raise ValueError("the hf engine samples from the policy module it was built with")

    def close(self) -> None:
        pass

