"""Rollout engines: prompts in, sampled token ids and their fp32 log-probs out.

Importing this package registers the engines in :data:`gspo.rollout.engine.ENGINES`.
"""

from gspo.rollout import hf_engine, llamacpp_engine, vllm_engine  # noqa: F401  (they register themselves)
from gspo.rollout.batch import Rollout, pad_batch
from gspo.rollout.engine import (
    ENGINES,
    EngineCapabilities,
    EngineOptions,
    RolloutEngine,
    build_engine,
    check_engine_installed,
    engine_capabilities,
)
from gspo.rollout.sampler import SamplingParams, generate, greedy_generate

__all__ = [
    "ENGINES",
    "EngineCapabilities",
    "EngineOptions",
    "Rollout",
    "RolloutEngine",
    "SamplingParams",
    "build_engine",
    "check_engine_installed",
    "engine_capabilities",
    "generate",
    "greedy_generate",
    "pad_batch",
]
