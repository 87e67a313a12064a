"""Several processes (gloo, CPU) compute the same update as one: DDP and FSDP2, GSPO and GRPO,
dense and MoE; sampling does not depend on how prompts are split; ranks exit cleanly."""

from __future__ import annotations

import copy
import json
import os
import sys
import textwrap
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from proc_session import run_session

from gspo.config import ObjectiveConfig, TrainConfig, load_config
from gspo.models import load_model
from gspo.rollout import SamplingParams, generate
from gspo.trainer.distributed import Dist, full_model_state, prepare, save_sharded, wrap
from gspo.trainer.update import UpdateBatch, policy_update

REPO = Path(__file__).resolve().parents[2]
WORLD = 2
G, B = 2, 4  # 8 rows: 4 on each rank
ALL = [(s, o, m) for m in ("tiny:llama", "tiny:qwen3_moe") for s in ("ddp", "fsdp2")
       for o in ("gspo", "grpo")]
FAST = [("ddp", "gspo", "tiny:llama"), ("fsdp2", "grpo", "tiny:qwen3_moe")]
MB_SEED = 3  # a permutation where one minibatch holds rows of rank 0 only (checked below)


# No port is picked by the test: asking the OS for a free port and closing it leaves a window
# in which another process can take it. The spawned ranks meet through a file in tmp_path;
# torchrun's --standalone binds a free port itself. A hung collective fails after TIMEOUT
# instead of holding the lane.
TIMEOUT = timedelta(minutes=5)


def _objective(name: str) -> ObjectiveConfig:
    eps = (3e-4, 4e-4) if name == "gspo" else (0.2, 0.27)
    return ObjectiveConfig(name=name, eps_low=eps[0], eps_high=eps[1], num_minibatches=4,
                           epochs=2)


def _rollout_batch(model: torch.nn.Module, seed: int) -> UpdateBatch:
    """B×G rows of random prompts and responses of different lengths, right-padded; old
    log-probs are the policy's plus noise, so ratios differ from 1 and clipping acts."""
    from gspo.models import token_logprobs
    from gspo.rollout import pad_batch

    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(B):
        p = torch.randint(3, 250, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g)
        for _ in range(G):
            n = int(torch.randint(1, 6, (1,), generator=g))
            prompts.append(p.tolist())
            responses.append(torch.randint(3, 250, (n,), generator=g).tolist())
    batch = pad_batch(prompts, responses, pad_id=0)
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"],
                               batch["response_mask"])
    old = (lp + 0.02 * torch.randn(lp.shape, generator=g)) * batch["response_mask"]
    adv = torch.randn(B * G, generator=g)
    adv[:G] = 0.0  # a group without signal: the signal_* stats must leave it out on every rank
    return UpdateBatch(batch["input_ids"], batch["attention_mask"], batch["response_mask"], old,
                       adv)


def _update(model, batch, objective, dist=None):
    # lr 1e-4: AdamW turns fp32 reduction-order noise in a gradient into ~lr × noise in the
    # update; 8 steps then move weights by up to ~1e-3 and the two runs agree to ~1e-7.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    from gspo.config import MoEConfig
    from gspo.objectives import objective_from_config
    from gspo.trainer.metrics import mean_stats
    from gspo.trainer.moe_hooks import NO_MOE, MoEHooks
    from gspo.trainer.update import UPDATE_STAT_KINDS, plan_update

    hooks = MoEHooks(model, MoEConfig()) if "moe" in type(model).__name__.lower() else NO_MOE
    plan = plan_update(B * G, num_minibatches=objective.num_minibatches, epochs=objective.epochs,
                       generator=torch.Generator().manual_seed(MB_SEED))
    result = policy_update(model, opt, sched, batch, plan,
                           objective=objective_from_config(objective), temperature=1.0, chunk=7,
                           grad_clip=1.0, hooks=hooks, dist=dist)
    assert result.skipped == 0
    kinds = {**objective_from_config(objective).stat_kinds, **UPDATE_STAT_KINDS,
             **hooks.stat_kinds}
    return opt, [*result.stats, mean_stats(result.stats, kinds, result.counts)]  # + the step's


def _rows(batch: UpdateBatch, lo: int, hi: int) -> UpdateBatch:
    return batch.rows(torch.arange(lo, hi))


def _worker(rank: int, out_dir: str, combos: list) -> None:
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                             world_size=WORLD, timeout=TIMEOUT)
    results = {}
    # The sharded checkpoint of the first FSDP2 combination: decided from ``combos``, the same
    # on every rank. Not from whether the folder exists: one rank's dcp.save creates it before
    # its first collective, so a rank that looked later skipped the save and waited in another
    # collective than its peer's (a spawn error in _save_state_dict when rank 0 ran behind).
    save_at = next((i for i, c in enumerate(combos) if c[0] == "fsdp2"), None)
    for i, (strategy, obj_name, model_name) in enumerate(combos):
        objective = _objective(obj_name)
        model, _ = load_model(model_name, seed=0)
        batch = _rollout_batch(model, seed=1)
        single = copy.deepcopy(model)
        _, want_stats = _update(single, batch, objective)  # the same step in one process
        d = Dist(rank=rank, world_size=WORLD, strategy=strategy)
        d.engine = wrap(model, d)
        lo, hi = d.shard(B)
        opt, stats = _update(model, _rows(batch, lo * G, hi * G), objective, dist=d)
        full = full_model_state(model, d) or model.state_dict()  # FSDP2: rank 0's is full
        if rank == 0:
            want = single.state_dict()
            err = max(float((full[k].float() - want[k].float()).abs().max()) for k in want)
            moved = max(float((full[k].float() - v.float()).abs().max())
                        for k, v in load_model(model_name, seed=0)[0].state_dict().items())
            stat_err = max(abs(float(s[k]) - float(w[k])) for s, w in zip(stats, want_stats)
                           for k in w)
            results[f"{strategy}-{obj_name}-{model_name}"] = {"err": err, "moved": moved,
                                                              "stat_err": stat_err}
        if i == save_at and rank == 0:
            # rank 0 comes last on purpose, as it can on a loaded machine (it alone runs the
            # checks above): with a save decided from the folder it would find rank 1's
            time.sleep(1.0)
        if i == save_at:
            save_sharded(Path(out_dir) / "dcp", model, opt)
            if rank == 0:
                torch.save({"model": model_name, "state": single.state_dict()},
                           Path(out_dir) / "dcp_want.pt")
        del model, opt, d
    if rank == 0:
        (Path(out_dir) / "results.json").write_text(json.dumps(results))
    import gc

    gc.collect()
    tdist.barrier()
    tdist.destroy_process_group()


def test_minibatch_seed_leaves_one_rank_without_rows():
    order = torch.randperm(B * G, generator=torch.Generator().manual_seed(MB_SEED))
    assert any(bool((mb < B * G // 2).all()) or bool((mb >= B * G // 2).all())
               for mb in order.tensor_split(4))  # exercises the zero-row rank path


def _check_two_ranks(tmp_path, combos):
    mp.spawn(_worker, args=(str(tmp_path), combos), nprocs=WORLD, join=True)
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results) == len(combos)
    for name, r in results.items():
        assert r["moved"] > 1e-4, name  # the step changed the weights
        # ... as one process does, to fp32 rounding. AdamW's first step divides each gradient
        # by its own magnitude, so a gradient near eps turns the sharded sum's rounding into
        # a few thousandths of the step: fsdp2-gspo-tiny:qwen3_moe gives 1.39e-6 since the
        # 2026-12-04 packages (transformers 5.25), and commit b0cfa0f gives the same there.
        assert r["err"] < 3e-6, (name, r)
        assert r["stat_err"] < 1e-5, (name, r)  # clip fractions etc. are the global values
    # The sharded checkpoint written by 2 ranks loads into one plain process.
    from gspo.trainer.distributed import load_sharded

    want = torch.load(tmp_path / "dcp_want.pt")
    model, _ = load_model(want["model"], seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    load_sharded(tmp_path / "dcp", model, opt)
    want, got = want["state"], model.state_dict()
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-6
    assert len(opt.state) == len(list(model.parameters()))  # Adam moments restored too


def test_two_ranks_make_the_same_update_as_one_process(tmp_path):
    """DDP with GSPO on a dense model, FSDP2 with GRPO on an MoE model; the slow lane runs
    all eight combinations."""
    _check_two_ranks(tmp_path, FAST)


@pytest.mark.slow
def test_two_ranks_match_one_process_for_every_strategy_objective_and_model(tmp_path):
    _check_two_ranks(tmp_path, ALL)


def test_sampling_does_not_depend_on_the_prompt_split():
    model, tok = load_model("tiny:llama", seed=0)
    prompts = [tok.encode(t) for t in ("1+2=", "tell me", "x")]
    params = SamplingParams(max_new_tokens=8, temperature=1.0)

    def run(idx):
        gens = [torch.Generator().manual_seed(100 + i) for i in idx]
        return generate(model, [prompts[i] for i in idx], group_size=3, params=params,
                        eos=[tok.eos_token_id], pad_id=tok.pad_token_id,
                        generator=gens).response_ids

    together = run([0, 1, 2])
    apart = run([0]) + run([1, 2])
    assert together == apart


def test_one_process_dist_is_the_identity():
    d = Dist()
    assert not d.enabled and d.is_main and d.shard(5) == (0, 5)
    t = torch.arange(3.0)
    assert d.gather(t)[0] is t and d.all_reduce(t) is t
    assert [Dist(rank=r, world_size=3).shard(7) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]


def _aux_update(model, batch, minibatches, dist=None):
    """SGD with momentum and weight decay, no clipping: the weights follow the gradients, and
    a step on a zero gradient still moves them. The MoE load-balancing loss at coefficient 1."""
    from gspo.config import MoEConfig
    from gspo.objectives import objective_from_config
    from gspo.trainer.moe_hooks import MoEHooks
    from gspo.trainer.update import UpdatePlan

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    plan = UpdatePlan([[torch.tensor(mb) for mb in minibatches]])
    return policy_update(model, opt, sched, batch, plan, objective=objective_from_config(
        _objective("gspo")), temperature=1.0, chunk=7, grad_clip=0.0,
        hooks=MoEHooks(model, MoEConfig(aux_loss_coef=1.0)), dist=dist)


def _aux_worker(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                             world_size=WORLD, timeout=TIMEOUT)
    model, _ = load_model("tiny:qwen3_moe", seed=0)
    batch = _rollout_batch(model, seed=1)
    batch.response_mask[6:] = 0.0  # rows 6, 7 (rank 1's): every response masked
    single = copy.deepcopy(model)
    # one process: [0, 1] only (the minibatch [6, 7] has no valid row: no step)
    _aux_update(single, batch, [[0, 1]])
    d = Dist(rank=rank, world_size=WORLD, strategy="ddp")
    d.engine = wrap(model, d)
    lo, hi = d.shard(B)
    # rows 0, 1 are rank 0's (rank 1 runs a stand-in row); rows 6, 7 rank 1's
    result = _aux_update(model, _rows(batch, lo * G, hi * G), [[0, 1], [6, 7]], dist=d)
    if rank == 0:
        want, got = single.state_dict(), model.state_dict()
        err = max(float((got[k] - want[k]).abs().max()) for k in want)
        (Path(out_dir) / "aux.json").write_text(json.dumps(
            {"err": err, "empty": result.empty, "skipped": result.skipped,
             "steps": len(result.stats)}))
    del model
    tdist.barrier()
    tdist.destroy_process_group()


def test_a_minibatch_on_one_rank_keeps_the_one_process_aux_loss_and_empty_ones_no_step(
        tmp_path):
    """A minibatch whose rows are all on rank 0: the load-balancing loss is rank 0's alone,
    the one-process value, and must count fully (it was averaged with rank 1's 0: half the
    gradient). A minibatch whose responses are all masked takes no optimizer step on any rank,
    as in one process (SGD's momentum and weight decay moved the weights on it)."""
    mp.spawn(_aux_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)
    r = json.loads((tmp_path / "aux.json").read_text())
    assert r["err"] < 1e-6, r
    assert (r["empty"], r["skipped"], r["steps"]) == (1, 0, 1)


TRAIN_STEP = textwrap.dedent("""
    import gc, sys, torch
    from gspo.config import load_config
    from gspo.trainer import Trainer
    from gspo.trainer.distributed import full_model_state, shutdown

    def starts_with_digit(prompts, completions, **_):
        return [float(bool(c) and c[0].isdigit()) for c in completions]

    out = sys.argv[1]
    for job in sys.argv[2:]:  # name:strategy:model, all in these processes (one start-up)
        name, strategy, model = job.split(":", 2)
        cfg = load_config(None, [f"model={model}", f"output_dir={out}", f"run_name={name}",
            "progress=false", "rollout.max_new_tokens=6", "rollout.prompts_per_step=3",
            "rollout.group_size=4", "rollout.temperature=1.0", "task.eval_size=0",
            "optim.lr=1e-3", "objective.num_minibatches=3", "objective.scale_rewards=batch",
            f"dist.strategy={strategy}"])
        trainer = Trainer(cfg, reward_fns=[starts_with_digit]).setup()
        metrics = trainer.train_step()
        state = full_model_state(trainer.model, trainer.dist) or trainer.model.state_dict()
        if trainer.dist.is_main:
            torch.save({"state": state, "metrics": metrics}, f"{out}/{name}.pt")
        del trainer, state
        gc.collect()
    shutdown()
""")
JOBS = [("ddp", "tiny:llama"), ("fsdp2", "tiny:qwen3_moe")]


def _torchrun_script(tmp_path, name: str, text: str, *args: str):
    """Write ``text`` to ``tmp_path/name`` and run it on WORLD ranks (torchrun, gloo), with
    ``tmp_path`` and ``args`` as its arguments; the finished process (exit code 0 asserted)."""
    script = tmp_path / name
    script.write_text(text)
    proc = run_session(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
         "--standalone", str(script), str(tmp_path), *args],
        env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _one_process_script(tmp_path, name: str, *args: str):
    """Run the script ``_torchrun_script`` wrote as ``tmp_path/name`` in one plain process."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    proc = run_session([sys.executable, str(tmp_path / name), str(tmp_path), *args],
                       env={**env, "PYTHONPATH": str(REPO)}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_a_train_step_under_torchrun_matches_one_process(tmp_path):
    """The whole step (shared prompts, per-prompt sampling, gathered rewards with batch-scaled
    advantages, sharded rows, global minibatches, reduced metrics) on 2 ranks vs 1: DDP on
    the dense model, FSDP2 on the MoE model. Exit code 0, no abort at exit."""
    proc = _torchrun_script(tmp_path, "step.py", TRAIN_STEP,
                            *[f"{s}:{s}:{m}" for s, m in JOBS])
    assert "terminate called" not in proc.stderr
    _one_process_script(tmp_path, "step.py", *[f"single-{s}:{s}:{m}" for s, m in JOBS])
    for strategy, model in JOBS:
        got = torch.load(tmp_path / f"{strategy}.pt")
        want = torch.load(tmp_path / f"single-{strategy}.pt")
        err = max(float((got["state"][k] - want["state"][k]).abs().max())
                  for k in want["state"])
        assert err < 1e-5, (strategy, err)
        keys = ["reward/mean", "objective/clip_frac_tokens", "rollout/response_len_mean",
                "objective/clip_frac_seqs_signal", "train/entropy", "objective/approx_kl",
                "objective/seq_ratio_std"]
        if "moe" in model:  # from the expert loads of both ranks' tokens, not each rank's own
            keys += ["moe/load_imbalance", "moe/router_entropy"]
        for key in keys:
            assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-4,
                                                        abs=1e-6), key


@pytest.mark.slow
def test_gspo_train_under_torchrun_checkpoints_on_rank_0_and_resumes_in_one_process(tmp_path):
    """`torchrun -m gspo train` with FSDP2: only rank 0 writes the run folder; the full-weight
    checkpoint with its name-keyed optimizer state resumes in a plain process. Needs the
    rank-0 gates in Trainer._make_run_dir / save_checkpoint / _restore / train."""
    common = ["model=tiny:llama", f"output_dir={tmp_path}", "run_name=r", "progress=false",
              "tensorboard=false", "rollout.max_new_tokens=5", "rollout.prompts_per_step=3",
              "rollout.group_size=4", "rollout.temperature=1.0", "task.eval_size=4",
              "rollout.eval_max_new_tokens=4", "objective.num_minibatches=3", "save_every=1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = run_session(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
         "--standalone", "-m", "gspo", "train", *common, "steps=2",
         "dist.strategy=fsdp2"], env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
    assert proc.stdout.count("run folder:") == 1  # rank 0 speaks
    run = tmp_path / "r"
    steps = [json.loads(x)["step"] for x in open(run / "metrics.jsonl")]
    assert steps == [0, 1, 2, 2]  # one line per step (+ evaluations), not one per rank
    from safetensors.torch import load_file

    weights = load_file(run / "checkpoints" / "step_000002" / "model.safetensors")
    assert weights["model.embed_tokens.weight"].shape == (259, 64)  # full, not a shard
    proc = run_session([sys.executable, "-m", "gspo", "train", *common, "steps=3",
                        f"resume={run}"], env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "checkpoints" / "step_000003").is_dir()


def test_an_engine_for_one_process_only_is_refused_under_torchrun(tmp_path, monkeypatch):
    """Under torchrun an engine that cannot run in a rank goes to an engine process of the
    rank's own (vLLM, in the synchronous loop too: the pipeline at k = 0, vLLM lane); one
    that has no engine process path (llama.cpp) is a one-line error at setup."""
    from gspo.config import ConfigError, load_config
    from gspo.trainer import Trainer, distributed

    monkeypatch.setattr(distributed, "prepare", lambda cfg, model, ref: Dist(
        rank=0, world_size=2, device=torch.device("cpu"), strategy="ddp"))  # no world needed
    cfg = load_config(None, ["model=tiny:llama", f"output_dir={tmp_path}", "steps=1",
                             "rollout.engine=llamacpp", "task.eval_size=0"])
    with pytest.raises(ConfigError, match=r"rollout\.engine=llamacpp runs in one process "
                                          r"only; use rollout\.engine=hf or vllm under"):
        Trainer(cfg).setup()


def _router_lr_worker(rank: int, out_dir: str) -> None:
    from gspo.config import MoEConfig
    from gspo.trainer.distributed import load_optimizer_state, optimizer_state
    from gspo.trainer.moe_hooks import MoEHooks

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                             world_size=WORLD, timeout=TIMEOUT)
    cfg = MoEConfig(router_lr_scale=2.0)  # two groups: the routers' after the rest

    def optimizer(model):
        hooks = MoEHooks(model, cfg)
        return torch.optim.AdamW(hooks.param_groups(model, 1e-3), lr=1e-3)

    single, _ = load_model("tiny:qwen3_moe", seed=0)  # a one-process (index-keyed) state
    opt = optimizer(single)
    single(torch.arange(3, 15).view(2, 6)).logits.float().pow(2).mean().backward()
    opt.step()
    name_of = {id(p): n for n, p in single.named_parameters()}
    want = {name_of[id(p)]: s["exp_avg"] for p, s in opt.state.items()}
    model, _ = load_model("tiny:qwen3_moe", seed=0)
    d = Dist(rank=rank, world_size=WORLD, strategy="fsdp2")
    d.engine = wrap(model, d)
    sharded = optimizer(model)
    load_optimizer_state(model, sharded, opt.state_dict(), d)
    full = optimizer_state(model, sharded, d)  # name-keyed, complete on rank 0
    if rank == 0:
        wrong = [n for n, t in want.items() if full["state"][n]["exp_avg"].shape != t.shape
                 or not torch.equal(full["state"][n]["exp_avg"], t)]
        (Path(out_dir) / "wrong.json").write_text(json.dumps(wrong))
    del model, sharded, d
    import gc

    gc.collect()
    tdist.barrier()
    tdist.destroy_process_group()


def test_an_index_keyed_optimizer_state_with_two_groups_loads_into_fsdp2(tmp_path):
    """A one-process (or DDP) checkpoint's AdamW state resumes under FSDP2 with each moment on
    its own parameter, also with moe.router_lr_scale's second group (the optimizer's order is
    then not the model's)."""
    mp.spawn(_router_lr_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)
    assert json.loads((tmp_path / "wrong.json").read_text()) == []


FAILING_REWARD = textwrap.dedent("""
    import json, os, sys
    from gspo.config import load_config
    from gspo.trainer import Trainer

    def broken(prompts, completions, **_):
        raise ValueError("boom")

    out = sys.argv[1]
    cfg = load_config(None, ["model=tiny:llama", f"output_dir={out}", "run_name=r",
        "progress=false", "tensorboard=false", "rollout.max_new_tokens=3",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "task.eval_size=0",
        "objective.num_minibatches=2", "steps=1", "save_final=false",
        "reward.max_unscorable_frac=1.0"])
    trainer = Trainer(cfg, reward_fns=[broken]).setup()
    trainer.train()
    trainer.cleanup()
""")


def test_reward_failures_under_torchrun_count_every_ranks_rows(tmp_path):
    """Each rank scores its own rows; the logged ``reward/failures/*`` of a step is the sum
    over ranks (rank 0 logs it), as in one process: 8 unscorable responses, not rank 0's 4."""
    _torchrun_script(tmp_path, "fail.py", FAILING_REWARD)
    rows = [json.loads(x) for x in open(tmp_path / "r" / "metrics.jsonl")]
    assert rows[-1]["reward/failures/broken"] == 8


REWARD_ERRORS = textwrap.dedent("""
    import os, sys
    from gspo.config import load_config
    from gspo.rewards import RewardError
    from gspo.trainer import Trainer

    def broken(prompts, completions, **_):  # fails on every rank's rows
        raise ValueError("boom")

    def rank_one(prompts, completions, **_):  # fails on rank 1's rows only
        if os.environ["RANK"] == "1":
            raise KeyError("rank one")
        return [0.0] * len(completions)

    out = sys.argv[1]
    cfg = load_config(None, ["model=tiny:llama", f"output_dir={out}", "run_name=r",
        "progress=false", "tensorboard=false", "rollout.max_new_tokens=3",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "task.eval_size=0",
        "objective.num_minibatches=2", "steps=2", "save_final=false",
        "reward.max_unscorable_frac=0.5"])
    trainer = Trainer(cfg, reward_fns=[broken, rank_one]).setup()
    try:
        trainer.train()
    except RewardError:  # every response unscorable: every rank stops in step 1
        print("stopped: RewardError", flush=True)
    trainer.cleanup(barrier=False)
""")


def test_reward_errors_under_torchrun_are_logged_once_naming_the_rank(tmp_path):
    """Each rank scores its own rows and keeps its own first errors: the run's
    reward_errors.log holds each function's first error once (the lowest rank's, naming it),
    printed once, not once per rank; also when the step raises RewardError on every rank."""
    proc = _torchrun_script(tmp_path, "errors.py", REWARD_ERRORS)
    assert proc.stdout.count("stopped: RewardError") == WORLD
    log = (tmp_path / "r" / "reward_errors.log").read_text()
    headers = [line for line in log.splitlines() if line.startswith("== ")]
    assert headers == ["== reward function 'broken' first failed at step 1 on rank 0 ==",
                       "== reward function 'rank_one' first failed at step 1 on rank 1 =="]
    assert log.count("ValueError: boom") == 1 and log.count("KeyError: 'rank one'") == 1
    assert proc.stdout.count("reward function 'broken' failed at step 1 on rank 0") == 1
    assert proc.stdout.count("reward function 'rank_one' failed at step 1 on rank 1") == 1


RARE_SIGNAL = textwrap.dedent("""
    import gc, sys, torch
    from gspo.config import load_config
    from gspo.trainer import Trainer
    from gspo.trainer.distributed import full_model_state, shutdown

    def rare_signal(prompts, completions, **_):  # about one prompt in three has signal
        return [float(len(c) % 3) if sum(map(ord, p)) % 3 == 0 else 0.0
                for p, c in zip(prompts, completions)]

    out, name = sys.argv[1], sys.argv[2]
    cfg = load_config(None, ["model=tiny:llama", f"output_dir={out}", f"run_name={name}",
        "progress=false", "tensorboard=false", "rollout.max_new_tokens=6",
        "rollout.prompts_per_step=3", "rollout.group_size=4", "task.eval_size=0",
        "optim.lr=1e-3", "objective.num_minibatches=2", "rollout.dynamic_sampling=true",
        "rollout.dynamic_max_extra_batches=0"])
    trainer = Trainer(cfg, reward_fns=[rare_signal]).setup()
    metrics = []
    for _ in range(3):
        metrics.append(trainer.train_step())
        trainer.step += 1
    state = full_model_state(trainer.model, trainer.dist) or trainer.model.state_dict()
    if trainer.dist.is_main:
        torch.save({"state": state, "metrics": metrics}, f"{out}/{name}.pt")
    del trainer, state
    gc.collect()
    shutdown()
""")


@pytest.mark.slow
def test_dynamic_sampling_with_fewer_signal_groups_than_ranks_matches_one_process(tmp_path):
    """Past the cap with one group of signal on 2 ranks, rank 1 needs a group of its own: a
    zero-signal stand-in, which one process does not train on. It joins no minibatch and no
    reward metric, so the run keeps the one-process weights, loss and metrics (before, it
    diluted the loss: train/loss 4.8e-4 against 4.1e-3, reward/mean 0.25 against 0.5)."""
    _torchrun_script(tmp_path, "rare.py", RARE_SIGNAL, "two")
    _one_process_script(tmp_path, "rare.py", "one")
    got, want = torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "one.pt")
    assert [m["dynamic/groups_kept"] for m in want["metrics"]] == [0, 1, 0]  # fewer than ranks
    err = max(float((got["state"][k] - want["state"][k]).abs().max()) for k in want["state"])
    assert err < 1e-5, err
    for a, b in zip(got["metrics"], want["metrics"]):
        for key in ("train/loss", "reward/mean", "reward/frac_groups_zero_std",
                    "dynamic/groups_filled", "objective/clip_frac_tokens", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        for key in ("rollout/response_len_mean", "rollout/response_len_max",
                    "rollout/truncated_frac"):  # not the stand-ins' rows (0.875 vs 0.75)
            assert a[key] == pytest.approx(b[key], rel=1e-9), key


STAND_IN_JOBS = textwrap.dedent("""
    import gc, sys, torch
    from gspo.config import load_config
    from gspo.trainer import Trainer
    from gspo.trainer.distributed import shutdown

    def rare_signal(prompts, completions, **_):  # about one prompt in three has signal
        return [float(len(c) % 3) if sum(map(ord, p)) % 3 == 0 else 0.0
                for p, c in zip(prompts, completions)]

    out = sys.argv[1]
    for job in sys.argv[2:]:  # name|override,override,...: all in these processes
        name, extra = job.split("|")
        cfg = load_config(None, ["model=tiny:llama", f"output_dir={out}", f"run_name={name}",
            "progress=false", "tensorboard=false", "rollout.max_new_tokens=6",
            "rollout.group_size=4", "task.eval_size=0", "optim.lr=1e-3",
            "objective.num_minibatches=2", "rollout.dynamic_sampling=true",
            "rollout.dynamic_max_extra_batches=0", *extra.split(",")])
        trainer = Trainer(cfg, reward_fns=[rare_signal]).setup()
        metrics = []
        for _ in range(2):
            m = trainer.train_step()
            metrics.append({**m, "samples": trainer.last_samples[1]})  # completions
            trainer.step += 1
        if trainer.dist.is_main:
            torch.save(metrics, f"{out}/{name}.pt")
        del trainer
        gc.collect()
    shutdown()
""")
STAND_IN_ENV = textwrap.dedent("""
    from gspo.rollout.envs import Step

    class Echo:  # observations whose length follows the response; at most 2 policy turns
        def reset(self, prompt, **columns):
            self.turn = 0

        def step(self, response):
            self.turn += 1
            if self.turn >= 2 or len(response) % 2:
                return Step(done=True)
            return Step("ok " * (1 + len(response) % 5))
""")


@pytest.mark.slow
def test_dynamic_sampling_stand_ins_stay_out_of_episode_metrics_and_whole_first_draws(
        tmp_path):
    """Stand-in groups under torchrun are not trained on and not measured, as one process has
    none: (a) multi-turn, the episode metrics gathered from every rank leave them out (before:
    rollout/turns_mean 1.875 against 2.0); (b) prompts_per_step = 2 on 2 ranks with one group
    of signal, where the stand-in makes the first draw's every group chosen: it still gets
    zero loss weight (before, the step trained on it: reward/mean 0.25 against 0.5, the
    gradient halved). The samples file's rows leave them out too."""
    (tmp_path / "stand_in_env.py").write_text(STAND_IN_ENV)
    jobs = {"mt": "rollout.prompts_per_step=3,rollout.max_turns=3,"
                  "rollout.env=stand_in_env:Echo",
            "pairs": "rollout.prompts_per_step=2"}
    _torchrun_script(tmp_path, "stand_ins.py", STAND_IN_JOBS,
                     *[f"{name}|{extra}" for name, extra in jobs.items()])
    _one_process_script(tmp_path, "stand_ins.py",
                        *[f"one-{name}|{extra}" for name, extra in jobs.items()])
    for name, keys in (("mt", ["rollout/turns_mean", "rollout/model_tokens_mean",
                               "rollout/observation_tokens_mean", "reward/mean"]),
                       ("pairs", ["reward/mean", "reward/frac_groups_zero_std", "train/loss",
                                  "train/grad_norm", "objective/clip_frac_tokens"])):
        got, want = torch.load(tmp_path / f"{name}.pt"), torch.load(tmp_path / f"one-{name}.pt")
        # fewer groups than ranks: the case in question ran
        assert min(m["dynamic/groups_kept"] + m["dynamic/groups_filled"] for m in want) < 2
        for a, b in zip(got, want):
            for key in keys:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (name, key)
            assert a["samples"] == b["samples"], name


def test_a_strategy_in_one_process_warns_that_it_shards_nothing(monkeypatch):
    """dist.strategy=fsdp2 without torchrun (or in a world of one) trains as one process:
    a warning says so (it went by silently); the default strategy says nothing."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = torch.nn.Linear(2, 2)
    with pytest.warns(UserWarning, match="dist.strategy=fsdp2 applies under torchrun"):
        d = prepare(load_config(None, ["device=cpu", "dist.strategy=fsdp2"]), model)
    assert not d.enabled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not prepare(TrainConfig(device="cpu"), model).enabled
