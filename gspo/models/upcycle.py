"""Sparse upcycling of a dense Llama-style model into a transformers MoE (Mixtral or Qwen2-MoE).

Sparse upcycling (Komatsuzaki et al., arXiv:2212.05055 v2, Sec. 3) turns each dense MLP into
``E`` experts that start as copies of it and adds a router per layer. With identical experts and
top-k gates renormalised to sum to one (Mixtral always; Qwen2-MoE with ``norm_topk_prob``),

    y = Σ_{e ∈ topk(x)} g_e(x) · MLP_e(x) = (Σ_e g_e(x)) · MLP(x) = MLP(x),

so the upcycled model's logits equal the dense model's *whatever the router weights are* (up to
float rounding of Σ g_e = 1). The router initialisation (``router_std``) therefore does not
change the function at init, only how close to ties the routing decisions sit, which is what
sets how often they flip after an update (see benchmarks/bench_routing_volatility.py). The
optional ``noise`` breaks the experts' symmetry (relative Gaussian noise on each copy); without
it, which expert a token picks changes nothing in the output until training separates them.

Model name: ``upcycle:<dense>?experts=E&top_k=k&arch=mixtral&layers=...&router_std=s&noise=n
&seed=i``, e.g. ``upcycle:smollm2-135m-instruct?experts=8&top_k=2``. ``<dense>`` is the bundled
SmolLM2 name or a dense Llama folder. ``layers`` (comma list of indices or ``a-b`` ranges,
default all) needs ``arch=qwen2_moe``: Mixtral makes every layer sparse. The result is cached as
a plain Hugging Face folder (``from_pretrained`` loads it with transformers' own classes).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import torch

from gspo.models.loading import (
    MODEL_SOURCES,
    PLAIN_TORCH,
    ModelError,
    cache_dir,
    folder_identity,
    resolve_model,
    save_model_folder,
)

UPCYCLE_FORMAT = 1  # bump when the conversion changes: the cache key includes it


@dataclass(frozen=True)
class UpcycleSpec:
    """What ``upcycle:<dense>?<options>`` asks for (defaults: the measured default testbed)."""

    dense: str = "smollm2-135m-instruct"
    experts: int = 8
    top_k: int = 2
    arch: str = "mixtral"
    layers: str = "all"
    router_std: float = 0.02
    noise: float = 0.0
    seed: int = 0

    def layer_ids(self, n_layers: int) -> list[int]:
        """The sorted decoder-layer indices made sparse."""
        if self.layers == "all":
            return list(range(n_layers))
        out: set[int] = set()
        for part in self.layers.split(","):
            lo, _, hi = part.partition("-")
            try:
                a, b = int(lo), int(hi or lo)
            except ValueError:
                raise ModelError(f"upcycle: layers={self.layers!r}: use indices and a-b ranges, "
                                 "e.g. 0-29 or 1,3,5") from None
            if not 0 <= a <= b < n_layers:
                raise ModelError(f"upcycle: layers={self.layers!r} out of range [0, {n_layers})")
            out.update(range(a, b + 1))
        return sorted(out)


_KINDS = {f.name: f.type for f in fields(UpcycleSpec)}


def parse_spec(rest: str) -> UpcycleSpec:
    """Parse ``<dense>?k=v&k=v``; an unknown or invalid option is a one-line :class:`ModelError`."""
    dense, _, query = rest.partition("?")
    values: dict[str, Any] = {"dense": dense or UpcycleSpec.dense}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as e:  # a field without '=' (or an empty one: a stray '&')
        raise ModelError(f"upcycle: {e} in {query!r}: write key=value&key=value") from None
    for key, raw in pairs:
        if key not in _KINDS or key == "dense":
            known = ", ".join(k for k in _KINDS if k != "dense")
            raise ModelError(f"upcycle: unknown option {key!r} (known: {known})")
        cast = {"int": int, "float": float}.get(str(_KINDS[key]), str)
        try:
            values[key] = cast(raw)
        except ValueError:
            raise ModelError(f"upcycle: {key}={raw!r} must be {_KINDS[key]}") from None
    spec = UpcycleSpec(**values)
    if spec.arch not in ("mixtral", "qwen2_moe"):
        raise ModelError(f"upcycle: arch={spec.arch!r} (choose mixtral or qwen2_moe)")
    if not 1 <= spec.top_k <= spec.experts:
        raise ModelError(f"upcycle: need 1 <= top_k <= experts, got top_k={spec.top_k}, "
                         f"experts={spec.experts}")
    if spec.arch == "mixtral" and spec.layers != "all":
        raise ModelError("upcycle: layers= needs arch=qwen2_moe (Mixtral makes every layer "
                         "sparse)")
    if not (0 <= spec.router_std < math.inf and 0 <= spec.noise < math.inf):  # NaN fails too
        raise ModelError("upcycle: router_std and noise must be finite and >= 0")
    return spec


def _moe_config(dense: Any, spec: UpcycleSpec) -> Any:
    """The MoE config with the dense Llama config's attention, norms, RoPE and vocabulary."""
    import transformers

    if getattr(dense, "model_type", None) != "llama":
        raise ModelError(f"upcycle: the dense model must be a Llama model, got "
                         f"{getattr(dense, 'model_type', None)!r}")
    if getattr(dense, "attention_bias", False) or getattr(dense, "mlp_bias", False):
        raise ModelError("upcycle: dense models with attention/MLP biases are not supported")
    common = {k: getattr(dense, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings",
        "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "bos_token_id",
        "eos_token_id", "pad_token_id", "initializer_range")}
    common.update(num_experts_per_tok=spec.top_k, output_router_logits=False,
                  router_aux_loss_coef=0.0, attention_dropout=0.0)
    if spec.arch == "mixtral":
        return transformers.MixtralConfig(
            **common, head_dim=dense.head_dim, num_local_experts=spec.experts,
            router_jitter_noise=0.0, sliding_window=None)
    sparse = spec.layer_ids(dense.num_hidden_layers)
    # Qwen2-MoE always builds a sigmoid-gated shared expert; width 0 makes it an exact zero
    # (an empty matmul), so the block is the routed experts alone.
    return transformers.Qwen2MoeConfig(
        **common, head_dim=dense.head_dim, moe_intermediate_size=dense.intermediate_size,
        shared_expert_intermediate_size=0, num_experts=spec.experts, norm_topk_prob=True,
        qkv_bias=False, decoder_sparse_step=1, use_sliding_window=False,
        mlp_only_layers=[i for i in range(dense.num_hidden_layers) if i not in sparse])


def upcycle_state_dict(dense_sd: dict[str, torch.Tensor], moe_model: Any, spec: UpcycleSpec
                       ) -> dict[str, torch.Tensor]:
    """The MoE model's weights: attention, norms and embeddings copied; each sparse layer's
    experts copies of its dense MLP (times ``1 + noise·N(0, 1)`` per entry and expert when
    ``noise`` > 0); routers ``N(0, router_std²)``."""
    gen = torch.Generator().manual_seed(spec.seed)
    target = moe_model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for key, ref in target.items():
        if key in dense_sd:
            out[key] = dense_sd[key].to(ref.dtype)
            continue
        prefix, _, leaf = key.rpartition(".mlp.")
        mlp = {p: dense_sd[f"{prefix}.mlp.{p}_proj.weight"] for p in ("gate", "up", "down")}
        if leaf == "gate.weight":
            out[key] = torch.randn(ref.shape, generator=gen) * spec.router_std
        elif leaf == "experts.gate_up_proj":
            out[key] = _copies(torch.cat([mlp["gate"], mlp["up"]], 0), ref.shape[0], spec, gen)
        elif leaf == "experts.down_proj":
            out[key] = _copies(mlp["down"], ref.shape[0], spec, gen)
        elif ref.numel() == 0 or leaf == "shared_expert_gate.weight":
            out[key] = torch.zeros(ref.shape)  # the empty shared expert (multiplies zero)
        else:
            raise ModelError(f"upcycle: no dense source for {key}")
        out[key] = out[key].to(ref.dtype)
    return out


def _copies(weight: torch.Tensor, n: int, spec: UpcycleSpec, gen: torch.Generator
            ) -> torch.Tensor:
    stacked = weight.unsqueeze(0).repeat(n, *([1] * weight.dim()))
    if spec.noise > 0:
        stacked = stacked * (1 + spec.noise * torch.randn(stacked.shape, generator=gen))
    return stacked.contiguous()


def upcycle(dense_model: Any, spec: UpcycleSpec) -> Any:
    """Return the upcycled MoE model (fp32, eval mode) of a loaded dense Llama model, with the
    dense model's generation config (its EOS ids and sampling defaults)."""
    from transformers import AutoModelForCausalLM

    config = _moe_config(dense_model.config, spec)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sd = upcycle_state_dict(dense_model.state_dict(), skeleton, spec)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ModelError(f"upcycle: weights did not map: missing {missing}, extra {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    if getattr(dense_model, "generation_config", None) is not None:
        model.generation_config = copy.deepcopy(dense_model.generation_config)
    return model.eval()


def upcycled_dir(spec: UpcycleSpec) -> Path:
    """Where the upcycled model of ``spec`` is cached: keyed by the options and, for a dense
    model given as a folder, by that folder's identity (:func:`folder_identity`)."""
    dense = folder_identity(spec.dense)
    key = json.dumps({**asdict(spec), "format": UPCYCLE_FORMAT, **({"dense_folder": dense}
                                                                   if dense else {})},
                     sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return cache_dir() / "upcycle" / f"{Path(spec.dense).name}-{spec.arch}-e{spec.experts}" \
        f"k{spec.top_k}-{digest}"


@MODEL_SOURCES.register("upcycle")
def resolve_upcycle(rest: str) -> Path:
    """``model: upcycle:<dense>?<options>``: the cached upcycled folder, built on first use."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = parse_spec(rest)
    target = upcycled_dir(spec)
    if (target / "config.json").is_file():
        return target
    where = resolve_model(spec.dense)
    if isinstance(where, str):
        raise ModelError(f"upcycle: {spec.dense!r} is not a pretrained model folder")
    dense = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **PLAIN_TORCH)
    model = upcycle(dense, spec)
    tokenizer = AutoTokenizer.from_pretrained(where)
    return save_model_folder(model, tokenizer, target,
                             {"upcycle.json": json.dumps(asdict(spec), indent=1)})
