"""Rollout engines: prompts in, sampled token ids and their fp32 log-probs out."""

from gspo.rollout.batch import Rollout, pad_batch
from gspo.rollout.sampler import SamplingParams, generate, greedy_generate

__all__ = ["Rollout", "SamplingParams", "generate", "greedy_generate", "pad_batch"]
