"""The checks :meth:`gspo.trainer.Trainer.setup` makes once the policy and the loop are known,
as functions of the facts they read (MoE or dense, the engine-process pipeline or the
synchronous loop, a held-out set or none), so that ``gspo validate`` makes the same ones
where it can tell those facts without loading anything: from the config, the model's
``config.json`` (:func:`gspo.models.loading.model_skeleton`) and the registries
(:func:`check_before_loading`).
"""

from __future__ import annotations

from pathlib import Path

from gspo.config import ConfigError, LoggingConfig, RolloutConfig, TrainConfig
from gspo.rollout import EngineOptions, engine_capabilities
from gspo.trainer.checkpoint import latest_checkpoint

NOT_CHECKED = ("not checked before loading: what needs the model's weights and tokenizer "
               "(compile_layers, matmul, reward.overlong_buffer, moe.router_lr_scale with "
               "lora), the task's rows, the launch (device, torchrun, rollout.async_address "
               "hosts, the engine's package), a resumed checkpoint's contents")
"""The line ``gspo validate`` prints after its checks: what only ``gspo train`` checks."""


def engine_options(cfg: TrainConfig) -> EngineOptions:
    """What the rollout engine is started with (and declares its capabilities for)."""
    return EngineOptions(dtype=cfg.dtype, precision=cfg.rollout.precision, seed=cfg.seed,
                         record_routing=cfg.moe.routing_replay == "r3",
                         fast_decode=cfg.rollout.fast_decode,
                         decode_matmul=cfg.rollout.decode_matmul,
                         memory_fraction=cfg.rollout.vllm_memory_fraction)


def old_is_current(cfg: TrainConfig, *, pipeline: bool) -> bool:
    """Whether the loss's π_old is the trainer's pass on this step's weights: with
    ``old_logprobs=recompute`` in the synchronous loop (``pipeline``: the engine-process
    pipeline, whose behaviour weights are older), and always with ``decoupled``."""
    o = cfg.objective.old_logprobs
    return o == "decoupled" or (o == "recompute" and not pipeline)


def behaviour_routing(cfg: TrainConfig, *, moe: bool, engine_process: bool) -> bool:
    """Whether π_old's expert choices are the behaviour policy's, recorded by the engine
    process's pass (see :meth:`gspo.trainer.Trainer._behaviour_routing`)."""
    return moe and engine_process and cfg.objective.old_logprobs != "decoupled"


def recompute_old_always(cfg: TrainConfig, *, moe: bool, pipeline: bool,
                         behaviour: bool) -> bool:
    """Whether every step runs the trainer's π_old pass (``behaviour``: see
    :func:`behaviour_routing`)."""
    return old_is_current(cfg, pipeline=pipeline) or (moe and not behaviour)


def check_compile(cfg: TrainConfig, *, moe: bool) -> None:
    """``compile_layers=true`` on an MoE policy (``moe``: its routers are hooked): a
    :class:`ConfigError`."""
    if cfg.compile_layers and moe:
        raise ConfigError("compile_layers=true compiles dense decoder layers; this policy "
                          "has Mixture-of-Experts layers (their routing hooks and expert "
                          "dispatch stay eager): set compile_layers=false")


def check_unused_options(cfg: TrainConfig, *, moe: bool, pipeline: bool,
                         recompute_always: bool, has_eval: bool | None) -> None:
    """Options this run would not read, once the policy (``moe``: its routers are hooked),
    the loop (``pipeline``: the engine-process pipeline, else the synchronous loop;
    ``recompute_always``: :func:`recompute_old_always`) and the task (``has_eval``: whether it
    holds out problems; None: not known, not checked) are known: a :class:`ConfigError`."""
    every = cfg.logging.rollout_check_every
    current = old_is_current(cfg, pipeline=pipeline)
    if not pipeline and every != LoggingConfig.rollout_check_every and (current or moe):
        why = ("an MoE policy's routing" if moe and not current
               else f"objective.old_logprobs={cfg.objective.old_logprobs}")
        raise ConfigError(f"logging.rollout_check_every={every}: this run recomputes π_old "
                          f"on every step ({why}), so it is unused; it applies to "
                          "objective.old_logprobs=rollout and to rollout.async_steps > 0")
    floor = cfg.guard.collapse_entropy_floor
    if floor and not (recompute_always or every or cfg.logging.drift_every):
        raise ConfigError(f"guard.collapse_entropy_floor={floor}: train/entropy comes from "
                          "the trainer's π_old pass, which this run never runs "
                          f"(objective.old_logprobs={cfg.objective.old_logprobs}, "
                          f"rollout.async_steps={cfg.rollout.async_steps}, "
                          "logging.rollout_check_every=0, logging.drift_every=0); set "
                          "logging.rollout_check_every > 0")
    if has_eval is False:
        # evaluation decodes with gspo's own sampler whatever rollout.engine samples with
        own = [] if cfg.rollout.engine == "hf" else [
            ("rollout.fast_decode", cfg.rollout.fast_decode, RolloutConfig.fast_decode),
            ("rollout.decode_matmul", cfg.rollout.decode_matmul, RolloutConfig.decode_matmul)]
        for key, value, default in (
                ("eval_every", cfg.eval_every, TrainConfig.eval_every),
                ("rollout.eval_max_new_tokens", cfg.rollout.eval_max_new_tokens,
                 RolloutConfig.eval_max_new_tokens), *own):
            if value != default:
                why = (f" (rollout.engine={cfg.rollout.engine} samples the rollouts; gspo's "
                       "own sampler decodes only evaluation)" if key.endswith("_decode")
                       or key.endswith("matmul") else "")
                raise ConfigError(f"{key}={value}: there is no held-out set to evaluate "
                                  f"(task.eval_size=0, or no eval rows){why}")


def check_engine_share(cfg: TrainConfig, world: int) -> None:
    """``rollout.async_engines`` engines per trainer process (``world`` of them) each need a
    prompt of the process's share: a :class:`ConfigError` else."""
    n = cfg.rollout.async_engines
    if n > 1 and cfg.rollout.prompts_per_step // world < n:
        raise ConfigError(f"rollout.async_engines={n}: each engine needs a prompt, but a "
                          f"trainer process has {cfg.rollout.prompts_per_step // world} "
                          "(rollout.prompts_per_step / processes)")


def resume_checkpoint(resume: str) -> Path | None:
    """The checkpoint ``resume=RUN`` continues from (None without ``resume``); a run folder
    with no complete checkpoint is a :class:`FileNotFoundError`."""
    if not resume:
        return None
    ckpt = latest_checkpoint(Path(resume) / "checkpoints")
    if ckpt is None:
        raise FileNotFoundError(f"resume: no complete checkpoint in {resume}")
    return ckpt


def check_resumed_model(cfg: TrainConfig) -> None:
    """``resume=RUN`` with a ``model`` other than the run's own (``RUN/config.yaml``) is a
    :class:`ConfigError`: the resumed policy is the checkpoint's, so the other model would be
    silently unused, or become the KL reference (``objective.beta``) or the LoRA base of a
    run that trained against another. So is turning LoRA on or off (``lora.r``): the
    checkpoint holds an adapter or full weights, not the other."""
    if not cfg.resume:
        return
    saved = Path(cfg.resume) / "config.yaml"
    if not saved.is_file():
        return
    import yaml

    ran_cfg = yaml.safe_load(saved.read_text()) or {}
    ran_lora = int((ran_cfg.get("lora") or {}).get("r", 0) or 0)
    if (ran_lora > 0) != (cfg.lora.r > 0):
        kind = f"a LoRA adapter (lora.r={ran_lora})" if ran_lora else "its full weights (lora.r=0)"
        raise ConfigError(f"lora.r={cfg.lora.r}: resume={cfg.resume} continues a run that "
                          f"trained {kind}, so its checkpoint holds that; resume with the run's "
                          "own lora.r")
    ran = ran_cfg.get("model")
    if ran is None or ran == cfg.model or _same_folder(str(ran), cfg.model):
        return
    raise ConfigError(f"model={cfg.model}: resume={cfg.resume} continues its run, whose model "
                      f"is {ran} (its checkpoint's weights, LoRA base and KL reference); leave "
                      "model out (where that model moved, edit model in the run's config.yaml)")


def _same_folder(a: str, b: str) -> bool:
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.is_dir() and pb.is_dir() and pa.resolve() == pb.resolve()


def new_run_folder(cfg: TrainConfig, name: str) -> Path:
    """The folder of a new run called ``name`` under ``output_dir``; one that already holds a
    run is a :class:`FileExistsError` (resume it, or pick another name)."""
    run_dir = Path(cfg.output_dir) / name
    if (run_dir / "metrics.jsonl").exists():
        raise FileExistsError(f"run folder {run_dir} already holds a run; "
                              f"pick another run_name or resume={run_dir}")
    return run_dir


def check_before_loading(cfg: TrainConfig) -> list[str]:
    """The setup checks of :class:`gspo.trainer.Trainer` that need no weights, rows or launch,
    run by the functions setup runs: ``resume``, the reward functions, ``task.name``,
    ``rollout.env``, and on the model's architecture (its config, on the meta device) the MoE
    options, ``lora.target_modules`` and the options the loop would not read. Returns what it
    could not decide (one phrase each), besides :data:`NOT_CHECKED`."""
    from gspo.data import held_out_kind, task_builder
    from gspo.models.loading import model_skeleton
    from gspo.models.lora import check_lora
    from gspo.rewards import RewardScorer
    from gspo.rollout.multiturn import TurnLoop
    from gspo.trainer.moe_hooks import policy_hooks

    resume_checkpoint(cfg.resume)
    check_resumed_model(cfg)
    RewardScorer.from_specs(cfg.reward.functions, cfg.reward.weights)
    task_builder(cfg.task)
    TurnLoop.from_config(cfg.rollout, cfg.task, None)
    model = model_skeleton(cfg.model)
    if model is None:
        return [f"the options that depend on the model's architecture (model={cfg.model} "
                "is known only once built or converted)"]
    caps = engine_capabilities(cfg.rollout.engine, engine_options(cfg))
    moe = policy_hooks(model, cfg.moe, caps, engine=cfg.rollout.engine, name=cfg.model).active
    check_compile(cfg, moe=moe)
    if cfg.lora.r and not cfg.resume:  # a resumed adapter keeps its own
        check_lora(model, cfg.lora)
    k = cfg.rollout.async_steps
    if k > 0:
        check_engine_share(cfg, world=1)  # fewer prompts than engines: on any number of ranks
    # the pipeline runs at k > 0, and at k = 0 for an engine that runs in one process only
    # under torchrun (vLLM), which a config cannot tell from one process
    launches = [k > 0] if k > 0 or caps.per_rank else [False, True]
    has_eval = False if held_out_kind(cfg.task) == "none" else None
    errors: list[ConfigError] = []
    for pipeline in launches:
        behaviour = behaviour_routing(cfg, moe=moe, engine_process=pipeline)
        try:
            check_unused_options(cfg, moe=moe, pipeline=pipeline, has_eval=has_eval,
                                 recompute_always=recompute_old_always(
                                     cfg, moe=moe, pipeline=pipeline, behaviour=behaviour))
        except ConfigError as e:
            errors.append(e)
    if len(errors) == len(launches):
        raise errors[0]
    return [f"{errors[0]} (in one process; under torchrun, where rollout.engine="
            f"{cfg.rollout.engine} samples in an engine process, it is read)"] if errors else []
