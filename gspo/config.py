"""Typed configuration: the only place defaults live.

Precedence: dataclass defaults < YAML preset < dotted ``key=value`` overrides, e.g.
``gspo train tiny_cpu objective.eps_high=4e-4 model=/path/to/model`` (a preset name or a
YAML file: :func:`resolve_path`).
Unknown keys and type mismatches raise :class:`ConfigError` naming the field.
Each field's ``help`` metadata feeds ``gspo train --help`` and the docs.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
import types
import typing
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from gspo import presets


class MissingPackage(ImportError):
    """An optional package a setting needs is not installed; its message is one line naming
    the setting and what to install (``gspo`` prints it as a usage error, no traceback). Only
    an absent package raises it: one that is installed but fails to import raises its own
    error, with its traceback."""


def import_optional(module: str, needed_by: str, what: str) -> Any:
    """Import ``module``, an optional package that ``needed_by`` (a setting) needs.

    Raises:
        MissingPackage: ``"{needed_by} needs {what}"`` where ``module`` is not installed
            (``what`` names the package and how to install it). A package that is installed
            but fails inside its own import raises that error instead.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:  # installed, but it fails to import: its own error
            raise
        raise MissingPackage(f"{needed_by} needs {what}") from e


def check_optional(module: str, needed_by: str, what: str) -> None:
    """:func:`import_optional`'s :class:`MissingPackage` where ``module`` is not installed,
    importing nothing (setup asks before it makes the run folder)."""
    if importlib.util.find_spec(module) is None:
        import_optional(module, needed_by, what)


class ConfigError(ValueError):
    """A configuration problem the user must fix; its message is one line naming the field."""

    def __init__(self, msg: str) -> None:  # keys and values come from users: escape line breaks
        super().__init__("".join(c if len(f"a{c}b".splitlines()) == 1
                                 else c.encode("unicode_escape").decode() for c in str(msg)))


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class TaskConfig:
    name: str = _f("arithmetic", "built-in task ('arithmetic', 'countdown', 'gsm8k_mini'), "
                   "'jsonl' (a JSONL file) or 'dataset' (any Hugging Face `datasets` source)")
    levels: list[int] = _f(
        [1, 2], "arithmetic difficulty levels mixed in training (1: a+b one-digit, 2: two-digit "
        "plus one-digit, 3: two-digit plus two-digit, 4: three-digit plus two-digit)")
    level_weights: list[float] = _f([], "sampling weight per level (empty: uniform)")
    eval_levels: list[int] = _f([], "levels of the held-out set (empty: same as levels)")
    operations: list[str] = _f(["+"], "arithmetic operations to draw from: '+', '-', '*'")
    eval_size: int = _f(100, "number of held-out problems evaluated before and after training")
    path: str = _f("", "task.name=jsonl: JSONL file; task.name=dataset: local JSON/JSONL/CSV/"
                   "Parquet file or folder, or a Hub dataset name (needs network)")
    subset: str = _f("", "task.name=dataset: the configuration of a Hub dataset or of a local copy "
                     "of one (e.g. 'main' for gsm8k); "
                     "task.name=reasoning_gym: the reasoning-gym dataset (e.g. 'chain_sum')")
    options: dict[str, Any] = _f(
        {}, "task.name=reasoning_gym: fields of the dataset's config (difficulty), passed "
        "through, e.g. task.options.max_terms=3")
    split: str = _f("train", "task.name=dataset: split to train on")
    eval_split: str = _f("", "task.name=dataset: held-out split (empty: hold out eval_size "
                         "problems, every row of a prompt on one side)")
    countdown_numbers: int = _f(3, "task.name=countdown: how many numbers each problem gives")
    prompt_template: str = _f(
        "", "task.name=arithmetic: the prompt, with {problem} where e.g. 12*34 goes (empty: "
        "'What is {problem}? Answer with a number.')")
    eval_path: str = _f("", "held-out JSONL file (empty: hold out eval_size problems of path); "
                        "training leaves out the rows whose prompt it holds")
    prompt_field: str = _f("prompt", "task.name=jsonl or dataset (or rows passed to "
                           "Trainer(train_dataset=...)): column holding the prompt")
    answer_field: str = _f("answer", "task.name=jsonl or dataset (or rows passed to "
                           "Trainer(train_dataset=...)): column holding the reference answer")
    system_prompt: str = _f("You are a helpful assistant.",
                            "system message for the chat template (empty: the tokenizer's own; "
                            "a template without a system role: the user message's first "
                            "paragraph)")
    chat_template: bool = _f(True, "apply the tokenizer's chat template (false: raw prompts)")


@dataclass
class RewardConfig:
    functions: list[str] = _f(
        ["numeric_match"], "reward functions: registered names or 'module:function'")
    weights: list[float] = _f(
        [], "weight per reward function (empty: all 1.0); a function of weight 0 is logged, "
        "not trained on")
    max_unscorable_frac: float = _f(
        0.5, "stop the run if more than this fraction of a step's responses cannot be scored")
    overlong_buffer: int = _f(
        0, "DAPO soft overlong punishment: add a reward term falling linearly from 0 to -1 over "
        "the last overlong_buffer tokens before rollout.max_new_tokens, with 1 added (logged as "
        "reward/overlong, 1 = within budget; reward/mean is 1 higher, advantages unchanged; "
        "0 = off)")
    timeout_s: float = _f(
        60.0, "seconds a reward function may take on one batch; past it the batch is unscorable "
        "for that function and its hung thread is left running as a daemon (0 = no limit)")
    isolate: Literal["thread", "process"] = _f(
        "thread", "where reward functions run: 'thread' (in the trainer) or 'process' (each in "
        "its own process, killed on a crash, past timeout_s or past memory_mb: unscorable)")
    memory_mb: int = _f(
        4096, "reward.isolate=process: kill a reward's process past this resident memory "
        "(MiB; 0 = no limit)")


@dataclass
class RolloutConfig:
    group_size: int = _f(8, "G: responses sampled per prompt")
    prompts_per_step: int = _f(4, "B: prompts per rollout batch")
    max_new_tokens: int = _f(24, "response length cap; longer responses are truncated")
    temperature: float = _f(0.7, "sampling temperature (log-probs use the same temperature)")
    top_p: float = _f(
        1.0, "nucleus sampling (< 1: samples come from the truncated distribution, not π; the hf "
        "and llamacpp engines still record log π at the temperature, vLLM the truncated one's)")
    top_k: int = _f(0, "top-k sampling (0 = off; > 0: as top_p < 1 for what is recorded)")
    engine: Literal["hf", "vllm", "llamacpp"] = _f(
        "hf", "rollout engine (gspo.rollout.ENGINES): 'hf' (own KV-cached sampler), 'vllm' or "
        "'llamacpp' (llama.cpp on Q8_0 weights)")
    fast_decode: bool = _f(
        True, "gspo's sampler (engine=hf, and evaluation with any engine): prefill and decode "
        "steps of Llama/Qwen2/Qwen3 models and their MoE "
        "siblings Mixtral/Qwen2-MoE/Qwen3-MoE skip forward()'s per-call overhead (same "
        "arithmetic; other models always use forward)")
    decode_matmul: Literal["auto", "blas", "onednn"] = _f(
        "auto", "gspo's sampler (engine=hf, and evaluation with any engine) with fast_decode: "
        "the decode steps' matrix products through 'blas' "
        "(F.linear: MKL on x86) or 'onednn' (weights packed once per rollout for oneDNN; CPU "
        "only; float32: SmolLM2 rollouts 1.5-2.1x faster on the 2-core CI machine, same "
        "numbers to fp32 rounding; bfloat16 (rollout.precision=bf16, dtype=bfloat16) where "
        "oneDNN has bf16 kernels (AVX-512): 1.1-1.2x on Zen 5); 'auto': onednn where it "
        "applies and the layers are larger "
        "than 1 MiB (below, "
        "its per-call cost outweighs it: tiny presets decode through blas). With onednn the "
        "prefill's products go through oneDNN too")
    precision: Literal["fp32", "bf16"] = _f(
        "fp32", "engine=hf: 'fp32' samples from the policy module itself (in `dtype`); 'bf16' "
        "from a bfloat16 copy of the fp32 policy, synced after every update (the reference "
        "train-inference mismatch source, see docs/corrections.md)")
    vllm_memory_fraction: float = _f(
        0.3, "engine=vllm: share of the device's memory (CPU backend: of RAM) vLLM reserves "
        "for weights and KV cache; training shares the device")
    eval_max_new_tokens: int = _f(24, "response cap for greedy evaluation")
    max_turns: int = _f(
        1, "policy turns per episode (1: single-turn); > 1 needs rollout.env, each turn capped "
        "at max_new_tokens (eval: eval_max_new_tokens)")
    env: str = _f(
        "", "rollout.max_turns > 1: environment answering each turn: 'python' (runs the turn's "
        "```python block in the sandbox) or 'module:Class' (see gspo.rollout.envs)")
    dynamic_sampling: bool = _f(
        False, "DAPO dynamic sampling (arXiv:2503.14476 v1, Sec. 3.2): drop groups whose "
        "rewards are all equal and draw more prompts until prompts_per_step groups carry "
        "signal (under torchrun every rank keeps the groups one process would; with "
        "rollout.async_steps > 0 the extra draws are sampled on the step's own weights, by the "
        "trainer with engine=hf, by the engine process with vllm; see "
        "gspo.trainer.dynamic_sampling)")
    dynamic_max_extra_batches: int = _f(
        4, "dynamic_sampling: most extra rollout batches per step; past them the step trains "
        "on the groups with signal it has (logged as dynamic/cap_reached)")
    mask_truncated: bool = _f(
        False, "responses cut at max_new_tokens get zero loss weight (DAPO overlong filtering, "
        "TRL mask_truncated_completions); they still count in their group's advantages")
    async_steps: int = _f(
        0, "k > 0: the engine samples in its own process up to k steps ahead, step t's batch "
        "from the policy after max(0, t-k) updates (staleness <= k; engine=hf or vllm; "
        "under torchrun one engine per trainer process); 0: rollout and update in sequence "
        "(see gspo.trainer.async_rollout)")
    async_threads: int = _f(1, "async_steps > 0: torch threads of the engine process (the "
                            "trainer keeps num_threads; on 2 cores use num_threads=1)")
    async_lend_threads: bool = _f(
        False, "async_steps > 0, engines spawned here: while the engines have sampled every "
        "batch asked of them, the trainer also runs on their async_threads, and while the "
        "trainer waits for a batch, its one engine on the trainer's num_threads (polled between "
        "layers and decode steps; results as on their own threads where the kernels do not "
        "depend on the thread count: scripts/thread_invariance.py checks a model; see "
        "gspo.rollout.async_engine.ThreadLending)")
    async_engines: int = _f(
        1, "async_steps > 0: engines per trainer process, each sampling a share of its prompts "
        "(each with async_threads threads; weights published to every one)")
    async_address: str = _f(
        "", "async_steps > 0: where an engine started with `gspo engine ADDRESS` meets the "
        "trainer (tcp://HOST:PORT, HOST the trainer's, or file:///shared/path); weights go "
        "by a gloo broadcast, batches back over the same link. "
        "One address per engine (async_engines per trainer process; under torchrun rank 0's "
        "first), comma-separated. "
        "Empty: the engine process is spawned here and shares memory "
        "(see gspo.rollout.remote_engine)")
    async_timeout_s: float = _f(
        1800.0, "async_address: seconds the trainer waits for each engine to join (start the "
        "`gspo engine`s within it) and then for each of its messages (a batch, a weights "
        "broadcast); the engine's own is `gspo engine --timeout`")


@dataclass
class CorrectionConfig:
    """A behaviour correction for π_rollout ≠ π_old (gspo.objectives.corrections)."""

    name: str = _f("none", "correction: none, tis, mis, icepop, offpolicy_mask "
                   "(see gspo.objectives.CORRECTIONS and docs/corrections.md)")
    level: Literal["auto", "token", "sequence"] = _f(
        "auto", "tis/mis/icepop: weight per token or per sequence (geometric-mean ratio); auto: "
        "the loss's own level; token on a sequence-level loss must be asked for and warns")
    cap: float = _f(2.0, "tis: truncation C of the weight; mis: weights above C are masked")
    low: float = _f(0.5, "icepop: lower bound α of the kept ratio band")
    high: float = _f(5.0, "icepop: upper bound β of the kept ratio band")
    delta: float = _f(0.01, "offpolicy_mask: mask Â<0 sequences whose mean log π_rollout/π_θ "
                      "exceeds δ")


@dataclass
class ObjectiveConfig:
    name: str = _f("gspo", "policy loss: gspo, gspo_token, grpo, ... (see gspo.objectives)")
    eps_low: float = _f(3e-4, "lower clip range ε_low (GSPO paper: 3e-4; GRPO: 0.2)")
    eps_high: float = _f(4e-4, "upper clip range ε_high (GSPO paper: 4e-4; GRPO: 0.27)")
    beta: float = _f(0.0, "k3 KL penalty coefficient to the initial (reference) policy")
    advantage: str = _f("grpo", "advantage estimator (see gspo.objectives.ADVANTAGES)")
    scale_rewards: Literal["auto", "group", "batch", "none"] = _f(
        "auto", "divide advantages by the group std, the batch std, or nothing; auto: the "
        "estimator's own (grpo: group, rloo: none, reinforce_pp_baseline: batch)")
    num_minibatches: int = _f(4, "minibatches per rollout batch (paper: 4)")
    epochs: int = _f(1, "passes over each rollout batch")
    old_logprobs: Literal["recompute", "rollout", "decoupled"] = _f(
        "recompute", "π_old log-probs: recomputed by the trainer in fp32, the rollout's own "
        "(arXiv:2507.18071 v2, §5.4), or decoupled: recomputed for the clip ratio, with "
        "π_rollout used only by objective.correction")
    aggregation: Literal["sequence", "token", "constant"] = _f(
        "sequence", "how the loss averages its terms: 'sequence' (token mean per response, then "
        "mean over responses), 'token' (over all tokens; length-weighted, warns for gspo) or "
        "'constant' (token sum / objective.norm_constant per response: Dr. GRPO; token losses)")
    norm_constant: float = _f(
        0.0, "aggregation=constant: the constant C of Dr. GRPO's normaliser Σ_t / C, e.g. "
        "rollout.max_new_tokens (arXiv:2503.20783 §3.1)")
    tau_pos: float = _f(1.0, "sapo: gate temperature for positive advantages (paper: 1.0)")
    tau_neg: float = _f(1.05, "sapo: gate temperature for negative advantages (paper: 1.05)")
    tv_delta_low: float = _f(
        0.15, "dppo_tv: trust region on the probability drop π − π_old ≥ −δ for Â < 0 (0.15)")
    tv_delta_high: float = _f(
        0.15, "dppo_tv: trust region on the probability rise π − π_old ≤ δ for Â > 0 (0.15)")
    kl_delta_low: float = _f(
        0.05, "dppo_kl: binary-KL threshold for tokens whose probability fell, Â < 0 (0.05)")
    kl_delta_high: float = _f(
        0.05, "dppo_kl: binary-KL threshold for tokens whose probability rose, Â > 0 (0.05)")
    ratio_cap: float = _f(
        20.0, "dppo_tv/dppo_kl: truncated importance weight min(w, cap) (verl's clip_ratio_c)")
    clip_cov_ratio: float = _f(
        2e-4, "clip_cov: share of response tokens whose gradient is detached (paper: 2e-4)")
    clip_cov_lb: float = _f(1.0, "clip_cov: lower covariance bound of the candidates (1.0)")
    clip_cov_ub: float = _f(5.0, "clip_cov: upper covariance bound of the candidates (5.0)")
    kl_cov_ratio: float = _f(
        2e-4, "kl_cov: share of response tokens (largest covariance) given the KL penalty")
    kl_cov_coef: float = _f(1.0, "kl_cov: coefficient of the |log w| penalty (paper: 1.0)")
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)


@dataclass
class OptimConfig:
    lr: float = _f(1e-5, "AdamW peak learning rate")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    betas: list[float] = _f([0.9, 0.999], "AdamW betas")
    grad_clip: float = _f(1.0, "max global grad norm (0 = off)")
    fused: bool = _f(True, "fused AdamW kernel (same update rule; off under FSDP2)")
    warmup_steps: int = _f(
        0, "linear warm-up, in optimizer updates (objective.num_minibatches x objective.epochs "
        "per RL step), as the schedule is")
    schedule: Literal["constant", "cosine", "linear"] = _f(
        "constant", "lr schedule after warm-up, over steps x num_minibatches x epochs updates")


@dataclass
class MoEConfig:
    routing_replay: Literal["off", "r2", "r3"] = _f(
        "off", "reuse π_old's expert choices: r2 = trainer-recorded, r3 = rollout-recorded "
        "(rollout.engine=hf)")
    aux_loss_coef: float = _f(0.0, "router load-balancing loss coefficient (0 = off)")
    log_routing_change: bool = _f(True, "log the fraction of (token, layer) whose experts changed")
    router_lr_scale: float = _f(
        1.0, "the routers' learning rate as a multiple of optim.lr (1 = one parameter group): "
        "routing that moves as much per update as the paper's while the rest trains slowly")


@dataclass
class LoRAConfig:
    r: int = _f(0, "LoRA rank (0 = off: full fine-tuning)")
    alpha: float = _f(16.0, "LoRA scaling numerator: updates are scaled by alpha / r")
    dropout: float = _f(0.0, "dropout on the LoRA input")
    target_modules: list[str] = _f(
        ["all-linear"], "module names to adapt, e.g. [q_proj, v_proj]; 'all-linear': every "
        "linear layer except the output layer")


@dataclass
class LoggingConfig:
    wandb_project: str = _f("", "also log to Weights & Biases under this project (if installed)")
    trackio_project: str = _f("", "also log to trackio under this project (if installed)")
    samples_every: int = _f(10, "write sample completions to samples.jsonl every k steps (0: off)")
    rollout_check_every: int = _f(
        1, "with objective.old_logprobs=rollout, still recompute π_old every k steps to log the "
        "rollout-vs-trainer gap and the entropy (0: never, which saves that pass); with "
        "rollout.async_steps > 0 that pass also gives the staleness drift, and is ~1/8 of a "
        "SmolLM2 step on 1 + 1 threads (docs/scaling.md). Unused (an error to set) where the "
        "synchronous loop recomputes π_old on every step anyway: old_logprobs=recompute or "
        "decoupled, or an MoE policy")
    zero_signal_warn_steps: int = _f(
        3, "warn once when more than half of the sampled groups had zero reward variance for "
        "this many consecutive steps (0: never)")
    drift_every: int = _f(
        0, "every k steps, one more log-prob pass after the update to log the policy drift "
        "log π_θ − log π_old apart from the engine mismatch log π_old − log π_rollout "
        "(drift/*, see docs/corrections.md; 0: off); these steps also run the rollout check "
        "(logging.rollout_check_every) the drift is measured against")


@dataclass
class GuardConfig:
    max_consecutive_faults: int = _f(
        3, "act (guard.on_fault) after this many consecutive steps with an update skipped for a "
        "non-finite loss, gradient or log-prob (0: never act, only skip and count)")
    on_fault: Literal["rollback", "lower_lr", "stop"] = _f(
        "rollback", "on a fault streak or a collapse signal: reload the last good checkpoint's "
        "weights and optimizer and go on (rollback), the same with lr x lr_factor (lower_lr), "
        "or checkpoint and stop (stop); rollback needs save_every > 0")
    lr_factor: float = _f(0.5, "on_fault=lower_lr: multiply the learning rate by this per fault")
    max_rollbacks: int = _f(3, "stop instead of rolling back once this many rollbacks happened")
    collapse_window: int = _f(5, "steps averaged by the collapse_reward_drop signal")
    collapse_reward_drop: float = _f(
        0.0, "collapse signal: reward mean over the last collapse_window steps more than this "
        "below its best such mean (0: off); with rollout.dynamic_sampling the mean over every "
        "sampled response (dynamic/sampled_reward_mean), not over the groups kept")
    collapse_entropy_floor: float = _f(
        0.0, "collapse signal: policy entropy per token (train/entropy) below this (0: off); "
        "measured by the trainer's π_old pass: with objective.old_logprobs=rollout or "
        "rollout.async_steps > 0 (dense policy, old_logprobs other than decoupled) only on the "
        "logging.rollout_check_every steps")
    collapse_ratio_ceiling: float = _f(
        0.0, "collapse signal: largest sequence ratio (objective/seq_ratio_max) above this "
        "(0: off)")


@dataclass
class SFTConfig:
    """Cold-start supervised stage (``gspo sft``; ``model: sft:<tiny name>`` in a run config)."""

    base: str = _f("tiny:tiny_moe", "model to fine-tune: 'tiny:<name>' (random init) or a folder")
    levels: list[int] = _f([2, 3], "arithmetic levels trained on and evaluated (see task.levels)")
    operations: list[str] = _f(["+"], "arithmetic operations: '+', '-', '*'")
    steps: int = _f(400, "AdamW steps of teacher forcing on 'a+b=c' answers")
    batch_size: int = _f(32, "problems per step")
    lr: float = _f(3e-3, "peak learning rate (linear warm-up, then cosine decay to lr/10)")
    warmup_steps: int = _f(20, "linear warm-up steps")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    grad_clip: float = _f(1.0, "max global grad norm (0 = off)")
    seed: int = _f(0, "seed of the initialisation and of the problem draws")
    chat_template: bool = _f(True, "use the chat template (match the run's task.chat_template)")
    system_prompt: str = _f("", "chat template's system message (match task.system_prompt)")
    eval_size: int = _f(100, "held-out problems evaluated (greedy) before and after")
    num_threads: int = _f(1, "torch CPU threads (0: torch's default; another count trains other "
                             "weights, cached apart)")


@dataclass
class DistributedConfig:
    strategy: Literal["ddp", "fsdp2"] = _f(
        "ddp", "multi-process training under torchrun: 'ddp' replicates the policy on every "
        "rank, 'fsdp2' shards parameters, gradients and optimizer state across ranks")


@dataclass
class TrainConfig:
    model: str = _f(
        "smollm2-135m-instruct",
        "local Hugging Face causal-LM folder, 'smollm2-135m-instruct', 'tiny:<name>', or "
        "'sft:<tiny name>' (its cached arithmetic cold start, see gspo sft)")
    steps: int = _f(12, "RL steps (one rollout batch each)")
    seed: int = _f(0, "seed for data, sampling and initialisation")
    output_dir: str = _f("runs", "parent folder of run folders")
    run_name: str = _f("", "run folder name (empty: a timestamp)")
    resume: str = _f(
        "", "run folder to resume from its latest checkpoint (`gspo train resume=RUN` without a "
        "CONFIG.yaml starts from RUN/config.yaml; key=value overrides still apply; the run "
        "stays in RUN: `gspo train` refuses an output_dir/run_name naming another folder)")
    device: str = _f(
        "auto", "where the policy trains and the hf engine samples: 'auto' (the GPU when "
        "torch sees one, else the CPU), 'cpu', 'cuda' or 'cuda:N'; under torchrun each rank "
        "takes its local GPU when this resolves to cuda")
    dtype: Literal["float32", "bfloat16"] = _f("float32", "parameter and compute dtype")
    logprob_chunk: int = _f(256, "positions per chunk when computing fp32 log-probs")
    logprob_packing: bool = _f(
        True, "trainer log-prob passes run each distinct prompt once (dense and MoE models; "
        "not under FSDP2)")
    lean_forward: bool = _f(
        True, "trainer log-prob passes of Llama/Qwen2/Qwen3 models and their MoE siblings "
        "Mixtral/Qwen2-MoE/Qwen3-MoE skip forward()'s per-call overhead (same arithmetic; "
        "other models always use forward)")
    compile_layers: bool = _f(
        False, "the lean log-prob passes run each decoder layer through torch.compile "
        "(inductor fuses the elementwise work around the products; equal to fp32 rounding, "
        "not bit for bit; the first step compiles: 1-2 min for SmolLM2 on 2 CPU cores, seconds "
        "from inductor's disk cache). Needs "
        "lean_forward=true and a model the lean pass supports")
    matmul: Literal["auto", "blas", "onednn"] = _f(
        "auto", "the fp32 matrix products of the lean log-prob passes (π_old, the update's "
        "forward and backward) on the CPU: blas (F.linear: MKL on x86) or onednn (PyTorch's "
        "bundled oneDNN; equal to fp32 rounding, not bit for bit); auto: onednn on AMD CPUs "
        "with AVX-512, where MKL runs AVX2 kernels at about half oneDNN's rate (measured on Zen "
        "5, benchmarks/bench_matmul.py), for models whose layers exceed 1 MiB; blas elsewhere. "
        "Needs lean_forward=true, dtype=float32, compile_layers=false, not dist.strategy=fsdp2")
    gradient_checkpointing: bool = _f(False, "recompute activations in backward (saves memory)")
    disable_dropout: bool = _f(
        True, "set the policy's dropout, LayerDrop and MoE router jitter to zero when it is "
        "built: noise drawn in training mode makes π_θ differ from π_old at θ = θ_old, more "
        "than GSPO's clip range (false: keep the model's own, and lora.dropout)")
    save_every: int = _f(0, "checkpoint every k steps (0: only at the end)")
    save_final: bool = _f(
        True, "write a checkpoint at the end of the run (false: only metrics.jsonl and "
        "final_eval.json stay, e.g. for comparisons whose weights nobody reloads)")
    keep_checkpoints: int = _f(2, "how many recent checkpoints to keep")
    eval_before: bool = _f(True, "evaluate held-out accuracy before training")
    eval_every: int = _f(0, "evaluate every k steps (0: only before/after)")
    num_threads: int = _f(0, "torch CPU threads (0: torch's default)")
    keep_freed_memory: bool = _f(
        True, "glibc: keep freed CPU memory for reuse instead of page-faulting fresh memory in "
        "for every large tensor (faster steps; RSS stays at its peak)")
    progress: bool = _f(True, "show a progress bar")
    tensorboard: Literal["auto", "on", "off"] = _f(
        "auto", "also write TensorBoard event files: auto (when installed, silently), "
        "on / true (say so when it is not installed), off / false")
    task: TaskConfig = field(default_factory=TaskConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    dist: DistributedConfig = field(default_factory=DistributedConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)


# ----------------------------------------------------------------------------- parsing


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if isinstance(value, bool) and ("off" if not value else "on") in typing.get_args(tp):
            value = "off" if not value else "on"  # YAML 1.1 reads a bare off/on as a boolean
        if value not in typing.get_args(tp):
            choices = ", ".join(repr(a) for a in typing.get_args(tp))
            raise ConfigError(f"{key}: {value!r} is not one of {choices}")
        return value
    if origin is dict:  # dict[str, Any]: string keys, YAML values passed through as parsed
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}: expected a mapping with string keys, got {value!r}")
        return dict(value)
    if origin in (list,):
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: {value!r} does not match {_type_name(tp)}")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except OverflowError:  # an integer too large for a float
            raise ConfigError(f"{key}: number out of range") from None
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is str:
        if value is None:
            return ""
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{key}: unsupported type {_type_name(tp)}")


def _merge(obj: Any, data: dict[str, Any], prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key '{full}' (valid: {', '.join(sorted(names))})")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            _merge(getattr(obj, key), value, f"{full}.")
        elif typing.get_origin(tp) is dict:  # mappings merge: a.b.x=1 a.b.y=2 keeps both
            setattr(obj, key, {**getattr(obj, key), **_coerce(value, tp, full)})
        else:
            setattr(obj, key, _coerce(value, tp, full))


def _leaf_type(cls: type, parts: list[str]) -> Any:
    """The annotation of the field that the dotted key ``parts`` names in the dataclass
    ``cls``; None when there is no such field (a mapping's entry, an unknown key)."""
    tp: Any = cls
    for part in parts:
        hints = typing.get_type_hints(tp) if dataclasses.is_dataclass(tp) else {}
        if part not in hints:
            return None
        tp = hints[part]
    return tp


def _text(raw: str) -> Any:
    """An override's value for a string field: the text as written (YAML would read
    ``0123`` as 83, cut ``a #b`` at the comment and ``a: b`` into a mapping), unquoted where
    it is one YAML-quoted string (``run_name="'x'"``); a flow list or mapping (``[a, b]``)
    stays one, for the type check to refuse."""
    if raw[:1] in ("'", '"', "[", "{"):
        try:
            value = yaml.safe_load(raw)
        except Exception:  # PyYAML also raises ValueError, KeyError, ... on bad scalars
            return raw
        if isinstance(value, str) or (raw[:1] in "[{" and isinstance(value, (list, dict))):
            return value
    return raw


def parse_override(item: str, cls: type | None = None) -> dict[str, Any]:
    """Turn ``a.b=1`` into ``{"a": {"b": 1}}``; the value is parsed as YAML, except that a
    key naming a string field of the dataclass ``cls`` (when given) takes the text as
    written (:func:`_text`)."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like key=value")
    key, raw = item.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{item}' has an empty key")
    value: Any
    if cls is not None and _leaf_type(cls, key.split(".")) is str:
        value = _text(raw)
    else:
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except Exception:  # PyYAML also raises ValueError, KeyError, ... on bad scalars/tags
            value = raw
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def resolve_path(path: str | Path, what: str = "config file") -> Path:
    """``path`` when it is a file, else the packaged preset of that name (``tiny_cpu``,
    ``moe/compare``: :mod:`gspo.presets`); neither is a one-line :class:`ConfigError`."""
    p = Path(path)
    if p.is_file():
        return p
    preset = presets.find_preset(str(path))
    if preset is None:
        raise ConfigError(f"{what} not found: {p} (not a file, nor a preset; {presets.hint()})")
    return preset


def read_yaml(path: str | Path, what: str = "config file") -> Any:
    """The parsed YAML of ``path`` (a file or a preset name); a missing, unreadable or
    malformed file is a one-line :class:`ConfigError` naming it (``what`` names the kind of
    file in the first case)."""
    p = resolve_path(path, what)
    try:
        text = p.read_text()
        data = yaml.safe_load(text)
    except OSError as e:
        raise ConfigError(f"{p}: cannot read ({_first_line(e)})") from None
    except Exception as e:  # PyYAML also raises ValueError, KeyError, ... on bad scalars
        raise ConfigError(f"{p}: not valid YAML ({_first_line(e)})") from None
    _no_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), p)
    return data


def _no_duplicate_keys(root: Any, path: Path) -> None:
    """A key given twice in one mapping is an error: YAML keeps the last one, so an arm or a
    section written twice would silently be one (``<<`` merge keys excepted)."""
    todo: list[tuple[Any, str]] = [(root, "")]
    visited: set[int] = set()  # an alias points at a node already seen (and may recurse)
    while todo:
        node, where = todo.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for key, value in node.value:
                name, line = str(key.value), key.start_mark.line + 1
                if name in seen and name != "<<":
                    raise ConfigError(f"{path}: '{where}{name}' is given twice (lines "
                                      f"{seen[name]} and {line})")
                seen[name] = line
                todo.append((value, f"{where}{name}."))
        elif isinstance(node, yaml.SequenceNode):
            todo.extend((item, where) for item in node.value)


C = typing.TypeVar("C")


def build(cls: type[C], path: str | Path | None = None, overrides: list[str] | None = None) -> C:
    """Defaults of ``cls``, then an optional YAML file, then dotted ``key=value`` overrides."""
    cfg = cls()
    if path is not None:
        _merge(cfg, read_yaml(path) or {})
    for item in overrides or []:
        _merge(cfg, parse_override(item, cls))
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Build and check a :class:`TrainConfig` from defaults, an optional YAML file and
    overrides."""
    cfg = build(TrainConfig, path, overrides)
    validate(cfg)
    return cfg


def check_engine_address(address: str, what: str) -> None:
    """Where a trainer and a ``gspo engine`` meet: ``tcp://HOST:PORT`` (a TCP store the
    trainer serves; port 0, "any free port", could not be found by the engine) or
    ``file:///path`` (a file store; ``file://name/path`` would name the file ``/path``)."""
    url = urllib.parse.urlparse(address)
    try:
        port = url.port
    except ValueError:
        port = None
    _check((url.scheme == "tcp" and bool(url.hostname) and bool(port))
           or (url.scheme == "file" and not url.netloc and bool(url.path)),
           f"{what} must be tcp://HOST:PORT or file:///path, got '{address}'")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def validate(cfg: TrainConfig) -> None:
    """Cross-field checks that types alone cannot express (and :func:`check_task_columns`
    where the problems come from task.name)."""
    r, o, t = cfg.rollout, cfg.objective, cfg.task
    _check(r.group_size >= 2, f"rollout.group_size must be >= 2 (got {r.group_size})")
    _check(r.prompts_per_step >= 1, "rollout.prompts_per_step must be >= 1")
    _check(r.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1")
    _check(r.temperature > 0, "rollout.temperature must be > 0 (greedy rollouts give no signal)")
    _check(r.temperature < float("inf"), "rollout.temperature must be a finite number")
    _check(0 < r.top_p <= 1, "rollout.top_p must be in (0, 1]")
    _check(r.top_k >= 0, "rollout.top_k must be >= 0")
    # the names RolloutConfig.engine's Literal lists (docs/architecture.md: adding an engine)
    engines = typing.get_args(typing.get_type_hints(RolloutConfig)["engine"])
    _check(r.engine in engines, f"rollout.engine: unknown engine '{r.engine}'")
    _check(r.engine == "vllm" or (r.top_p == 1 and r.top_k == 0)
           or (o.old_logprobs == "recompute" and o.correction.name == "none"),
           f"rollout.top_p/top_k truncate the distribution the samples come from, but "
           f"rollout.engine={r.engine} records log π (untruncated) for them: as the behaviour "
           f"policy's log-probs (objective.old_logprobs={o.old_logprobs}, "
           f"objective.correction.name={o.correction.name}) they would be wrong; use "
           "top_p=1 and top_k=0, old_logprobs=recompute, or rollout.engine=vllm")
    _check(r.precision == "fp32" or (r.engine == "hf" and cfg.dtype == "float32"),
           "rollout.precision=bf16 needs rollout.engine=hf and dtype=float32 (a bfloat16 copy "
           "of the fp32 policy)")
    _check(r.decode_matmul == "auto" or r.fast_decode,
           f"rollout.decode_matmul={r.decode_matmul} needs rollout.fast_decode=true (it picks "
           "the kernels of gspo's own decode steps: rollout.engine=hf's and evaluation's)")
    _check(r.decode_matmul != "onednn" or not cfg.device.startswith("cuda"),
           "rollout.decode_matmul=onednn needs the CPU (device=cpu or auto without a GPU)")
    _check(0 < r.vllm_memory_fraction <= 1, "rollout.vllm_memory_fraction must be in (0, 1]")
    _check(r.engine == "vllm" or r.vllm_memory_fraction == RolloutConfig.vllm_memory_fraction,
           "rollout.vllm_memory_fraction is used only with rollout.engine=vllm "
           f"(engine={r.engine})")
    _check(r.eval_max_new_tokens >= 1, "rollout.eval_max_new_tokens must be >= 1")
    _check(r.max_turns >= 1, "rollout.max_turns must be >= 1")
    _check((r.max_turns > 1) == bool(r.env),
           "rollout.env and rollout.max_turns > 1 go together (an environment answers the turns)")
    _check(r.max_turns == 1 or cfg.moe.routing_replay != "r3",
           "moe.routing_replay=r3 records single-turn rollouts only; use r2 with max_turns > 1")
    _check(r.max_turns == 1 or cfg.reward.overlong_buffer == 0,
           "reward.overlong_buffer counts tokens of one turn; it is not supported with "
           "rollout.max_turns > 1")
    _check(re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device) is not None,
           f"device: {cfg.device!r} is not 'auto', 'cpu', 'cuda' or 'cuda:N'")
    _check(r.async_steps >= 0, "rollout.async_steps must be >= 0")
    _check(r.async_threads >= 1, "rollout.async_threads must be >= 1")
    _check(r.async_steps > 0 or r.async_threads == 1,
           "rollout.async_threads is used only with rollout.async_steps > 0")
    _check(r.async_steps > 0 or not r.async_lend_threads,
           "rollout.async_lend_threads is used only with rollout.async_steps > 0")
    _check(not (r.async_lend_threads and r.async_address),
           "rollout.async_lend_threads: engines started with `gspo engine` "
           "(rollout.async_address) run on their own cores, not the trainer's")
    _check(r.async_engines >= 1, "rollout.async_engines must be >= 1")
    _check(r.async_steps > 0 or r.async_engines == 1,
           "rollout.async_engines is used only with rollout.async_steps > 0")
    _check(r.async_steps > 0 or not r.async_address,
           "rollout.async_address is used only with rollout.async_steps > 0")
    _check(0 < r.async_timeout_s < float("inf"),
           "rollout.async_timeout_s must be a number > 0")
    _check(bool(r.async_address) or r.async_timeout_s == RolloutConfig.async_timeout_s,
           "rollout.async_timeout_s is used only with rollout.async_address")
    for address in r.async_address.split(",") if r.async_address else ():
        check_engine_address(address, "rollout.async_address")
    _check(r.async_steps == 0 or r.engine in ("hf", "vllm"),
           f"rollout.async_steps > 0 runs rollout.engine=hf or vllm, not {r.engine}")
    _check(o.eps_low >= 0 and o.eps_high >= 0, "objective.eps_low/eps_high must be >= 0")
    _check(o.eps_low < 1, "objective.eps_low must be < 1")
    _check(o.beta >= 0, "objective.beta must be >= 0")
    _check(o.epochs >= 1, "objective.epochs must be >= 1")
    _check(o.aggregation != "constant" or 0 < o.norm_constant < float("inf"),
           "objective.aggregation=constant needs objective.norm_constant > 0 (Dr. GRPO: the "
           "generation budget, e.g. rollout.max_new_tokens; token-level losses such as grpo "
           "have it, gspo's sequence ratio does not)")
    _check(o.aggregation == "constant" or o.norm_constant == 0,
           "objective.norm_constant is only used with objective.aggregation=constant")
    n_rollouts = r.group_size * r.prompts_per_step
    _check(1 <= o.num_minibatches <= n_rollouts,
           f"objective.num_minibatches must be in [1, {n_rollouts}] (the rollout batch size)")
    _check(o.beta < float("inf"), "objective.beta must be a finite number")
    _check(cfg.steps >= 0, "steps must be >= 0")
    _check(cfg.num_threads >= 0, "num_threads must be >= 0 (0: torch's default)")
    _check(cfg.save_every >= 0, "save_every must be >= 0 (0: only at the end)")
    _check(cfg.eval_every >= 0, "eval_every must be >= 0 (0: only before/after)")
    _validate_optim(cfg.optim)
    _check(0 <= cfg.moe.aux_loss_coef < float("inf"),
           "moe.aux_loss_coef must be a finite number >= 0 (0 = off)")
    _check(0 < cfg.moe.router_lr_scale < float("inf"),
           f"moe.router_lr_scale must be > 0 and finite (got {cfg.moe.router_lr_scale})")
    _check(cfg.logprob_chunk >= 1, "logprob_chunk must be >= 1")
    _check(not cfg.compile_layers or cfg.lean_forward,
           "compile_layers=true compiles the lean log-prob pass: it needs lean_forward=true")
    _check(cfg.matmul != "onednn" or (cfg.lean_forward and cfg.dtype == "float32"
                                      and not cfg.compile_layers
                                      and cfg.dist.strategy != "fsdp2"),
           "matmul=onednn runs the eager lean log-prob passes' fp32 products through oneDNN: "
           "it needs lean_forward=true, dtype=float32, compile_layers=false and not "
           "dist.strategy=fsdp2")
    _check(cfg.keep_checkpoints >= 1, "keep_checkpoints must be >= 1")
    _check(t.eval_size >= 0, "task.eval_size must be >= 0")
    _check(bool(t.levels), "task.levels must not be empty")
    _check(all(1 <= lv <= 4 for lv in t.levels + t.eval_levels), "task levels must be in 1..4")
    _check(not t.level_weights or len(t.level_weights) == len(t.levels),
           "task.level_weights must have one weight per level")
    weights = t.level_weights
    _check(all(w >= 0 for w in weights) and (not weights or sum(weights) > 0),
           "task.level_weights must be non-negative and not all zero")
    _check(all(op in ("+", "-", "*") for op in t.operations) and bool(t.operations),
           "task.operations must be a non-empty list of '+', '-', '*'")
    _check(t.name not in ("jsonl", "dataset") or bool(t.path),
           f"task.path is required when task.name={t.name}")
    _check(2 <= t.countdown_numbers <= 6, "task.countdown_numbers must be in 2..6")
    _check(not t.prompt_template or t.name == "arithmetic",
           "task.prompt_template applies only to task.name=arithmetic")
    _check(not t.prompt_template or "{problem}" in t.prompt_template,
           "task.prompt_template must contain {problem}")
    _check(t.name == "reasoning_gym" or not t.options,
           f"task.options is used only by task.name=reasoning_gym (task.name={t.name})")
    _validate_task_fields(t)
    _check(t.name != "reasoning_gym" or bool(t.subset),
           "task.name=reasoning_gym needs task.subset=<dataset> (e.g. chain_sum)")
    _check(t.name != "reasoning_gym" or "numeric_match" not in cfg.reward.functions,
           "task.name=reasoning_gym: score with the dataset's own verifier, "
           "reward.functions=[reasoning_gym]")
    _check(t.name != "countdown" or "numeric_match" not in cfg.reward.functions,
           "task.name=countdown: numeric_match would reward echoing the target; "
           "use reward.functions=[countdown]")
    _check(t.chat_template or t.system_prompt == TaskConfig.system_prompt,
           "task.system_prompt goes into the chat template: it is unused with "
           "task.chat_template=false")
    lo = cfg.lora
    _check(lo.r >= 0, "lora.r must be >= 0")
    for name in ("alpha", "dropout", "target_modules"):
        _check(lo.r > 0 or getattr(lo, name) == getattr(LoRAConfig(), name),
               f"lora.{name} is used only with lora.r > 0 (LoRA is off)")
    _check(0 < lo.alpha < float("inf") and 0 <= lo.dropout < 1,
           "lora.alpha must be a finite number > 0, lora.dropout in [0, 1)")
    _check(lo.dropout == 0 or not cfg.disable_dropout,
           "lora.dropout > 0 is unused with disable_dropout=true (the default: dropout makes "
           "π_θ differ from π_old at θ = θ_old); set disable_dropout=false to train with it")
    _check(bool(lo.target_modules), "lora.target_modules must not be empty")
    _check("all-linear" not in lo.target_modules or len(lo.target_modules) == 1,
           "lora.target_modules: 'all-linear' stands alone (every linear layer except the "
           "output layer); to add others, list every module name instead")
    _check(lo.r == 0 or r.engine in ("hf", "vllm"),
           f"lora.r > 0 needs rollout.engine=hf or vllm (syncing LoRA weights into {r.engine} "
           "is not implemented)")
    _check(cfg.logging.samples_every >= 0, "logging.samples_every must be >= 0")
    _check(cfg.logging.drift_every >= 0, "logging.drift_every must be >= 0")
    _check(cfg.logging.rollout_check_every >= 0, "logging.rollout_check_every must be >= 0")
    _check(0 <= cfg.reward.overlong_buffer <= r.max_new_tokens,
           "reward.overlong_buffer must be in [0, rollout.max_new_tokens]")
    _check(not cfg.reward.weights or len(cfg.reward.weights) == len(cfg.reward.functions),
           "reward.weights must have one weight per reward function")
    _check(bool(cfg.reward.functions), "reward.functions must not be empty")
    _check(0 <= cfg.reward.max_unscorable_frac <= 1, "reward.max_unscorable_frac must be in [0, 1]")
    _check(cfg.reward.memory_mb >= 0, "reward.memory_mb must be >= 0")
    _check(cfg.reward.isolate == "process" or cfg.reward.memory_mb == RewardConfig.memory_mb,
           "reward.memory_mb applies only with reward.isolate=process")
    _check(0 <= cfg.reward.timeout_s < float("inf"), "reward.timeout_s must be a number >= 0")
    _check(r.dynamic_max_extra_batches >= 0, "rollout.dynamic_max_extra_batches must be >= 0")
    _check(r.dynamic_sampling
           or r.dynamic_max_extra_batches == RolloutConfig().dynamic_max_extra_batches,
           "rollout.dynamic_max_extra_batches is set but rollout.dynamic_sampling=false")
    # draw d's sampling seeds continue draw d-1's within the step's block (see Trainer.rollout)
    draws = r.dynamic_max_extra_batches + 1
    _check(not r.dynamic_sampling or draws * r.prompts_per_step < 65_537,
           "rollout.prompts_per_step x (rollout.dynamic_max_extra_batches + 1) must be < 65537")
    _check(cfg.logging.zero_signal_warn_steps >= 0, "logging.zero_signal_warn_steps must be >= 0")
    _validate_guard(cfg.guard)
    _check(cfg.guard.on_fault != "lower_lr" or cfg.save_every > 0 or bool(cfg.resume),
           "guard.on_fault=lower_lr reloads the last good checkpoint: set save_every > 0 "
           "(else the first fault can only stop the run)")


# What each built-in task reads of TaskConfig beyond eval_size, system_prompt and
# chat_template (tasks registered by users get the whole config).
_COLUMNS = ("prompt_field", "answer_field")  # also read of rows passed to the Trainer
_TASK_FIELDS = {
    "arithmetic": ("levels", "level_weights", "eval_levels", "operations", "prompt_template"),
    "countdown": ("countdown_numbers",),
    "gsm8k_mini": (),
    "jsonl": ("path", "eval_path", *_COLUMNS),
    "dataset": ("path", "subset", "split", "eval_split", *_COLUMNS),
    "reasoning_gym": ("subset", "options"),
}


def check_task_columns(t: TaskConfig) -> None:
    """task.prompt_field / task.answer_field set for a built-in task that reads no rows: a
    :class:`ConfigError`. Checked where the problems come from task.name (the CLI, a
    ``Trainer`` without ``train_dataset``); rows passed to ``Trainer(train_dataset=...)``
    are read by these columns whatever task.name is."""
    uses = _TASK_FIELDS.get(t.name, _COLUMNS)
    default = TaskConfig()
    for name in _COLUMNS:
        _check(name in uses or getattr(t, name) == getattr(default, name),
               f"task.{name} names a column of task.name=jsonl or dataset rows (or of "
               f"Trainer(train_dataset=...)); task.name={t.name} reads no rows")


def _validate_task_fields(t: TaskConfig) -> None:
    """A task field set for a built-in task that does not read it is an error (the row
    columns: :func:`check_task_columns`)."""
    uses = _TASK_FIELDS.get(t.name)
    if uses is None:
        return
    default = TaskConfig()
    unused = {f for fields in _TASK_FIELDS.values() for f in fields} - set(uses)
    for name in sorted(unused - set(_COLUMNS)):
        readers = [n for n, fields in _TASK_FIELDS.items() if name in fields]
        _check(getattr(t, name) == getattr(default, name),
               f"task.{name} is used only by task.name={' or '.join(readers)} "
               f"(task.name={t.name})")
    _check(t.eval_size > 0 or not t.eval_levels,
           "task.eval_levels are the levels of the held-out problems; task.eval_size=0 holds "
           "out none")
    held_out = (t.name == "jsonl" and t.eval_path) or (t.name == "dataset" and t.eval_split)
    _check(not held_out or t.eval_size == default.eval_size,
           "task.eval_size sizes the problems held out of task.path; it is unused with a held-out "
           f"set of its own (task.{'eval_path' if t.name == 'jsonl' else 'eval_split'})")


def _validate_optim(o: OptimConfig) -> None:
    _check(0 <= o.lr < float("inf"), "optim.lr must be a finite number >= 0")
    _check(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
           "optim.betas must be two values in [0, 1)")
    _check(0 <= o.weight_decay < float("inf"), "optim.weight_decay must be a number >= 0")
    _check(0 <= o.grad_clip < float("inf"), "optim.grad_clip must be a number >= 0 (0 = off)")
    _check(o.warmup_steps >= 0, "optim.warmup_steps must be >= 0")


def _validate_guard(g: GuardConfig) -> None:
    _check(g.max_consecutive_faults >= 0, "guard.max_consecutive_faults must be >= 0")
    _check(0 < g.lr_factor < 1, "guard.lr_factor must be in (0, 1)")
    _check(g.max_rollbacks >= 0, "guard.max_rollbacks must be >= 0")
    _check(g.collapse_window >= 1, "guard.collapse_window must be >= 1")
    signals = ("collapse_reward_drop", "collapse_entropy_floor", "collapse_ratio_ceiling")
    for name in signals:
        _check(0 <= getattr(g, name) < float("inf"), f"guard.{name} must be a number >= 0")
    default = GuardConfig()
    set_ = [k for k in ("on_fault", "lr_factor", "max_rollbacks")
            if getattr(g, k) != getattr(default, k)]
    _check(not set_ or g.max_consecutive_faults > 0 or any(getattr(g, n) for n in signals),
           f"guard.{set_[0] if set_ else ''} is set but the guard watches nothing "
           "(guard.max_consecutive_faults=0 and every guard.collapse_* is 0)")
    _check(g.on_fault == "lower_lr" or g.lr_factor == default.lr_factor,
           f"guard.lr_factor is used only with guard.on_fault=lower_lr (on_fault={g.on_fault})")
    _check(g.on_fault != "stop" or g.max_rollbacks == default.max_rollbacks,
           "guard.max_rollbacks is unused with guard.on_fault=stop (it never rolls back)")
    _check(g.collapse_reward_drop > 0 or g.collapse_window == default.collapse_window,
           "guard.collapse_window is the window of guard.collapse_reward_drop, which is 0 (off)")


def load_sft_config(path: str | Path | None = None,
                    overrides: list[str] | None = None) -> SFTConfig:
    """Build and check an :class:`SFTConfig` from defaults, an optional YAML file and
    overrides."""
    cfg = build(SFTConfig, path, overrides)
    _check(cfg.steps >= 0 and cfg.batch_size >= 1 and 0 <= cfg.lr < float("inf"),
           "sft: steps must be >= 0, batch_size >= 1, lr a finite number >= 0")
    _check(0 <= cfg.weight_decay < float("inf"), "sft.weight_decay must be a number >= 0")
    _check(0 <= cfg.grad_clip < float("inf"), "sft.grad_clip must be a number >= 0 (0 = off)")
    _check(bool(cfg.levels) and all(1 <= lv <= 4 for lv in cfg.levels),
           "sft.levels must be a non-empty list of levels in 1..4")
    _check(bool(cfg.operations) and all(op in ("+", "-", "*") for op in cfg.operations),
           "sft.operations must be a non-empty list of '+', '-', '*'")
    _check(cfg.eval_size >= 0 and cfg.warmup_steps >= 0,
           "sft.eval_size/warmup_steps must be >= 0")
    _check(cfg.num_threads >= 0, "sft.num_threads must be >= 0 (0: torch's default)")
    _check(cfg.chat_template or not cfg.system_prompt,
           "sft.system_prompt goes into the chat template: it is unused with "
           "sft.chat_template=false")
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def describe_fields(cls: type = TrainConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every leaf field: feeds ``gspo train --help``."""
    rows: list[tuple[str, str, str]] = []
    hints = typing.get_type_hints(cls)
    inst = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows += describe_fields(tp, f"{prefix}{f.name}.")
        else:
            help_text = f.metadata.get("help", "")
            rows.append((f"{prefix}{f.name}", repr(getattr(inst, f.name)), help_text))
    return rows
