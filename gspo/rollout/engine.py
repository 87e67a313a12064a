"""The rollout-engine interface: what the trainer asks of whatever samples its responses.

An engine turns prompts into a :class:`gspo.rollout.batch.Rollout` (token ids, the fp32
log-prob of each sampled token, truncation flags and, when it can, the experts it routed to)
and follows the policy's weights after every update. It declares what it can do in
:class:`EngineCapabilities`; the trainer asks those, never the engine's name.

Engine classes are registered by name in :data:`ENGINES` (``rollout.engine`` picks one). A
class declares its capabilities before it starts (``declared_capabilities(opts)``: the trainer
checks the config against them without starting, say, a vLLM server) and starts with
``start(model, tokenizer, opts)``. ``gspo.rollout`` registers ``hf``
(:mod:`gspo.rollout.hf_engine`), ``vllm`` (:mod:`gspo.rollout.vllm_engine`) and ``llamacpp``
(:mod:`gspo.rollout.llamacpp_engine`). Adding one (its name also goes in
``RolloutConfig.engine``'s ``Literal``, see docs/architecture.md):

    @ENGINES.register("mine")
    class MyEngine:
        @staticmethod
        def declared_capabilities(opts: EngineOptions) -> EngineCapabilities: ...
        @classmethod
        def start(cls, model, tokenizer, opts: EngineOptions) -> MyEngine: ...
        # plus the RolloutEngine methods: generate, sync_weights, close, and .capabilities;
        # optionally a staticmethod check_installed() raising gspo.config.MissingPackage
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gspo.registry import Registry
from gspo.rollout.batch import Rollout
from gspo.rollout.sampler import SamplingParams


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do, for the trainer to ask instead of its name.

    ``routing_unsupported``: empty when the engine can record the experts it routed to
    (routing replay R3), else why it cannot (the text of the config error R3 then raises).
    """

    returns_logprobs: bool  # fp32 log π_rollout of every sampled token
    routing_unsupported: str  # "" where R3 works, else the reason it cannot
    precision: str  # the dtype the engine samples in, e.g. "float32", "bfloat16"
    shares_policy_weights: bool  # samples from the policy module itself (no copy to sync)
    per_rank: bool  # each torchrun rank can run its own engine on its own prompts


@dataclass(frozen=True)
class EngineOptions:
    """What a builder needs besides the model: everything comes from the run's config."""

    dtype: str = "float32"  # the policy's dtype (config ``dtype``)
    precision: str = "fp32"  # hf: "bf16" samples from a bfloat16 copy (config rollout.precision)
    seed: int = 0
    record_routing: bool = False  # fill Rollout.routing (routing replay R3)
    fast_decode: bool = True  # hf: lean prefill and DenseDecoder steps where they apply
    decode_matmul: str = "auto"  # hf: DenseDecoder's products, "auto" / "blas" / "onednn"
    memory_fraction: float = 0.3  # vllm: share of device memory for weights and KV cache


class RolloutEngine(Protocol):
    """The interface every engine implements (see the module docstring)."""

    capabilities: EngineCapabilities

    def generate(self, prompts: list[list[int]], *, group_size: int, params: SamplingParams,
                 seeds: list[int]) -> Rollout:
        """``group_size`` responses per prompt, rows of a group contiguous; prompt ``i``'s
        samples are a function of ``seeds[i]`` alone (not of the batch they share), to the
        rounding of the engine's arithmetic: in fp32 the other prompts' padding moves a logit by
        ~1e-7, so a sample flips almost never; a bf16 copy (``rollout.precision=bf16``) moves it
        by ~4e-3 and a sample in a few hundred can differ with the batch. Not so for rotary
        embeddings that adapt to the length (``dynamic``, ``longrope``): each call picks its
        frequencies from the batch's largest position, so a short prompt's log-probs follow
        the longest prompt it is sampled with (docs/corrections.md)."""
        ...

    def sync_weights(self, policy: Any) -> None:
        """Make the next ``generate`` sample from ``policy``'s current weights."""
        ...

    def close(self) -> None:
        """Release what the engine holds (processes, temporary folders)."""
        ...


class EngineType(Protocol):
    """What :data:`ENGINES` holds: an engine class."""

    @staticmethod
    def declared_capabilities(opts: EngineOptions) -> EngineCapabilities: ...

    @classmethod
    def start(cls, model: Any, tokenizer: Any, opts: EngineOptions) -> RolloutEngine: ...


ENGINES: Registry[Any] = Registry("rollout engine")  # name -> an EngineType


def engine_capabilities(name: str, opts: EngineOptions) -> EngineCapabilities:
    """What the engine registered as ``name`` will be able to do, before it is started."""
    return ENGINES[name].declared_capabilities(opts)


def check_engine_installed(name: str) -> None:
    """:class:`gspo.config.MissingPackage` when the engine registered as ``name`` needs a
    package that is not installed (an engine class that needs one says so in an optional
    ``check_installed()``): the trainer asks before it makes the run folder."""
    check = getattr(ENGINES[name], "check_installed", None)
    if check is not None:
        check()


def build_engine(name: str, model: Any, tokenizer: Any, opts: EngineOptions) -> RolloutEngine:
    """The engine registered as ``name``, started on ``model``'s current weights."""
    return ENGINES[name].start(model, tokenizer, opts)


def weights_for_rollout(engine: RolloutEngine, gathered: Callable[[], Any]
                        ) -> contextlib.AbstractContextManager:
    """``gathered()`` (e.g. FSDP2's full weights) around sampling when the engine samples from
    the policy module itself; a no-op for engines with their own copy of the weights."""
    if engine.capabilities.shares_policy_weights:
        return gathered()
    return contextlib.nullcontext()
