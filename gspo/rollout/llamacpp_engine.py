"""``rollout.engine: llamacpp``: llama.cpp (``llama-cpp-python``) samples from 8-bit weights.

* The policy is exported to a GGUF file with every matrix in ``Q8_0`` (blocks of 32 int8
  weights with one fp16 scale; norms stay fp32), the layout of llama.cpp's own
  ``convert_hf_to_gguf.py --outtype q8_0``, written with the ``gguf`` package and loaded by
  ``llama_cpp.Llama``. ``sync_weights`` re-exports and reloads after every update: llama.cpp
  has no in-place weight update, so the sync cost is one quantise + write + load.
* llama.cpp only computes logits: the token is drawn and its log-prob computed by gspo's own
  sampling step (:func:`gspo.rollout.sampler._next_tokens`) on those logits, i.e.
  log_softmax(logits / T) in fp32 at the same per-prompt uniforms as the ``hf`` engine. So
  with identical logits both engines draw identical tokens, and ``objective.old_logprobs:
  rollout`` (arXiv:2507.18071 v2, §5.4) gets the sampled distribution's own log-probs.
  llama-cpp-python's ``logprobs`` output would not do: it is log_softmax of the raw logits
  (temperature 1), not of the distribution sampled from (benchmarks/bench_engines.py checks).
* Each prompt is prefilled once; its G samples reuse the prompt's KV cache (the context is
  rewound to the prompt's end between samples). The context starts at ``N_CTX`` tokens and
  is reloaded larger (:func:`context_size`) when a prompt + ``max_new_tokens`` (a multi-turn
  context, in later turns) needs more. Decoding runs one sequence at a time:
  llama-cpp-python's high-level ``Llama`` has no batched multi-sequence decode.
* Llama-architecture policies only (``LlamaForCausalLM``: SmolLM2, tiny:llama; RoPE plain,
  linear or Llama 3.x's ``llama3``, whose factors go in the ``rope_freqs`` tensor); tokens go
  in and out as ids, the GGUF's vocabulary is the tokenizer's token list (never used to
  tokenise). No MoE routing (R3 is a config error), no LoRA sync.

Install with ``pip install 'gspo[llamacpp]'`` (PyPI ships ``llama-cpp-python`` as an sdist:
it compiles llama.cpp, about 20 min on 2 cores).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gspo.config import check_optional, import_optional
from gspo.models.tokens import eos_ids
from gspo.rollout.batch import Rollout
from gspo.rollout.engine import ENGINES, EngineCapabilities, EngineOptions
from gspo.rollout.sampler import SamplingParams, _next_tokens, _uniforms

PRECISION = "q8_0"
N_CTX = 2048  # tokens of context (prompt + response) the engine first reserves KV cache for
NO_ROUTING = "llama.cpp does not report the experts it routed to (and the engine is dense-only)"


LLAMA_CPP = ("llama_cpp", "rollout.engine=llamacpp",
             "llama-cpp-python (pip install 'gspo[llamacpp]'; it compiles llama.cpp)")


def _import_llama_cpp() -> Any:
    return import_optional(*LLAMA_CPP)


def _permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half q/k rows -> llama.cpp's interleaved rotary layout (what
    ``convert_hf_to_gguf.py`` does for the llama architecture)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _tokenizer_fields(writer: Any, tokenizer: Any, model: Any) -> None:
    """The tokenizer's token list (and BPE merges) so llama.cpp can load the file; gspo hands
    it token ids, never text."""
    import gguf

    vocab = model.config.vocab_size
    tokens = [tokenizer.convert_ids_to_tokens(i) or f"<unused{i}>" for i in range(vocab)]
    special = set(tokenizer.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([int(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
                            for i in range(vocab)])
    merges: list[str] = []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        model_json = json.loads(backend.to_str()).get("model", {})
        merges = [m if isinstance(m, str) else " ".join(m) for m in model_json.get("merges", [])]
    # llama.cpp refuses a BPE vocabulary without merges (tiny models' byte tokenizer has
    # none): one placeholder pair, never used since gspo passes ids, not text
    writer.add_token_merges(merges or [f"{tokens[-2]} {tokens[-1]}"])
    for name, tid in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id),
                      ("pad", tokenizer.pad_token_id)):
        if tid is not None:
            getattr(writer, f"add_{name}_token_id")(int(tid))


# rope_type values whose rescaling is static, one factor per rotary frequency and no attention
# scaling: llama.cpp divides each frequency by its ``rope_freqs`` entry (Llama 3.x: "llama3")
STATIC_ROPE = ("linear", "llama3")


def _rope_factors(model: Any, theta: float, head_dim: int) -> np.ndarray | None:
    """llama.cpp's ``rope_freqs`` for a model whose rotary frequencies are rescaled (Llama
    3.x's ``rope_type: llama3``): unscaled frequency / the model's own, per frequency (what
    ``convert_hf_to_gguf.py`` writes for llama3); None for plain RoPE. Rescalings that depend
    on the length or scale the attention (dynamic, YaRN, ...) are refused."""
    cfg = model.config
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    rotary = model.model.rotary_emb
    if kind not in STATIC_ROPE or float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        raise NotImplementedError(f"rollout.engine=llamacpp: the GGUF export covers plain, "
                                  f"linear and llama3 RoPE, not rope_type={kind!r}; use "
                                  "rollout.engine=hf")
    # the unscaled frequencies as transformers computes them (float32), so unscaled ones give 1
    plain = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return (plain / rotary.inv_freq.detach().float().cpu()).numpy()


@torch.no_grad()
def export_gguf(model: Any, tokenizer: Any, path: str | Path) -> Path:
    """Write ``model`` (a Hugging Face Llama) to ``path`` as a GGUF with Q8_0 matrices."""
    import gguf

    cfg = model.config
    if getattr(cfg, "model_type", "") != "llama":
        raise NotImplementedError(f"rollout.engine=llamacpp: GGUF export covers Llama models "
                                  f"only (this one is {cfg.model_type!r}); use "
                                  "rollout.engine=hf")
    if hasattr(model, "merge_adapter"):
        raise NotImplementedError("rollout.engine=llamacpp with LoRA: merged-weight sync is not "
                                  "implemented; use rollout.engine=hf")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_kv = cfg.num_key_value_heads or cfg.num_attention_heads
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    theta = float(cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None)
                  else cfg.rope_theta)
    writer.add_rope_freq_base(theta)
    factors = _rope_factors(model, theta, head_dim)
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    _tokenizer_fields(writer, tokenizer, model)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for hf_name, t in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp reuses token_embd as the output layer
        base, _, suffix = hf_name.rpartition(".")
        name = names.get_name(base)
        if name is None:
            raise NotImplementedError(f"rollout.engine=llamacpp: no GGUF name for {hf_name}")
        w = t.detach().float().cpu().numpy()
        if base.endswith("q_proj"):
            w = _permute_qk(w, cfg.num_attention_heads)
        elif base.endswith("k_proj"):
            w = _permute_qk(w, n_kv)
        if w.ndim == 2 and w.shape[1] % 32 == 0:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(f"{name}.{suffix}", gguf.quants.quantize(w, q8), raw_dtype=q8)
        else:
            writer.add_tensor(f"{name}.{suffix}", np.ascontiguousarray(w, dtype=np.float32))
    if factors is not None:  # one tensor for every layer, as convert_hf_to_gguf.py writes it
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def context_size(current: int, needed: int, model_max: int | None) -> int:
    """Tokens of context for a request of ``needed`` (prompt + ``max_new_tokens``): ``current``
    if enough, else twice as many (not past ``model_max``, the model's
    ``max_position_embeddings``, where known) or ``needed`` if that is more."""
    if needed <= current:
        return current
    grown = 2 * current if model_max is None else min(2 * current, max(model_max, current))
    return max(needed, grown)


@ENGINES.register("llamacpp")
class LlamaCppEngine:
    """One ``llama_cpp.Llama`` on a Q8_0 GGUF export of the policy."""

    def __init__(self, model: Any, tokenizer: Any, opts: EngineOptions,
                 n_ctx: int = N_CTX, n_threads: int | None = None) -> None:
        self.llama_cpp = _import_llama_cpp()
        self.tokenizer, self.opts, self.n_ctx = tokenizer, opts, n_ctx
        self.model_max = getattr(model.config, "max_position_embeddings", None)
        self.n_threads = n_threads or torch.get_num_threads()
        self.eos = set(eos_ids(model, tokenizer))
        self.capabilities = self.declared_capabilities(opts)
        self._dir = Path(tempfile.mkdtemp(prefix="gspo-llamacpp-"))
        self.llm: Any = None
        self.sync_weights(model)

    @staticmethod
    def declared_capabilities(opts: EngineOptions) -> EngineCapabilities:
        return EngineCapabilities(returns_logprobs=True, routing_unsupported=NO_ROUTING,
                                  precision=PRECISION, shares_policy_weights=False,
                                  per_rank=False)

    @staticmethod
    def check_installed() -> None:
        """:class:`gspo.config.MissingPackage` without llama-cpp-python (importing nothing)."""
        check_optional(*LLAMA_CPP)

    @classmethod
    def start(cls, model: Any, tokenizer: Any, opts: EngineOptions) -> LlamaCppEngine:
        return cls(model, tokenizer, opts)

    def sync_weights(self, policy: Any) -> None:
        """Re-export ``policy`` to Q8_0 GGUF and reload llama.cpp on it."""
        export_gguf(policy, self.tokenizer, self._dir / "policy.gguf")
        self._load()

    def _load(self) -> None:
        """(Re)load llama.cpp on the exported GGUF with a context of ``self.n_ctx`` tokens."""
        self.llm = None  # free the old context before loading the new one
        self.llm = self.llama_cpp.Llama(model_path=str(self._dir / "policy.gguf"),
                                        n_ctx=self.n_ctx,
                                        n_batch=min(512, self.n_ctx), n_threads=self.n_threads,
                                        seed=self.opts.seed, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def _logits(self) -> torch.Tensor:
        """The logits after the last evaluated token, as a fresh fp32 tensor [1, V].

        Read from the context (``llama_get_logits_ith(ctx, -1)``): without ``logits_all``
        ``Llama.eval`` keeps no copy in ``Llama.scores``, and ``logits_all`` would run the
        output layer over every prompt token."""
        ptr = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())[None]

    def generate(self, prompts: list[list[int]], *, group_size: int, params: SamplingParams,
                 seeds: list[int], greedy: bool = False) -> Rollout:
        steps = params.max_new_tokens
        n_ctx = context_size(self.n_ctx, max(len(p) for p in prompts) + steps, self.model_max)
        if n_ctx != self.n_ctx:  # a longer prompt + max_new_tokens than so far: reload larger
            self.n_ctx = n_ctx
            self._load()
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        u = _uniforms(len(prompts) * group_size, group_size, steps, gens)
        prompt_ids, response_ids, logprobs, truncated = [], [], [], []
        for p, prompt in enumerate(prompts):
            self.llm.reset()
            self.llm.eval(list(prompt))
            first = self._logits()
            for j in range(group_size):
                row = p * group_size + j
                self.llm.n_tokens = len(prompt)  # rewind: the next eval drops later KV entries
                logits, ids, lps = first.clone(), [], []
                for step in range(steps):
                    tok, lp = _next_tokens(logits, params,
                                           None if greedy else u[row, step:step + 1])
                    ids.append(int(tok))
                    lps.append(float(lp))
                    if ids[-1] in self.eos or step == steps - 1:
                        break
                    self.llm.eval([ids[-1]])
                    logits = self._logits()
                prompt_ids.append(list(prompt))
                response_ids.append(ids)
                logprobs.append(torch.tensor(lps, dtype=torch.float32))
                truncated.append(ids[-1] not in self.eos)
        return Rollout(prompt_ids, response_ids, logprobs, truncated, group_size)

    def close(self) -> None:
        self.llm = None
        shutil.rmtree(self._dir, ignore_errors=True)
