"""The RL recipe, top to bottom: prompts → rollouts → rewards → advantages → π_old → update → sync.

One :class:`Trainer` per run: ``Trainer(cfg).setup()``, ``train()``, ``cleanup()``. ``setup``
loads everything that can fail on bad input *before* the run folder is created, so a bad
config, model or dataset leaves nothing behind. :meth:`Trainer.train_step` composes the step's
phases, each one call into a sub-package; the comparison probe and the benchmarks call the
same phase methods.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import math
import time
import urllib.parse
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm.auto import tqdm

from gspo.config import (
    ConfigError,
    TrainConfig,
    check_task_columns,
    to_dict,
    validate,
)
from gspo.data import build_task, format_prompt
from gspo.data.hf import task_from_records
from gspo.models import load_model, token_logprobs
from gspo.models.decode import packable
from gspo.models.lean_forward import (
    at_layer_boundaries,
    compile_unsupported,
    inference_safe,
    lean_unsupported,
    no_autograd,
)
from gspo.models.loading import ensure_pad_token
from gspo.models.lora import apply_lora, is_peft, reference_logprobs
from gspo.models.moe import replay_routing
from gspo.models.onednn import pays as onednn_pays
from gspo.models.packing import shared_prefix_logprobs
from gspo.models.tokens import eos_ids
from gspo.models.train_noise import disable_train_noise
from gspo.objectives import ADVANTAGES, compute_advantages, group_stats, objective_from_config
from gspo.rewards import RewardError, RewardScorer
from gspo.rewards.shaping import add_overlong, without_overlong
from gspo.rollout import (
    Rollout,
    SamplingParams,
    build_engine,
    check_engine_installed,
    engine_capabilities,
    pad_batch,
)
from gspo.rollout.async_engine import Request, trainer_pass
from gspo.rollout.batch import policy_tokens
from gspo.rollout.engine import weights_for_rollout
from gspo.rollout.gloo_net import is_this_machine
from gspo.rollout.multiturn import TurnLoop, engine_sampler, episode_metrics
from gspo.trainer import distributed
from gspo.trainer.async_rollout import (
    ENGINE_TIMES,
    AsyncRollout,
    drift_metrics,
    staleness_metrics,
    staleness_routing_metrics,
)
from gspo.trainer.checkpoint import (
    atomic_write_text,
    cuda_rng_state,
    extra_rng_state,
    latest_checkpoint,
    load_checkpoint_state,
    load_weights,
    prune_checkpoints,
    save_checkpoint,
    seed_extra_rngs,
    set_extra_rng_state,
)
from gspo.trainer.diagnostics import StepDiagnostics
from gspo.trainer.dynamic_sampling import (
    Draw,
    ZeroSignalWatch,
    collect,
    concat_rollouts,
    mask_truncated,
)
from gspo.trainer.evaluate import evaluate
from gspo.trainer.guard import GuardStop
from gspo.trainer.host import keep_freed_memory
from gspo.trainer.metrics import (
    MetricsLogger,
    max_over_ranks,
    mean_stats,
    reward_part_metrics,
    rollout_metrics,
)
from gspo.trainer.mismatch import mismatch_metrics
from gspo.trainer.moe_hooks import policy_hooks
from gspo.trainer.reliability import Reliability
from gspo.trainer.run_logs import log_sizes, truncate_logs
from gspo.trainer.samples import write_samples
from gspo.trainer.setup_checks import (
    behaviour_routing,
    check_compile,
    check_engine_share,
    check_resumed_model,
    check_unused_options,
    engine_options,
    new_run_folder,
    old_is_current,
    recompute_old_always,
    resume_checkpoint,
)
from gspo.trainer.signals import GracefulStop
from gspo.trainer.timing import PhaseTimer, gpu_memory_metrics
from gspo.trainer.tracking import with_trackers
from gspo.trainer.update import (
    UpdateBatch,
    UpdatePlan,
    UpdateResult,
    can_reuse_first_forward,
    plan_update,
    policy_update,
    stat_kinds,
)


def frozen(model: Any) -> Any:
    """``model`` in eval mode, without gradients (the KL term's reference policy)."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _lr_lambda(cfg: TrainConfig, total: int):
    warm, kind = cfg.optim.warmup_steps, cfg.optim.schedule

    def f(i: int) -> float:
        if warm and i < warm:
            return (i + 1) / warm
        frac = min(1.0, (i - warm) / max(1, total - warm))
        if kind == "cosine":
            return 0.5 * (1 + math.cos(math.pi * frac))
        if kind == "linear":
            return 1.0 - frac
        return 1.0

    return f


@dataclass
class OldPolicy:
    """What the π_old phase produced for the update and for the step's metrics.

    ``rollout``: log π_rollout as the engine returned it [N, T]; ``recomputed``: the trainer's
    fp32 pass on this step's weights (None on steps without it: π_old, or in the async loop
    this step's policy to measure the behaviour policy against) and ``entropy`` the policy's
    entropy there; for a plan with ``old_from_first`` both get the first minibatch's rows from
    the update.
    """

    rollout: torch.Tensor
    recomputed: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    routing_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    after: torch.Tensor | None = None  # log π_θ after the update (logging.drift_every steps)
    behaviour: torch.Tensor | None = None  # async: log π_v (behaviour weights), trainer's pass

    def take_first_minibatch(self, result: UpdateResult) -> None:
        """Fill in the rows the update's first minibatch computed (see UpdatePlan)."""
        if result.first_rows is None or self.entropy is None:
            return
        rows, ent = result.first_rows, result.first_entropy
        if result.first_logprobs is None:  # they were π_old: the update's filled-in copy
            self.recomputed = result.old_logprobs
        else:
            assert self.recomputed is not None
            self.recomputed[rows] = 0.0
            self.recomputed[rows, :result.first_logprobs.shape[1]] = result.first_logprobs
        self.entropy[rows] = 0.0
        self.entropy[rows, :ent.shape[1]] = ent


class Trainer:
    """``Trainer(cfg).setup(); trainer.train()``; the CLI does exactly this.

    From Python, each argument replaces its part of ``cfg``: ``model`` (a loaded model with its
    ``tokenizer``, or a config ``model`` name/folder), ``reward_fns`` (callables or registered
    names) and ``train_dataset`` / ``eval_dataset`` (a ``datasets.Dataset`` or a list of dicts
    with the ``task.prompt_field`` / ``task.answer_field`` columns; without ``eval_dataset``,
    ``task.eval_size`` problems are held out, every row of a prompt on the same side).
    """

    def __init__(self, cfg: TrainConfig | None = None, *, reward_fns: list[Any] | None = None,
                 model: Any = None, tokenizer: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None) -> None:
        cfg = cfg if cfg is not None else TrainConfig()
        if isinstance(model, (str, Path)):
            cfg, model = dataclasses.replace(cfg, model=str(model)), None
        if eval_dataset is not None and train_dataset is None:
            raise ValueError("eval_dataset needs a train_dataset")
        if (model is None) != (tokenizer is None):
            raise ValueError("a loaded model needs its tokenizer (Trainer(cfg, model=m, "
                             "tokenizer=t)), and a tokenizer its model" if model is not None
                             else "tokenizer= needs the loaded model it belongs to (model=)")
        if reward_fns:  # record them by name in the run's config.yaml, and check the weights
            names = [f if isinstance(f, str) else getattr(f, "__name__", "reward")
                     for f in reward_fns]
            cfg = dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward,
                                                                      functions=names))
        validate(cfg)  # a TrainConfig built in Python has not been checked yet
        if train_dataset is None:  # the problems come from task.name
            check_task_columns(cfg.task)
        self.cfg = cfg
        self.objective = objective_from_config(cfg.objective)  # an unused option: ConfigError
        self.reward_specs = reward_fns or cfg.reward.functions
        self.model, self.tokenizer = model, tokenizer
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.baseline_eval: dict[str, float] | None = None
        self.final_eval: dict[str, float] | None = None
        self.saved_step: int | None = None  # the step of the newest checkpoint this run wrote
        self.last_samples: tuple[Any, ...] | None = None  # the last scored batch, for samples
        self.last_samples_local = False  # torchrun: last_samples holds this rank's rows only
        self.zero_signal = ZeroSignalWatch(cfg.logging.zero_signal_warn_steps)
        # dynamic sampling under torchrun: the step's rows [N] that are stand-in groups
        self.stand_ins: torch.Tensor | None = None
        # Set by setup(), in this order (see there).
        self.scorer: RewardScorer | None = None
        self.task: Any
        self.eos: list[int]
        self.pad_id: int
        self.ref_model: Any = None
        self.dist: distributed.Dist
        self.engine: Any = None
        self.engine_current = True  # async + dynamic sampling: self.engine has this step's weights
        self.turns: TurnLoop | None = None  # rollout.max_turns > 1: environment turns
        self.async_rollout: AsyncRollout | None = None  # rollout.async_steps > 0
        self.hooks: Any
        self.logprob_fn: Any
        self.lean = self.inference = False
        self.optimizer: Any = None  # torch.optim.AdamW once set up
        self.scheduler: Any = None
        self.run_dir: Path
        self.reliability: Reliability
        self.logger: Any = None

    # ------------------------------------------------------------------ setup
    def setup(self) -> Trainer:
        cfg = self.cfg
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        if cfg.keep_freed_memory:
            keep_freed_memory()
        torch.manual_seed(cfg.seed)
        seed_extra_rngs(cfg.seed)  # reward code may draw from them
        # Resolve everything that can fail on user input before touching the disk.
        distributed.resolve_device(cfg.device)  # device=cuda without a GPU: say so first
        resume_ckpt = self._resume_checkpoint()
        if self.model is None:  # loaded from cfg.model (or the checkpoint)
            check_resumed_model(cfg)
        self.scorer = RewardScorer.from_specs(self.reward_specs, cfg.reward.weights)
        if self.train_dataset is not None:
            self.task = task_from_records(self.train_dataset, self.eval_dataset, cfg.task,
                                          cfg.seed)
        else:
            self.task = build_task(cfg.task, cfg.seed)
        ADVANTAGES.get(cfg.objective.advantage)
        from_checkpoint = self.model is None and resume_ckpt is not None and not cfg.lora.r
        self._load_policy(resume_ckpt)
        if cfg.reward.overlong_buffer:  # needs the tokenizer, hence after the model
            self.scorer = add_overlong(self.scorer, max_tokens=cfg.rollout.max_new_tokens,
                                       buffer_tokens=cfg.reward.overlong_buffer,
                                       tokenizer=self.tokenizer)
        self.scorer.timeout_s = cfg.reward.timeout_s
        if cfg.reward.isolate == "process":
            self.scorer.isolate(self.reward_specs, memory_mb=cfg.reward.memory_mb)
        self.eos, self.pad_id = eos_ids(self.model, self.tokenizer), self.tokenizer.pad_token_id
        self.turns = TurnLoop.from_config(cfg.rollout, cfg.task, self.tokenizer,
                                          context_limit=self.context_limit)
        self.ref_model = (self._reference_model(resumed=from_checkpoint)
                          if cfg.objective.beta > 0 else None)
        # Before the engine and the optimizer: FSDP2 replaces the parameters with shards.
        self.dist = distributed.prepare(cfg, self.model, self.ref_model)
        self._start_engine()  # on the final policy, once the config fits what it can do
        self._choose_passes()
        # The pipeline's process starts at the end of setup, on the restored weights.
        self.async_rollout = self._async_rollout(cfg.rollout.async_steps)  # started below
        self._check_unused_options()
        self.optimizer = torch.optim.AdamW(
            self.hooks.param_groups(self.model, cfg.optim.lr), lr=cfg.optim.lr,
            betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay,
            fused=cfg.optim.fused and not self._fsdp2)
        if cfg.rollout.async_lend_threads:  # thread lending polls before every AdamW step
            self.optimizer.register_step_pre_hook(
                lambda *_: self.async_rollout.poll_threads())
        total = cfg.steps * cfg.objective.num_minibatches * cfg.objective.epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(cfg, total))
        o = cfg.objective
        if (o.num_minibatches == 1 and o.epochs == 1
                and self._old_is_current()):  # else π_old is an older (behaviour) policy
            # the three share one gradient only as per-sequence token means, Â unweighted:
            # token sums (aggregation=token, Dr. GRPO's constant) or a behaviour correction's
            # token-level weights set GRPO (and GSPO-token) apart
            same = o.aggregation == "sequence" and o.correction.name == "none"
            warnings.warn("one minibatch and one epoch: every ratio is 1, so "
                          + ("GSPO, GSPO-token and GRPO compute the same update (clipping never "
                             "acts)" if same else "clipping never acts"), stacklevel=2)
        self.run_dir = self._make_run_dir()
        guard_state = self._restore(resume_ckpt) if resume_ckpt is not None else None
        self._write_config()
        self.reliability = Reliability(cfg.guard, self.run_dir, guard_state)
        logger = MetricsLogger(self.run_dir, cfg.tensorboard,
                               resume_step=self.step if resume_ckpt else -1)
        self.logger = (with_trackers(logger, cfg.logging, self.run_dir, to_dict(cfg),
                                     resumed=resume_ckpt is not None)
                       if self.dist.is_main else logger)
        if self.async_rollout is not None:  # on the restored weights: policy version `step`
            with self.dist.full_weights(self.model):
                self.async_rollout.start(self.model, self.tokenizer, version=self.step)
        return self

    @property
    def _fsdp2(self) -> bool:
        return self.dist.enabled and self.dist.strategy == "fsdp2"

    def _load_policy(self, resume_ckpt: Path | None) -> None:
        cfg = self.cfg
        if self.model is None:
            # A LoRA checkpoint holds only the adapter: load the base, then the adapter below.
            source = str(resume_ckpt) if resume_ckpt and not cfg.lora.r else cfg.model
            self.model, self.tokenizer = load_model(source, dtype=getattr(torch, cfg.dtype),
                                                    seed=cfg.seed)
        elif resume_ckpt is not None and not cfg.lora.r:
            # A policy passed in is the run's initial one: the KL reference is a copy of it,
            # taken before the checkpoint's weights go into it.
            if cfg.objective.beta > 0:
                self.ref_model = frozen(copy.deepcopy(self.model))
            load_weights(self.model, resume_ckpt)
        ensure_pad_token(self.tokenizer)  # one passed in may have none (Llama 3, Mistral base)
        # positions the model was trained on (None: unknown); a longer context is warned of once
        self.context_limit: int | None = getattr(self.model.config, "max_position_embeddings",
                                                 None)
        self._warned_context = False
        if cfg.lora.r:
            self.model = apply_lora(self.model, cfg.lora, adapter_dir=resume_ckpt)
        if cfg.disable_dropout:
            disable_train_noise(self.model)
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()

    def _start_engine(self) -> None:
        """Check the config against what the engine declares it can do (routing for R3, one
        engine per rank under torchrun), build the MoE hooks, then start the engine (the
        synchronous loop's: with ``rollout.async_steps > 0`` the engine process starts its own)."""
        cfg = self.cfg
        opts = engine_options(cfg)
        self.engine_opts = opts
        caps = engine_capabilities(cfg.rollout.engine, opts)
        self.hooks = policy_hooks(self.model, cfg.moe, caps, engine=cfg.rollout.engine,
                                  name=cfg.model)
        # An engine that cannot run inside a torchrun rank (vLLM would meet torchrun's process
        # group) samples in an engine process of the rank's own, outside torchrun's world: the
        # synchronous loop then runs the pipeline at k = 0 (see :meth:`_async_rollout`).
        self.engine_process = cfg.rollout.async_steps > 0 or (self.dist.enabled
                                                              and not caps.per_rank)
        if self.engine_process and cfg.rollout.engine not in ("hf", "vllm"):
            raise ConfigError(f"rollout.engine={cfg.rollout.engine} runs in one process only; "
                              "use rollout.engine=hf or vllm under torchrun")
        # its package, here and not in the engine process: before the run folder is made
        check_engine_installed(cfg.rollout.engine)
        # engine process: it samples; here only for dynamic sampling's extra draws, which
        # sample this step's weights (see :meth:`rollout`)
        if not self.engine_process or (cfg.rollout.dynamic_sampling
                                       and self._extra_draws_here()):
            with self.dist.full_weights(self.model):  # FSDP2: a copy (bf16) needs them whole
                self.engine = build_engine(cfg.rollout.engine, self.model, self.tokenizer, opts)

    def _choose_passes(self) -> None:
        """The log-prob pass every phase uses. Shared-prompt packing runs each prompt once
        (MoE routing capture and replay still see the plain (B, T) layout, see
        gspo.models.packing); under FSDP2 its fallback (no shared prompt in a rank's rows)
        would desynchronise the ranks' per-layer all-gathers, so FSDP2 keeps the plain path.
        Llama-family dense policies skip forward()'s per-call work (same values)."""
        packed = self.cfg.logprob_packing and not self._fsdp2
        why = lean_unsupported(self.model)
        self.lean = self.cfg.lean_forward and why is None
        if self.cfg.compile_layers and why is not None:
            raise ConfigError(f"compile_layers=true compiles the lean log-prob pass, which this "
                              f"model cannot take: {why}")
        check_compile(self.cfg, moe=self.hooks.active)
        if self.cfg.compile_layers and (why := compile_unsupported(self.dist.device)):
            raise ConfigError(f"compile_layers=true: {why}")
        self.logprob_fn = functools.partial(
            shared_prefix_logprobs if packed else token_logprobs, lean=self.lean,
            compiled=self.cfg.compile_layers, onednn=self._onednn(why))
        self.inference = self.lean and inference_safe(self.model)  # π_old pass, see there

    def _onednn(self, lean_why: str | None) -> bool:
        """Whether the lean passes multiply through oneDNN (``matmul``, gspo.models.onednn):
        ``auto`` where it pays on this CPU, eager dense lean passes outside FSDP2 only."""
        choice = self.cfg.matmul
        if choice == "blas":
            return False
        if choice == "onednn":
            if not self.lean:
                raise ConfigError("matmul=onednn runs the lean log-prob passes' products "
                                  f"through oneDNN, which this model cannot take: {lean_why}")
            if (why := packable(self.model)) is not None:
                raise ConfigError(f"matmul=onednn: {why}")
            return True
        return (self.lean and not self.cfg.compile_layers and not self._fsdp2
                and onednn_pays(self.model) is None)

    def _async_rollout(self, k: int) -> AsyncRollout | None:
        """``rollout.async_steps = k > 0``: the pipeline (gspo.trainer.async_rollout), checked
        against what it supports; None for the synchronous loop (k = 0), except under torchrun
        with an engine that runs in one process only (vLLM): the pipeline at k = 0 then, each
        rank's engine in a process of its own, sampling every batch from the current
        weights."""
        return self._pipeline(k) if self.engine_process else None

    def _pipeline(self, k: int) -> AsyncRollout:
        cfg = self.cfg
        # Every trainer process (torchrun: every rank) has engines of its own for its share of
        # the prompts, each for a share of that: spawned beside it, or `gspo engine`s at its
        # own addresses.
        n, world = cfg.rollout.async_engines, self.dist.world_size
        addresses = [a for a in cfg.rollout.async_address.split(",") if a]
        if addresses and len(addresses) != world * n:
            raise ConfigError(f"rollout.async_address: {len(addresses)} address(es) for "
                              f"{world} trainer process(es) x {n} engine(s) each; give one per "
                              "engine, comma-separated, in rank order")
        mine = addresses[self.dist.rank * n:(self.dist.rank + 1) * n]
        for address in mine:  # this rank listens there: its host must be this machine
            url = urllib.parse.urlparse(address)
            if url.scheme == "tcp" and url.hostname and is_this_machine(url.hostname) is False:
                raise ConfigError(
                    f"rollout.async_address: rank {self.dist.rank} listens at {address}, but "
                    f"{url.hostname} is not this machine; give each rank an address on its own "
                    "machine, in rank order (with torchrun's rendezvous, machines take ranks in "
                    "the order they join: use static ranks, --node_rank)")
        check_engine_share(cfg, world)
        # The engine process runs the trainer's pass on the behaviour weights: π_old for
        # recompute, and for an MoE policy π_old's routing (unless π_old is the proximal policy)
        behaviour_pass = (cfg.objective.old_logprobs == "recompute"
                          or self._behaviour_routing())
        r = cfg.rollout
        # what decides a batch's samples and what it carries (checkpointed with the in-flight
        # batches: a resume that changes one samples them again, see AsyncRollout)
        sampled_under = {f"rollout.{key}": getattr(r, key) for key in (
            "temperature", "top_p", "top_k", "max_new_tokens", "group_size", "max_turns",
            "engine", "precision")}
        sampled_under.update({"objective.old_logprobs": cfg.objective.old_logprobs,
                              "moe.routing_replay": cfg.moe.routing_replay})
        return AsyncRollout(
            k=k, total_steps=cfg.steps, draw=self._request,
            check=lambda step: behaviour_pass or self._measuring_step(step),
            engine=cfg.rollout.engine, opts=self.engine_opts,
            threads=cfg.rollout.async_threads if k > 0 else torch.get_num_threads(),
            logprob_fn=self.logprob_fn,
            temperature=cfg.rollout.temperature, chunk=cfg.logprob_chunk, pad_id=self.pad_id,
            device=self.dist.device, routing=self.hooks.active,
            replay=(self.hooks.records_rollout_routing
                    and cfg.objective.old_logprobs == "recompute"),
            addresses=tuple(mine), timeout_s=cfg.rollout.async_timeout_s,
            engines=n, turns=self.turns, lend_threads=cfg.rollout.async_lend_threads,
            sampled_under=sampled_under, request_for=self._request_for)

    def _behaviour_routing(self) -> bool:
        """Whether π_old's expert choices (what R2 replays, what ``moe/routing_change``
        compares with) are the behaviour policy's, recorded by the engine process's pass:
        an MoE policy sampled by an engine process (the async loop, or vLLM under torchrun)
        whose π_old is the behaviour policy (``recompute``, ``rollout``); with ``decoupled``
        π_old is this step's weights, recorded here."""
        return behaviour_routing(self.cfg, moe=self.hooks.active,
                                 engine_process=self.engine_process)

    def _resume_checkpoint(self) -> Path | None:
        return resume_checkpoint(self.cfg.resume)

    def _reference_model(self, *, resumed: bool) -> Any:
        """A frozen copy of the initial policy; None for a LoRA policy, whose reference is the
        same model with its adapter disabled (see gspo.models.lora.reference_logprobs).
        ``resumed``: the policy was loaded from a checkpoint, so it holds that step's weights
        and the initial policy is loaded again from ``cfg.model``."""
        if is_peft(self.model):
            return None
        if self.ref_model is not None:  # a policy passed in, copied before its resume
            return self.ref_model
        if resumed:
            ref, _ = load_model(self.cfg.model, dtype=getattr(torch, self.cfg.dtype),
                                seed=self.cfg.seed)
            return frozen(ref)
        return frozen(copy.deepcopy(self.model))

    def _make_run_dir(self) -> Path:
        cfg = self.cfg
        if cfg.resume:
            run_dir = Path(cfg.resume)
        else:
            run_dir = new_run_folder(cfg, cfg.run_name or time.strftime("%Y%m%d-%H%M%S"))
            if self.dist.is_main:
                run_dir.mkdir(parents=True, exist_ok=True)
        self.dist.barrier()  # every rank has checked the folder before rank 0 writes into it
        return run_dir

    def _write_config(self) -> None:
        """``RUN/config.yaml`` (rank 0 owns the run folder); on a resume written only once the
        checkpoint is restored, so a resume that fails leaves the run's own config."""
        if self.dist.is_main:
            atomic_write_text(self.run_dir / "config.yaml",  # `gspo train resume=RUN` reads it
                              yaml.safe_dump(to_dict(self.cfg), sort_keys=False))

    # ------------------------------------------------------------------ checkpoints
    def _restore(self, ckpt: Path) -> dict[str, Any] | None:
        """Load optimizer, schedule, data position, RNG and counters; the guard's state."""
        optim_state, state = load_checkpoint_state(ckpt)
        if ("async" in state) != (self.async_rollout is not None):
            raise ConfigError("resume: rollout.async_steps must be 0 in both runs or > 0 in "
                              "both, and vLLM under torchrun in both or neither (the "
                              "checkpoint holds an engine process's in-flight batches only "
                              "then)")
        try:
            self.task.load_state_dict(state["task"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(
                f"resume: the checkpoint's data position does not fit task.name="
                f"{self.cfg.task.name} ({type(e).__name__}: {e}); resume with the run's own "
                f"config: gspo train resume={self.cfg.resume}") from None
        configured = distributed.group_settings(self.optimizer)
        saved_groups = len(optim_state["optimizer"].get("param_groups", configured))
        if saved_groups != len(configured):  # moe.router_lr_scale 1 in one run, not the other
            raise ConfigError(
                f"resume: the checkpoint's optimizer has {saved_groups} parameter group(s), this "
                f"run {len(configured)}: moe.router_lr_scale must be 1 in both runs or other "
                f"than 1 in both; resume with the run's own config: gspo train "
                f"resume={self.cfg.resume}")
        distributed.load_optimizer_state(self.model, self.optimizer, optim_state["optimizer"],
                                         self.dist)
        self.scheduler.load_state_dict(optim_state["scheduler"])
        self._keep_configured_hyperparameters(configured)
        # torchrun: each rank's own RNG states where the checkpoint has one per rank of this
        # world (each rank drew from them for its own rows, e.g. a reward using `random`);
        # else (one process, another world size) the rank-0 states
        own = (self.dist.rank if self.dist.enabled
               and len(state.get("rank_rng", [])) == self.dist.world_size else None)
        torch.set_rng_state(optim_state["torch_rng"] if own is None
                            else optim_state["rank_torch_rng"][own])
        if optim_state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(optim_state["cuda_rng"])
        set_extra_rng_state(state.get("rng", {}) if own is None else state["rank_rng"][own])
        self.step, self.history = state["step"], state.get("history", [])
        self.zero_signal.load_state_dict(state.get("zero_signal", {"streak": 0, "warned": False}))
        self.baseline_eval = state.get("baseline_eval")
        self.final_eval = state.get("final_eval")
        self.saved_step = self.step
        if self.async_rollout is not None:
            self.async_rollout.load_state_dict(state["async"], self.dist.rank,
                                               self.dist.world_size)
        # Lines logged after this checkpoint belong to steps the resumed run redoes (last:
        # a resume that fails above leaves the run folder as it was).
        truncate_logs(self.run_dir, state.get("log_sizes", {}))
        return state.get("guard")

    def _keep_configured_hyperparameters(self, configured: list[dict[str, Any]]) -> None:
        """After the checkpoint's optimizer and schedule state are loaded: the resumed run's
        ``optim.*`` values apply (loading put back the saved run's ``betas``, ``weight_decay``
        and learning rate, and ``config.yaml`` records the new ones). ``configured``: each
        parameter group's hyperparameters before loading. The learning rate keeps its place in
        the schedule and any ``guard.on_fault=lower_lr`` factor: it is scaled by the ratio of
        the configured base rate to the saved one (1 when ``optim.lr`` is unchanged)."""
        groups = self.optimizer.param_groups
        for i, (group, want) in enumerate(zip(groups, configured)):
            scale = want["initial_lr"] / group.get("initial_lr", want["initial_lr"])
            group.update({k: v for k, v in want.items() if k != "lr"})
            group["lr"] *= scale
            self.scheduler.base_lrs[i] *= scale
        self.scheduler._last_lr = [group["lr"] for group in groups]

    def save_checkpoint(self) -> Path:
        guard = self.reliability.guard
        guard.saved(self.step)
        model_state = distributed.full_model_state(self.model, self.dist)  # FSDP2: collective
        optim_state = {"optimizer": distributed.optimizer_state(self.model, self.optimizer,
                                                                self.dist),
                       "scheduler": self.scheduler.state_dict(),
                       "torch_rng": torch.get_rng_state(), "cuda_rng": cuda_rng_state()}
        state = {"step": self.step, "task": self.task.state_dict(), "history": self.history,
                 "baseline_eval": self.baseline_eval, "final_eval": self.final_eval,
                 "guard": guard.state_dict(), "zero_signal": self.zero_signal.state_dict(),
                 "rng": extra_rng_state(),
                 "log_sizes": log_sizes(self.run_dir)}
        if self.dist.enabled:  # every rank's own RNG states (rank 0 writes the checkpoint)
            ranks = self.dist.gather_objects((extra_rng_state(), torch.get_rng_state()))
            state["rank_rng"] = [extra for extra, _ in ranks]
            optim_state["rank_torch_rng"] = [t for _, t in ranks]
        if self.async_rollout is not None:  # the in-flight batches (waits for them)
            state["async"] = self.async_rollout.state_dict()
            if self.dist.enabled:  # each rank sampled its own share of the prompts
                state["async"]["ready"] = self.dist.gather_objects(state["async"]["ready"])
        path = self.run_dir / "checkpoints" / f"step_{self.step:06d}"
        if self.dist.is_main:
            path = save_checkpoint(self.run_dir / "checkpoints", self.step, self.model,
                                   self.tokenizer, optim_state, state, self.cfg.keep_checkpoints,
                                   protect=self._protected(), state_dict=model_state)
        self.dist.barrier()
        self.saved_step = self.step
        return path

    def _protected(self) -> tuple[str, ...]:
        """The checkpoint folders pruning spares: the guard's last good one."""
        good = self.reliability.guard.last_good_step
        return () if good is None else (f"step_{good:06d}",)

    # ------------------------------------------------------------------ the step's phases
    def rollout(self, draw: int = 0) -> tuple[list[Any], Rollout]:
        """This rank's share of the step's prompts (all of them in one process) and their
        ``group_size`` samples each, from the rollout engine. ``draw``: the how-many-th
        rollout batch of this step (dynamic sampling draws more than one). Async: from the
        pipeline, which drew them earlier (its ``async/*`` timings and staleness in
        ``Rollout.extras``); dynamic sampling's extra draws (``draw > 0``) are sampled on this
        step's weights (staleness 0, the rows' version this step): here, by this process's
        engine, their ``trainer_logprobs`` left None until :meth:`refill` knows which rows it
        keeps (on the steps the pipeline's batch carries them), or for vLLM by the engine
        process, with its pass on them (see :meth:`_extra_draws_here`)."""
        if self.async_rollout is not None and draw == 0:
            return self.async_rollout.next(self.step)
        examples, req = self._request(self.step, draw)
        if self.async_rollout is not None and not self._extra_draws_here():
            return examples, self.async_rollout.extra(self.step, draw, examples, req)
        if self.async_rollout is not None and not self.engine_current:
            if not self.engine.capabilities.shares_policy_weights:  # e.g. a bf16 copy
                self.sync()
            self.engine_current = True
        with weights_for_rollout(self.engine, lambda: self.dist.full_weights(self.model)):
            if self.turns is None:
                roll = self.engine.generate(req.prompts, group_size=req.group_size,
                                            params=req.params, seeds=req.seeds)
            else:  # observation turns between the policy's (gspo.rollout.multiturn)
                roll = self.turns.run(engine_sampler(self.engine, req.params), examples,
                                      req.prompts, req.seeds, req.group_size)
        if self.async_rollout is not None:
            roll.versions = [self.step] * len(roll)
            if self.async_rollout.check(self.step):  # as the pipeline's batch of this step
                if self.hooks.active:  # MoE: the pass's experts, in this draw's own layout
                    self._behaviour_pass(roll, whole=True)
                else:  # run once the rows kept are known (refill)
                    roll.trainer_logprobs = [None] * len(roll)  # type: ignore[list-item]
        return examples, roll

    def _extra_draws_here(self) -> bool:
        """Dynamic sampling with ``async_steps > 0``: whether this process samples the extra
        draws, with an ``hf`` engine of its own beside the pipeline (the trainer's threads,
        no wait), or asks the engine process for them on this step's weights, after the
        batches it already has (``vllm``: a second vLLM cannot start here)."""
        return self.cfg.rollout.engine == "hf"

    def _request(self, step: int, draw: int = 0) -> tuple[list[Any], Request]:
        """The prompts of ``step``'s ``draw``-th rollout batch (drawn from the task: call once
        per batch, in order), their sampling seeds and parameters."""
        # Every rank draws the same prompts and keeps whole groups: advantages stay local.
        examples = self.task.sample(self.cfg.rollout.prompts_per_step)
        lo, hi = self.dist.shard(len(examples))
        return examples[lo:hi], self._request_for(examples[lo:hi], step, draw)

    def _request_for(self, examples: list[Any], step: int, draw: int = 0) -> Request:
        """The request that samples this rank's share ``examples`` of ``step``'s ``draw``-th
        batch: their prompts, seeds and sampling parameters (the same every time)."""
        cfg = self.cfg.rollout
        lo, _ = self.dist.shard(cfg.prompts_per_step)
        task = self.cfg.task
        prompts = [format_prompt(self.tokenizer, ex.prompt, chat_template=task.chat_template,
                                 system_prompt=task.system_prompt) for ex in examples]
        self._warn_past_context(max(map(len, prompts), default=0) + cfg.max_new_tokens)
        # Sampling is a function of (seed, step, draw, prompt index): resume is exact, and the
        # responses do not depend on how the prompts are split across ranks.
        first = draw * cfg.prompts_per_step + lo  # < 65_537 (checked by validate)
        seeds = [(self.cfg.seed * 1_000_003 + step) * 65_537 + first + i
                 for i in range(len(prompts))]
        params = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)
        return Request(step, step, prompts, cfg.group_size, params, seeds, False)

    def _warn_past_context(self, tokens: int) -> None:
        """Warn once when a prompt + ``rollout.max_new_tokens`` runs past the positions the
        model was trained on (``max_position_embeddings``): nothing truncates or drops such a
        prompt, and a RoPE model runs there without an error, out of its trained range
        (``rollout/prompt_len_max`` logs the longest prompt of each step)."""
        limit = self.context_limit
        if limit is None or tokens <= limit or self._warned_context:
            return
        self._warned_context = True
        new = self.cfg.rollout.max_new_tokens
        warnings.warn(f"rollout: a prompt + rollout.max_new_tokens={new} is {tokens} tokens, "
                      f"past the model's max_position_embeddings={limit}: it is sampled and "
                      "trained on as it is, beyond the positions the model was trained on "
                      "(shorten the prompts or rollout.max_new_tokens)", stacklevel=2)

    def score(self, examples: list[Any], roll: Rollout) -> tuple[torch.Tensor, dict[str, float]]:
        """Rewards of the global batch (NaN: unscorable) and the per-function reward metrics."""
        rewards, parts = self.score_rows(examples, roll)
        return rewards, reward_part_metrics(parts)

    def score_rows(self, examples: list[Any], roll: Rollout
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Rewards of the global batch (NaN: unscorable) and each reward function's values of
        the global batch's rows (``reward/<name>`` with several functions; the samples file)."""
        g = roll.group_size
        completions = self.tokenizer.batch_decode(roll.response_ids, skip_special_tokens=True)
        prompts = [ex.prompt for ex in examples for _ in range(g)]
        columns: dict[str, list] = {"answer": [ex.answer for ex in examples for _ in range(g)]}
        for key in examples[0].columns:
            columns[key] = [ex.columns.get(key) for ex in examples for _ in range(g)]
        before = dict(self.scorer.failures)
        total, per_fn = self.scorer(prompts, completions, columns, response_tokens=policy_tokens(
            roll.response_ids, roll.model_mask))
        # Every rank's rewards in prompt order: batch-scaled advantages, the reward metrics and
        # the unscorable check below see the global batch, so all ranks raise or none does.
        rewards, _ = self.dist.gather(torch.tensor(total, dtype=torch.float32))
        unscorable = float(torch.isnan(rewards).float().mean())
        if unscorable > self.cfg.reward.max_unscorable_frac:
            raise RewardError(f"{unscorable:.0%} of responses could not be scored "
                              f"(> reward.max_unscorable_frac); "
                              f"{self._unscorable_cause(per_fn, before)}")
        parts = {k: self.dist.gather(torch.tensor(v, dtype=torch.float32))[0]
                 for k, v in per_fn.items()}
        self.last_samples = (prompts, completions, total, per_fn, columns["answer"])
        self.last_samples_local = self.dist.enabled  # gathered when written (_write_samples)
        return rewards, parts

    def _unscorable_cause(self, per_fn: dict[str, list[float]], before: dict[str, int]) -> str:
        """Why this batch's responses (this process's rows) could not be scored: the reward
        function of nonzero weight that scored the fewest of them, and its reason, its first
        error when it failed in this batch (``before``: :attr:`RewardScorer.failures` before
        the batch), else that it returned None. Not an earlier batch's error of another
        function: the run's first error may have nothing to do with this batch."""
        weights = dict(zip(self.scorer.names, self.scorer.weights))
        missing = {name: sum(math.isnan(v) for v in values)
                   for name, values in per_fn.items() if weights.get(name)}
        name = max(missing, key=missing.__getitem__, default=None)
        if name is None or not missing[name]:  # torchrun: the other ranks' rows
            return "the unscorable responses are other processes' (see reward_errors.log)"
        n = len(per_fn[name])
        if self.scorer.failures.get(name, 0) > before.get(name, 0):
            lines = self.scorer.first_errors.get(name, "").strip().splitlines()
            why = f"its first error: {lines[-1] if lines else 'failed'}"
        else:
            why = "it returned None"
        return f"reward function '{name}' scored {n - missing[name]} of {n} ({why})"

    def advantages(self, rewards: torch.Tensor, roll: Rollout) -> torch.Tensor:
        """Advantages of this rank's rows, from the global batch's rewards (this rank holds
        its contiguous share of the batch's groups). Dynamic sampling's stand-ins (torchrun)
        get 0 and stay out of the batch statistics (``scale_rewards=batch``), as one process,
        which has none, computes them."""
        o = self.cfg.objective
        if self.stand_ins is None:
            adv = compute_advantages(o.advantage, rewards, roll.group_size,
                                     scale=o.scale_rewards)
        else:
            adv = torch.zeros_like(rewards)
            adv[~self.stand_ins] = compute_advantages(o.advantage, rewards[~self.stand_ins],
                                                      roll.group_size, scale=o.scale_rewards)
        first = self.dist.shard(len(rewards) // roll.group_size)[0] * roll.group_size
        return adv[first:first + len(roll)].to(self.dist.device)

    def plan(self, roll: Rollout, rows: int | None = None) -> UpdatePlan:
        """The update's minibatches over the global batch's ``rows`` (default: ``roll``'s, the
        whole batch in one process; dynamic sampling past its cap may hold fewer groups than
        ``prompts_per_step``), drawn before the π_old pass so that pass can skip the rows
        whose pass the first minibatch's own forward gives (θ = θ_old there when π_old is
        this step's weights; else the pass is a measurement, e.g. the async staleness drift)."""
        o = self.cfg.objective
        gen = torch.Generator().manual_seed(self.cfg.seed * 7_919 + self.step)
        reuse = (self._recompute_old()
                 and can_reuse_first_forward(self.model, self.dist, self.hooks))
        n = len(roll) if rows is None else rows
        if self.stand_ins is None:
            return plan_update(n, num_minibatches=o.num_minibatches, epochs=o.epochs,
                               generator=gen, old_from_first=reuse,
                               first_is_old=self._old_is_current())
        # dynamic sampling's stand-in groups (torchrun) join no minibatch: the minibatches
        # one process draws over the same rows
        real = (~self.stand_ins).nonzero().squeeze(-1)
        plan = plan_update(len(real), num_minibatches=o.num_minibatches, epochs=o.epochs,
                           generator=gen, old_from_first=reuse,
                           first_is_old=self._old_is_current())
        return dataclasses.replace(plan, minibatches=[[real[mb] for mb in epoch]
                                                      for epoch in plan.minibatches])

    @torch.no_grad()
    def old_logprobs(self, batch: dict[str, torch.Tensor], rows: torch.Tensor | None = None,
                     replay: list[torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor] | None]:
        """log π_old recomputed by the trainer in fp32, the policy's entropy, and (MoE) the
        expert indices π_old chose for every position (what R2 replays). ``rows``: compute
        these rows only (dense policies); the others are left at 0. ``replay`` (MoE, R3): per
        layer ``[N * T, k]`` experts the pass routes to (:func:`gspo.models.moe.replay_routing`)."""
        self.model.eval()
        cols = {k: batch[k] for k in ("input_ids", "attention_mask", "response_mask")}
        if rows is not None:
            width = int(batch["attention_mask"][rows].sum(-1).max()) if len(rows) else 0
            cols = {k: v[rows, :width] for k, v in cols.items()}
        forced = (replay_routing(self.model, replay) if replay is not None
                  else contextlib.nullcontext())
        with forced, self.hooks.capture_old(self.model) as rec:
            if cols["input_ids"].numel():
                # lean passes run in inference mode (less per-op work); their results are
                # copied out of it below, into tensors autograd may use
                with no_autograd(self.inference):
                    lp, ent = self.dist.forward(self.model, self.logprob_fn,
                                                cols["input_ids"], cols["attention_mask"],
                                                cols["response_mask"],
                                                temperature=self.cfg.rollout.temperature,
                                                chunk=self.cfg.logprob_chunk, with_entropy=True)
            else:
                lp = ent = torch.zeros(cols["input_ids"].shape, device=cols["input_ids"].device)
        if rows is not None:
            full = [torch.zeros(batch["response_mask"].shape, device=lp.device) for _ in range(2)]
            for t, part in zip(full, (lp, ent)):
                t[rows, :part.shape[1]] = part
            lp, ent = full
        elif self.inference:
            lp, ent = lp.clone(), ent.clone()
        routing = rec.take() if rec is not None else None
        if routing is not None and self.inference:  # replay indexes them under autograd
            routing = [r.clone() if r.is_inference() else r for r in routing]
        return lp, ent, routing

    def reference_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """log π_ref for the KL term (``objective.beta > 0``), else None."""
        if self.cfg.objective.beta == 0:
            return None
        args = (batch["input_ids"], batch["attention_mask"], batch["response_mask"])
        kw = {"temperature": self.cfg.rollout.temperature, "chunk": self.cfg.logprob_chunk}
        if self.ref_model is not None:
            return token_logprobs(self.ref_model, *args, **kw)[0]
        return reference_logprobs(self.model, *args, **kw)  # LoRA: the adapter disabled

    def _old_is_current(self) -> bool:
        """Whether the loss's π_old is the trainer's pass on this step's weights: with
        ``old_logprobs=recompute`` in the synchronous loop (async: the behaviour policy's
        weights are older, and the engine process ran that pass on them), and always with
        ``decoupled`` (its proximal π_old is this step's weights; π_rollout is the behaviour)."""
        return old_is_current(self.cfg, pipeline=self.async_rollout is not None)

    def _recompute_old(self) -> bool:
        """Whether this step runs the trainer's π_old pass: always for ``old_logprobs=recompute``
        and for MoE policies (their routing; async: the engine process records the behaviour
        policy's, see :meth:`_behaviour_routing`), else on measuring steps (async: only then,
        and it measures the staleness drift)."""
        return self._recompute_old_always() or self._measuring_step(self.step)

    def _recompute_old_always(self) -> bool:
        """Whether every step runs the trainer's π_old pass (see :meth:`_recompute_old`)."""
        return recompute_old_always(self.cfg, moe=self.hooks.active,
                                    pipeline=self.async_rollout is not None,
                                    behaviour=self._behaviour_routing())

    def _measuring_step(self, step: int) -> bool:
        """Whether ``step`` runs the passes that measure the engine against the trainer (the
        rollout-vs-trainer gap; async: the staleness drift): every
        ``logging.rollout_check_every`` steps, and on the ``logging.drift_every`` steps,
        whose policy drift is measured against them (see gspo.trainer.mismatch)."""
        log = self.cfg.logging
        return any(every > 0 and step % every == 0
                   for every in (log.rollout_check_every, log.drift_every))

    def _check_unused_options(self) -> None:
        """Options this run would not read, once the task, the policy's hooks and the loop
        (the pipeline, not started yet, or the synchronous loop) are known (``gspo validate``
        runs the same check where the config and the model's architecture tell them)."""
        check_unused_options(self.cfg, moe=self.hooks.active,
                             pipeline=self.async_rollout is not None,
                             recompute_always=self._recompute_old_always(),
                             has_eval=bool(self.task.eval_examples))

    def update_batch(self, roll: Rollout, adv: torch.Tensor, plan: UpdatePlan
                     ) -> tuple[UpdateBatch, OldPolicy]:
        """Padded tensors on the training device with π_old (recomputed, or the rollout's),
        π_ref and π_old's routing: everything the update reads."""
        padded = {k: v.to(self.dist.device) for k, v in
                  pad_batch(roll.prompt_ids, roll.response_ids, self.pad_id,
                            roll.logprobs, roll.model_mask).items()}
        old = OldPolicy(rollout=padded["old_logprobs"])
        # the staleness routing change: over the response tokens of the rows trained on (not
        # dynamic sampling's stand-ins, as one process, which has none)
        stand_ins = self._own_stand_ins(roll)
        measured = (padded["response_mask"] if stand_ins is None
                    else mask_truncated(padded["response_mask"], stand_ins.tolist()))
        routing = None
        if self._recompute_old():
            old.recomputed, old.entropy, routing = self.old_logprobs(
                padded, plan.old_pass_rows(len(roll)))
        if self._behaviour_routing():  # π_old is the behaviour policy: its experts
            if routing is not None:  # this step's own choices too: how far staleness moved them
                old.routing_metrics = staleness_routing_metrics(
                    roll.trainer_routing, routing, measured, self.dist)
            routing = roll.trainer_routing
        elif self.async_rollout is not None and routing is not None:
            # decoupled: π_old's experts are this step's own; the behaviour pass (on the
            # measuring steps) recorded the behaviour policy's, for the same measure
            old.routing_metrics = staleness_routing_metrics(
                roll.trainer_routing, routing, measured, self.dist)
        own, (routing, replayed) = routing, self.hooks.rollout_routing(roll, routing, self.dist)
        old.routing_metrics.update(replayed)
        # recompute / decoupled: the trainer's π_old; rollout (§5.4): the engine's. Only a
        # behaviour correction (decoupled, or rollout with one) sees π_rollout in the loss.
        o = self.cfg.objective.old_logprobs
        pi_old = old.rollout if o == "rollout" else old.recomputed
        if o != "rollout" and not self._behaviour_routing():
            # R3: the loss's π_old routes to the experts the update replays, as π_θ does (the
            # metrics keep the pass on π_old's own routing)
            forced = self.hooks.old_pass_replay(own, routing, self.dist)
            if forced is not None:
                pi_old = self.old_logprobs(padded, replay=forced)[0]
        if self.async_rollout is not None:  # the behaviour policy's weights are older
            def padded_rows(rows: list[torch.Tensor]) -> torch.Tensor:
                return pad_batch(roll.prompt_ids, roll.response_ids, self.pad_id,
                                 rows)["old_logprobs"].to(self.dist.device)

            if roll.trainer_logprobs is not None:
                old.behaviour = padded_rows(roll.trainer_logprobs)
            if o == "recompute":  # π_old is the behaviour policy (see async_rollout)
                # R3: that pass rerun under the experts the update replays, where they differ
                # from its own (old.behaviour stays the pass on its own, for the metrics)
                pi_old = (old.behaviour if roll.replayed_logprobs is None
                          else padded_rows(roll.replayed_logprobs))
        behaviour = old.rollout if self.objective.correction is not None else None
        mask = padded["response_mask"]
        if self.cfg.rollout.mask_truncated:  # zero loss weight; advantages are computed already
            mask = mask_truncated(mask, roll.truncated)
        if stand_ins is not None:  # dynamic sampling's stand-in groups: zero loss weight
            mask = mask_truncated(mask, stand_ins.tolist())
        batch = UpdateBatch(padded["input_ids"], padded["attention_mask"], mask, pi_old, adv,
                            self.reference_logprobs(padded), routing,
                            rollout_logprobs=behaviour)
        return batch, old

    def _own_stand_ins(self, roll: Rollout) -> torch.Tensor | None:
        """This rank's rows [len(roll)] that are dynamic sampling's stand-ins (torchrun), or
        None on a step without any."""
        if self.stand_ins is None:
            return None
        first = self.dist.shard(len(self.stand_ins) // roll.group_size)[0] * roll.group_size
        return self.stand_ins[first:first + len(roll)]

    def update(self, batch: UpdateBatch, plan: UpdatePlan) -> UpdateResult:
        cfg = self.cfg
        return policy_update(self.model, self.optimizer, self.scheduler, batch, plan,
                             objective=self.objective, temperature=cfg.rollout.temperature,
                             chunk=cfg.logprob_chunk, grad_clip=cfg.optim.grad_clip,
                             hooks=self.hooks, dist=self.dist, logprob_fn=self.logprob_fn,
                             diagnostics=StepDiagnostics(
                                 self.objective,
                                 cfg.rollout.max_new_tokens * cfg.rollout.max_turns))

    def sync(self) -> None:
        """The next rollout samples from the updated policy (FSDP2: from its gathered weights,
        for an engine with a copy of its own)."""
        with self.dist.full_weights(self.model):
            self.engine.sync_weights(self.model)

    def step_metrics(self, rewards: torch.Tensor, roll: Rollout, batch: UpdateBatch,
                     old: OldPolicy, result: UpdateResult, timer: PhaseTimer, *,
                     sampled_tokens: float | None = None,
                     extra_s: float = 0.0) -> dict[str, float]:
        """The step's metrics. ``sampled_tokens``: the response tokens of every rollout batch
        the step drew (dynamic sampling), for the rollout throughput; default ``roll``'s;
        ``extra_s``: the time dynamic sampling's extra draws took to sample (not to score:
        ``dynamic/extra_s`` holds both), which async adds to the engine's."""
        mask = batch.response_mask
        gap = None
        if old.recomputed is not None:  # the trainer's π_old against the engine's log-probs
            gap = ((old.recomputed - old.rollout) * mask).sum(1) / mask.sum(1).clamp(min=1)
        padded = {"response_mask": mask, "attention_mask": batch.attention_mask}
        if self.dist.enabled and roll.model_mask is not None:  # every rank's episodes
            # trained on: not dynamic sampling's stand-ins, as one process, which has none
            own = self._own_stand_ins(roll)
            mine = roll.model_mask if own is None else [
                m for m, stand_in in zip(roll.model_mask, own.tolist()) if not stand_in]
            masks = [m for part in self.dist.gather_objects(mine) for m in part]
            roll.extras.update(episode_metrics(masks))
        if self.async_rollout is not None:
            gap = None if old.behaviour is None else (  # the engine's own mismatch
                ((old.behaviour - old.rollout) * mask).sum(1) / mask.sum(1).clamp(min=1))
            roll.extras.update(drift_metrics(old.rollout, old.behaviour, old.recomputed, mask,
                                             self.dist))
            # each rank's engine sampled its own share: the slowest one's time
            roll.extras.update(max_over_ranks({k: roll.extras[k] for k in ENGINE_TIMES
                                               if k in roll.extras}, self.dist))
        seconds = timer.seconds
        if self.async_rollout is not None and "time/rollout_engine_s" in roll.extras:
            # time/rollout_s is the trainer's wait for a batch sampled while it trained: the
            # throughput divides by the time the tokens took, the engine's (and extra draws')
            seconds = {**seconds, "rollout": roll.extras["time/rollout_engine_s"] + extra_s}
        return {
            **roll.extras,
            **{k: float(v) for k, v in group_stats(rewards, roll.group_size).items()},
            **mean_stats(result.stats, stat_kinds(self.objective, self.hooks), result.counts),
            **self.hooks.step_metrics(result.stats, result.counts),
            **rollout_metrics(roll, padded, old.entropy, gap, seconds,
                              self.cfg.objective.epochs, self.dist,
                              sampled_tokens=sampled_tokens,
                              stand_ins=self._own_stand_ins(roll)),
            **old.routing_metrics,
            **roll.extras,
            **result.diagnostics,
            # engine mismatch at the same weights: async compares the engine with the
            # trainer's pass on the behaviour weights (staleness is async/staleness_drift_*)
            **(mismatch_metrics(old.rollout, old.recomputed, old.after, mask, self.dist)
               if self.async_rollout is None else
               mismatch_metrics(old.rollout, old.behaviour,
                                old.after if old.recomputed is not None else None, mask,
                                self.dist, before=old.recomputed)),
            "train/skipped_updates": result.skipped,
            # minibatches with every response masked: no optimizer step (not a fault)
            "train/empty_minibatches": result.empty,
            # the mean rate the step's updates ran at (the scheduler has moved on since)
            "train/lr": sum(result.lrs) / len(result.lrs) if result.lrs
            else self.scheduler.get_last_lr()[0],
            **timer.metrics(),
            **gpu_memory_metrics(self.dist.device),
        }

    def train_step(self) -> dict[str, float]:
        """One RL step, phase by phase; its metrics."""
        timer = PhaseTimer(self.dist.device)
        self.engine_current = self.async_rollout is None  # async: synced on its first use
        published = self.publish(timer)
        with timer("rollout"):
            examples, roll = self.rollout()
        lending = self.async_rollout.lending if self.async_rollout is not None else None
        with (at_layer_boundaries(self.async_rollout.poll_threads) if lending is not None
              else contextlib.nullcontext()):
            metrics = self._learn(timer, examples, roll)
        if lending is not None:
            metrics["async/lent_threads_s"] = lending.take_lent_s()
        return {**published, **metrics}

    def publish(self, timer: PhaseTimer) -> dict[str, float]:
        """Async: the weights the trainer holds now, as policy version ``step``, for the
        batches of ``step + k`` on (once a version; the first by the pipeline's start). They
        are published here, when they are used, rather than after the update that made them:
        a guard rollback in between replaces them, so weights it discards are never sampled
        from. Its metrics (``time/publish_send_s`` to engines started elsewhere)."""
        if self.async_rollout is None or self.async_rollout.published >= self.step:
            return {}
        self.async_rollout.poll_threads()
        with timer("weight_sync"), self.dist.full_weights(self.model):
            self.async_rollout.publish(self.model, self.step)
        return max_over_ranks(self.async_rollout.publish_metrics(), self.dist)

    def _learn(self, timer: PhaseTimer, examples: list[Any], roll: Rollout
               ) -> dict[str, float]:
        """The step after its rollout: rewards, π_old, the update, the engine synced (the
        synchronous loop; async publishes at the next step's start, :meth:`publish`)."""
        with timer("reward"):
            rewards, parts = self.score_rows(examples, roll)  # the global batch's
        sampling: dict[str, float] = {}
        self.stand_ins = None
        before = timer.seconds.get("rollout", 0.0)
        if self.cfg.rollout.dynamic_sampling:  # DAPO: drop zero-variance groups, draw more
            examples, roll, rewards, sampling, parts = self.refill(examples, roll, rewards,
                                                                   timer, parts)
        # the extra draws' sampling time (dynamic/extra_s also holds their scoring)
        extra_rollout_s = timer.seconds.get("rollout", 0.0) - before
        # over the groups trained on, as reward/mean (torchrun: not dynamic sampling's
        # stand-ins, see refill)
        counted = torch.ones(len(rewards), dtype=torch.bool) if self.stand_ins is None \
            else ~self.stand_ins
        reward_metrics = reward_part_metrics({k: v[counted] for k, v in parts.items()})
        with timer("reward"):
            adv = self.advantages(rewards, roll)
        with timer("old_logprobs"):
            plan = self.plan(roll, rows=len(rewards))
            batch, old = self.update_batch(roll, adv, plan)
        with timer("update"):
            result = self.update(batch, plan)
        old.take_first_minibatch(result)
        every = self.cfg.logging.drift_every
        if every > 0 and self.step % every == 0:  # π_θ after the update: the policy drift
            with timer("drift"):
                old.after = self.old_logprobs({"input_ids": batch.input_ids,
                                               "attention_mask": batch.attention_mask,
                                               "response_mask": batch.response_mask})[0]
        if self.async_rollout is None and not self.engine.capabilities.shares_policy_weights:
            with timer("weight_sync"):
                self.sync()
        return {**reward_metrics, **sampling,
                **self.step_metrics(rewards[counted], roll, batch, old, result, timer,
                                    sampled_tokens=sampling.get(
                                        "dynamic/response_tokens_sampled"),
                                    extra_s=extra_rollout_s)}

    def refill(self, examples: list[Any], roll: Rollout, rewards: torch.Tensor,
               timer: PhaseTimer, parts: dict[str, torch.Tensor] | None = None
               ) -> tuple[list[Any], Rollout, torch.Tensor, dict[str, float],
                          dict[str, torch.Tensor]]:
        """Dynamic sampling (see gspo.trainer.dynamic_sampling): the groups with reward
        variance of this draw and of further draws, what the further draws cost, and each
        reward function's values of the groups kept (``parts``: this draw's, see
        :meth:`score_rows`)."""
        def draw(d: int) -> Draw:
            with timer("rollout"):
                ex, r = self.rollout(draw=d)
            with timer("reward"):
                return self._global_draw(ex, r, *self.score_rows(ex, r))

        cfg = self.cfg.rollout
        first = self._global_draw(examples, roll, rewards, parts or {})
        # every minibatch needs one row; under torchrun every rank one group: those only it
        # needs are stand-ins (zero loss weight, out of the metrics), as one process has none
        min_rows = max(self.cfg.objective.num_minibatches, roll.group_size)
        got = collect(first, draw, prompts_per_step=cfg.prompts_per_step,
                      max_extra_batches=cfg.dynamic_max_extra_batches, min_rows=min_rows,
                      min_groups=self.dist.world_size)
        if got.stand_ins:
            self.stand_ins = torch.zeros(len(got.rewards), dtype=torch.bool)
            for j in got.stand_ins:
                self.stand_ins[j * roll.group_size:(j + 1) * roll.group_size] = True
        if got.roll is first.roll:  # the first draw, every group kept: the rows as they were
            self._sample_rows(first.examples, first.roll, first.rewards, got.parts)
            return examples, roll, rewards, got.metrics, got.parts
        joined, kept = got.roll, got.examples
        self._sample_rows(kept, joined, got.rewards, got.parts)
        if self.async_rollout is not None:
            # rows of this step's weights joined the pipeline's: staleness over the rows kept
            # (all ranks', not the stand-ins; the joined rows' episode metrics, recomputed for
            # them, stay)
            versions = joined.versions if self.stand_ins is None else [
                v for v, stand_in in zip(joined.versions, self.stand_ins.tolist())
                if not stand_in]
            lag = staleness_metrics(self.step, versions, self.cfg.rollout.async_steps)
            joined.extras = {**roll.extras, **lag, **joined.extras}
        if self.dist.enabled:  # every rank chose the same groups: this rank's share of them
            g, extras = roll.group_size, joined.extras
            lo, hi = self.dist.shard(len(kept))
            joined, kept = joined.select(list(range(lo * g, hi * g))), kept[lo:hi]
            joined.extras = extras
        if self.async_rollout is not None:
            with timer("old_logprobs"):
                self._behaviour_pass(joined)
        return kept, joined, got.rewards, got.metrics, got.parts

    def _sample_rows(self, examples: list[Any], roll: Rollout, rewards: torch.Tensor,
                     parts: dict[str, torch.Tensor]) -> None:
        """The samples file's rows of a step whose batch dynamic sampling joined from several
        draws: the groups trained on (each draw's scoring left its own rows there, so the
        last draw's, groups that may have been dropped); not the stand-ins (torchrun), as one
        process, which has none, writes them."""
        g = roll.group_size
        groups = [j for j in range(len(examples))
                  if self.stand_ins is None or not self.stand_ins[j * g]]
        rows = [j * g + i for j in groups for i in range(g)]
        self.last_samples = (
            [examples[j].prompt for j in groups for _ in range(g)],
            self.tokenizer.batch_decode([roll.response_ids[i] for i in rows],
                                        skip_special_tokens=True),
            rewards[rows].tolist(), {k: v[rows].tolist() for k, v in parts.items()},
            [examples[j].answer for j in groups for _ in range(g)])
        self.last_samples_local = False  # every rank's groups (the draws were gathered)

    def _global_draw(self, examples: list[Any], roll: Rollout, rewards: torch.Tensor,
                     parts: dict[str, torch.Tensor] | None = None) -> Draw:
        """A scored draw as dynamic sampling sees it: under torchrun every rank's examples and
        rows in prompt order (``rewards`` and ``parts`` already are the global batch's), so
        that all ranks keep the same groups, those one process would keep; else this
        process's own."""
        if not self.dist.enabled:
            return Draw(examples, roll, rewards, parts or {})
        shares = self.dist.gather_objects((examples, roll))
        return Draw([ex for share, _ in shares for ex in share],
                    concat_rollouts([r for _, r in shares]), rewards, parts or {})

    def _behaviour_pass(self, roll: Rollout, *, whole: bool = False) -> None:
        """The trainer's log-prob pass on the behaviour weights for the rows of an extra draw:
        this step's weights, so the pass the engine process runs on the pipeline's rows
        (:func:`gspo.rollout.async_engine.trainer_pass`), run here. On the rows kept (their
        ``trainer_logprobs`` None), or with ``whole`` on the whole draw, also recording its
        experts (an MoE policy: they join the batch in the draw's own layout) and under R3
        its log-probs under the replayed experts (``Rollout.replayed_logprobs``)."""
        was_training = self.model.training
        self.model.eval()
        # FSDP2: the ranks' passes differ in rows, so no per-layer all-gathers (every rank
        # comes here on the same steps: the draws and the groups kept are the same on all)
        try:
            with self.dist.full_weights(self.model):
                if whole:
                    rows, roll.trainer_routing, replayed = trainer_pass(
                        self.model, roll, self.async_rollout.recompute)
                    roll.trainer_logprobs = [torch.tensor(lp, dtype=torch.float32) for lp in rows]
                    roll.replayed_logprobs = (None if replayed is None else [
                        torch.tensor(lp, dtype=torch.float32) for lp in replayed])
                    return
                lps = roll.trainer_logprobs
                todo = [] if lps is None else [i for i, lp in enumerate(lps) if lp is None]
                if todo:
                    rows, _, _ = trainer_pass(self.model, roll.select(todo),
                                              self.async_rollout.recompute)
                    for i, lp in zip(todo, rows):
                        lps[i] = torch.tensor(lp, dtype=torch.float32)
        finally:
            self.model.train(was_training)

    # ------------------------------------------------------------------ the loop
    def evaluate(self) -> dict[str, float]:
        # the task's rewards: the overlong term penalises the sampling budget, not the answer
        return evaluate(self.model, self.tokenizer, self.task.eval_examples,
                        without_overlong(self.scorer),
                        chat_template=self.cfg.task.chat_template,
                        system_prompt=self.cfg.task.system_prompt,
                        max_new_tokens=self.cfg.rollout.eval_max_new_tokens, eos=self.eos,
                        pad_id=self.pad_id, fast_decode=self.cfg.rollout.fast_decode,
                        decode_matmul=self.cfg.rollout.decode_matmul,
                        turns=self.turns)

    def train(self) -> dict[str, Any]:
        """Run to ``cfg.steps``, evaluate, checkpoint; returns the before/after evaluation.

        The first SIGINT/SIGTERM finishes the current step, checkpoints and returns with
        ``interrupted`` set; a second abandons the step (``KeyboardInterrupt``). The guard
        (``cfg.guard``) may roll back, lower the lr, or raise
        :class:`gspo.trainer.guard.GuardStop` after checkpointing.
        """
        try:
            with GracefulStop() as stop:
                try:
                    return self._train(stop)
                except KeyboardInterrupt:
                    self._abandoned()
                    raise
        finally:
            self.logger.close()

    def _train(self, stop: GracefulStop) -> dict[str, Any]:
        cfg = self.cfg
        if (self.step == 0 and cfg.eval_before and self.task.eval_examples
                and self.baseline_eval is None):
            failures = dict(self.scorer.failures)
            self.baseline_eval = self.evaluate()
            self.reliability.report_reward_errors(0, self.scorer.first_errors,
                                                  self.dist)
            broken = self.scorer.failed_on_all(failures, len(self.task.eval_examples))
            if broken:  # a reward that cannot score anything: say why now, not after a step
                raise RewardError(f"every held-out response was unscorable before training "
                                  f"(reward {broken})")
            self.logger.log(0, {f"eval/{k}": v for k, v in self.baseline_eval.items()})
            if self.dist.is_main:
                print(f"held-out before training: accuracy {self.baseline_eval['accuracy']:.1%} "
                      f"on {len(self.task.eval_examples)} problems", flush=True)
        if cfg.save_every and self.saved_step is None:
            self.save_checkpoint()  # step 0: resumable, and a rollback target, from the start
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train",
                   disable=not cfg.progress or not self.dist.is_main, dynamic_ncols=True)
        stopping = self._stopping(stop)
        while self.step < cfg.steps and not stopping:
            self._step(bar)
            stopping = self._stopping(stop)
        bar.close()
        if stopping:
            return self._interrupted()
        return self._finish()

    def _stopping(self, stop: GracefulStop) -> bool:
        """Whether a SIGINT/SIGTERM reached any process: under torchrun every rank takes the
        same branch (a signal may reach only one rank, or the ranks at different points of a
        step; a rank that stopped alone would leave the others waiting in a collective)."""
        asked = stop.requested is not None
        if not self.dist.enabled:
            return asked
        return bool(self.dist.all_reduce(torch.tensor([float(asked)]), "max").item())

    def _step(self, bar: Any) -> None:
        """One step of the loop: train_step, then the guard, logging and checkpointing."""
        cfg = self.cfg
        failures = dict(self.scorer.failures)
        agreed = False  # whether every rank comes to the report below (collectives there)
        try:
            metrics = self.train_step()
            agreed = True
        except RewardError:  # too many unscorable responses: every rank raises it alike
            agreed = True
            raise
        finally:  # also when the step raises
            self.reliability.report_reward_errors(self.step + 1, self.scorer.first_errors,
                                                  self.dist, agreed=agreed)
        self.step += 1
        self.final_eval = None
        # each rank scored its own rows: the step's failures are the sum over ranks
        new = torch.tensor([float(self.scorer.failures.get(n, 0) - failures.get(n, 0))
                            for n in self.scorer.names], dtype=torch.float64)
        metrics.update({f"reward/failures/{n}": v for n, v in
                        zip(self.scorer.names, self.dist.all_reduce(new).tolist())})
        guard = self.reliability.guard
        reason = guard.observe(metrics)
        stop_reason = (self.reliability.respond(reason, self.step, self.model, self.optimizer,
                                                self.scheduler, self.dist) if reason else None)
        if reason and stop_reason is None:  # rolled back (restored_step is set)
            metrics.update(self.rolled_back(int(self.reliability.restored_step)))
        metrics.update(guard.metrics())
        warning = self.zero_signal.observe(metrics)
        if warning and self.dist.is_main:
            tqdm.write(warning)
        if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
            metrics.update({f"eval/{k}": v for k, v in self.evaluate().items()})
            self.reliability.report_reward_errors(self.step, self.scorer.first_errors,
                                                  self.dist)  # the evaluation's own
        self.logger.log(self.step, metrics)
        if (cfg.logging.samples_every and self.step % cfg.logging.samples_every == 0
                and self.last_samples is not None):  # the same on every rank
            self._write_samples(limit=2 * cfg.rollout.group_size)
        self.history.append({k: metrics[k] for k in ("reward/mean",) if k in metrics})
        bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}",
                        clip=f"{metrics.get('objective/clip_frac_tokens', 0):.3f}")
        bar.update(1)
        if stop_reason:
            self._guard_stop(stop_reason)
        if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps:
            self.save_checkpoint()

    def _write_samples(self, limit: int) -> None:
        """Append the first ``limit`` rows of the last scored batch to the samples file, as one
        process writes them. Under torchrun each rank scored its own share of the groups
        (:meth:`score_rows`): the ranks' first rows are gathered in rank (prompt) order, so
        that rank 0 writes the global batch's first rows, not its own share's (one group when
        ``prompts_per_step`` is the number of ranks). A collective: every rank calls it."""
        samples = self.last_samples
        if self.last_samples_local:
            p, c, r, f, a = samples
            shares = self.dist.gather_objects((p[:limit], c[:limit], r[:limit],
                                               {k: v[:limit] for k, v in f.items()}, a[:limit]))
            samples = ([x for s in shares for x in s[0]], [x for s in shares for x in s[1]],
                       [x for s in shares for x in s[2]],
                       {k: [x for s in shares for x in s[3][k]] for k in f},
                       [x for s in shares for x in s[4]])
        if self.dist.is_main:
            p, c, r, f, a = samples
            write_samples(self.run_dir, self.step, p, c, r, answers=a, per_fn=f, limit=limit)

    def rolled_back(self, restored: int) -> dict[str, float]:
        """After the guard put back the weights of step ``restored``: nothing samples from the
        weights it discarded. An engine with a copy of its own (bf16, vLLM, llama.cpp) takes
        the restored ones now. Async: they are published as this step's version, and the
        batches asked for from versions newer than ``restored`` are sampled again from them,
        with the same prompts and seeds (``guard/resampled_batches``)."""
        if self.async_rollout is None:
            if not self.engine.capabilities.shares_policy_weights:
                self.sync()
            return {}
        with self.dist.full_weights(self.model):
            again = self.async_rollout.rolled_back(
                self.model, version=self.step, kept=restored, request_for=self._request_for)
        return {"guard/resampled_batches": float(again)}

    def _finish(self) -> dict[str, Any]:
        if self.final_eval is None:  # else restored with the final checkpoint: already logged
            self.final_eval = self.evaluate() if self.task.eval_examples else {}
            self.reliability.report_reward_errors(self.step, self.scorer.first_errors,
                                                  self.dist)
            if self.final_eval:
                self.logger.log(self.step, {f"eval/{k}": v for k, v in self.final_eval.items()})
            if self.cfg.save_final:
                self.save_checkpoint()
        elif self.dist.is_main:  # the final checkpoint's write may have been killed before it
            # pruned the older ones
            prune_checkpoints(self.run_dir / "checkpoints", self.cfg.keep_checkpoints,
                              self._protected())
        result = {"steps": self.step, "before": self.baseline_eval, "after": self.final_eval,
                  "run_dir": str(self.run_dir)}
        if self.dist.is_main:
            atomic_write_text(self.run_dir / "final_eval.json", json.dumps(result, indent=2))
        return result

    def _guard_stop(self, reason: str) -> None:
        if self.saved_step != self.step:
            self.save_checkpoint()
        raise GuardStop(f"guard stopped the run at step {self.step}: {reason}; state saved in "
                        f"{self.run_dir}/checkpoints/step_{self.step:06d}, metrics in "
                        f"{self.run_dir}/metrics.jsonl")

    def _interrupted(self) -> dict[str, Any]:
        if self.saved_step != self.step:
            self.save_checkpoint()
        print(f"interrupted at step {self.step}; resume with: gspo train resume={self.run_dir}",
              flush=True)
        return {"steps": self.step, "before": self.baseline_eval, "after": {},
                "run_dir": str(self.run_dir), "interrupted": True}

    def _abandoned(self) -> None:
        ckpt = latest_checkpoint(self.run_dir / "checkpoints")
        where = (f"resume from {ckpt.name} with: gspo train resume={self.run_dir}" if ckpt
                 else "no checkpoint yet: start the run again")
        print(f"interrupted again after step {self.step}: work in progress abandoned; {where}",
              flush=True)

    def cleanup(self, *, barrier: bool = True) -> None:
        """Release the engine, the logs, the policy and (under torchrun) the process group.
        ``barrier=False`` after an error: the other ranks may be waiting in a collective."""
        if self.engine is not None:
            self.engine.close()
        if self.scorer is not None:  # reward.isolate=process: stop the reward processes
            self.scorer.close()
        if self.async_rollout is not None:
            self.async_rollout.close()
        if self.logger is not None:
            self.logger.close()
        # FSDP2 can abort at exit when the policy and optimizer outlive the process group.
        self.async_rollout = None
        self.engine = self.model = self.ref_model = self.optimizer = self.scheduler = None
        distributed.shutdown(barrier=barrier)

    def resolved_config(self) -> dict[str, Any]:
        return dataclasses.asdict(self.cfg)
