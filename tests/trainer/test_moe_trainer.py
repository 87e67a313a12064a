"""MoE policies through the trainer: routing-change metric, R2 replay, load-balancing loss."""

import json
import math

import pytest

from gspo.config import ConfigError, load_config
from gspo.models.moe import router_modules
from gspo.trainer import Trainer


def first_char_digit(prompts, completions, **_):
    return [float(bool(c) and c[0].isdigit()) for c in completions]


def char_codes(prompts, completions, **_):
    """A reward that differs within almost every group (the R3 tests need gradients)."""
    return [float(sum(map(ord, c)) % 97) for c in completions]


def _run(tmp_path, name, *extra):
    cfg = load_config(None, [
        f"output_dir={tmp_path}", f"run_name={name}", "progress=false", "steps=2",
        "rollout.max_new_tokens=5", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "task.eval_size=0", "eval_before=false", *extra])
    trainer = Trainer(cfg, reward_fns=[first_char_digit]).setup()
    trainer.train()
    return [json.loads(x) for x in open(trainer.run_dir / "metrics.jsonl")]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_routing_change_is_zero_without_weight_change(tmp_path, family):
    rows = _run(tmp_path, family, f"model=tiny:{family}", "optim.lr=0")
    changes = [r["moe/routing_change"] for r in rows if "moe/routing_change" in r]
    assert len(changes) == 2 and all(c == 0.0 for c in changes)
    assert "moe/routing_change_layer3" in rows[0]


def test_r2_replay_and_aux_loss_run_and_routes_drift_with_updates(tmp_path):
    rows = _run(tmp_path, "r2", "model=tiny:qwen3_moe", "optim.lr=1e-2", "moe.routing_replay=r2",
                "moe.aux_loss_coef=0.01", "objective.name=grpo", "objective.eps_low=0.2",
                "objective.eps_high=0.27")
    assert rows[-1]["moe/routing_change"] > 0  # later minibatches see a changed router
    # the mean over all 4 minibatches includes the first one's 0: the after-update mean is
    # exactly 4/3 of it
    assert rows[-1]["moe/routing_change_after_update"] == pytest.approx(
        rows[-1]["moe/routing_change"] * 4 / 3, rel=1e-6)
    assert rows[-1]["moe/load_balancing_loss"] > 0


@pytest.mark.parametrize("option", ["moe.routing_replay=r2", "moe.router_lr_scale=10"])
def test_moe_options_on_a_dense_model_are_an_error(tmp_path, option):
    cfg = load_config(None, ["model=tiny:llama", option, f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="dense"):
        Trainer(cfg, reward_fns=[first_char_digit]).setup()
    assert not any(tmp_path.iterdir())


def _r3_trainer(tmp_path, name, *extra):
    cfg = load_config(None, [
        f"output_dir={tmp_path}", f"run_name={name}", "progress=false", "steps=2",
        "model=tiny:qwen3_moe", "rollout.max_new_tokens=6", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "task.eval_size=0", "eval_before=false", "optim.lr=1e-2",
        "moe.routing_replay=r3", "objective.num_minibatches=4", *extra])
    return Trainer(cfg, reward_fns=[char_codes]).setup()


def _metrics(trainer):
    return [json.loads(x) for x in open(trainer.run_dir / "metrics.jsonl")]


def test_r3_replays_the_rollout_routing_and_the_router_still_learns(tmp_path, monkeypatch):
    import contextlib

    import torch

    import gspo.trainer.moe_hooks as hooks
    from gspo.models.moe import router_modules

    replays, real = [], hooks.replay_routing

    @contextlib.contextmanager
    def spy(model, indices):
        with real(model, indices) as replayer:
            yield replayer
        replays.append(replayer.calls)

    monkeypatch.setattr(hooks, "replay_routing", spy)
    trainer = _r3_trainer(tmp_path, "r3")
    before = [r.weight.detach().clone() for r in router_modules(trainer.model)]
    trainer.train()
    rows = [r for r in _metrics(trainer) if "moe/rollout_routing_mismatch" in r]
    assert len(rows) == 2
    # fp32 on CPU: the sampler's incremental forwards route exactly like the trainer's recompute
    assert all(r["moe/rollout_routing_mismatch"] == 0.0 for r in rows)
    assert len(replays) == 2 * 4 and all(c > 0 for c in replays)  # every minibatch replayed
    after = router_modules(trainer.model)
    assert all(not torch.equal(b, a.weight) for b, a in zip(before, after))  # gate gradients


def test_r3_replays_what_the_rollout_recorded_not_the_recompute(tmp_path, monkeypatch):
    """Shift every rollout-recorded expert by one: the update must replay the shifted experts at
    the positions the rollout saw, the trainer's own π_old routing elsewhere, and the metric must
    count every seen response token as mismatched."""
    import torch

    import gspo.rollout.hf_engine as engine_mod
    import gspo.trainer.trainer as trainer_mod

    seen = {}
    real_generate, real_update = engine_mod.generate, trainer_mod.policy_update
    real_old = Trainer.old_logprobs

    def shifted_generate(*args, **kwargs):
        assert kwargs.get("record_routing") is True
        roll = real_generate(*args, **kwargs)
        roll.routing = [torch.where(r >= 0, (r + 1) % 8, r) for r in roll.routing]
        seen["rollout"] = roll.routing
        return roll

    def old_logprobs(self, batch, rows=None, replay=None):
        out = real_old(self, batch, rows, replay)
        if replay is None:  # the π_old pass on its own routing (not the R3 rerun)
            seen["r2"] = out[2]
        return out

    def update(model, optimizer, scheduler, batch, plan, **kwargs):
        seen["replayed"] = batch.routing
        seen["replay"] = kwargs["hooks"].cfg.routing_replay != "off"
        return real_update(model, optimizer, scheduler, batch, plan, **kwargs)

    monkeypatch.setattr(engine_mod, "generate", shifted_generate)
    monkeypatch.setattr(trainer_mod, "policy_update", update)
    monkeypatch.setattr(Trainer, "old_logprobs", old_logprobs)
    trainer = _r3_trainer(tmp_path, "r3shift", "steps=1")
    metrics = trainer.train_step()
    assert metrics["moe/rollout_routing_mismatch"] == 1.0
    assert seen["replay"] is True
    for rolled, r2, replayed in zip(seen["rollout"], seen["r2"], seen["replayed"]):
        known = (rolled >= 0).all(-1)
        assert known.any() and not known.all()
        assert torch.equal(replayed[known], rolled[known])
        assert torch.equal(replayed[~known], r2[~known])
        assert not torch.equal(replayed, r2)


def test_r3_pi_old_routes_like_the_update_so_the_ratio_is_one_at_theta_old(tmp_path,
                                                                         monkeypatch):
    """R3 replays the rollout's experts in the update; π_old (the loss's denominator) must be
    computed under the same experts, else the ratio is not 1 at θ = θ_old wherever the rollout
    routed differently from the trainer's recompute (here: every seen position, shifted)."""
    import torch

    import gspo.rollout.hf_engine as engine_mod

    real_generate = engine_mod.generate
    calls = []
    real_old = Trainer.old_logprobs

    def shifted_generate(*args, **kwargs):
        roll = real_generate(*args, **kwargs)
        roll.routing = [torch.where(r >= 0, (r + 1) % 8, r) for r in roll.routing]
        return roll

    def old_logprobs(self, batch, rows=None, replay=None):
        calls.append(replay is not None)
        return real_old(self, batch, rows, replay)

    monkeypatch.setattr(engine_mod, "generate", shifted_generate)
    monkeypatch.setattr(Trainer, "old_logprobs", old_logprobs)
    trainer = _r3_trainer(tmp_path, "r3ratio", "steps=1", "optim.lr=0",
                          "objective.num_minibatches=1")
    metrics = trainer.train_step()
    assert metrics["moe/rollout_routing_mismatch"] == 1.0
    assert calls == [False, True]  # the π_old pass, then again under the rollout's experts
    assert metrics["objective/seq_ratio_min"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["objective/seq_ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["objective/clip_frac_seqs"] == 0.0


def test_r3_without_a_routing_mismatch_runs_one_pi_old_pass(tmp_path, monkeypatch):
    calls = []
    real_old = Trainer.old_logprobs

    def old_logprobs(self, batch, rows=None, replay=None):
        calls.append(replay is not None)
        return real_old(self, batch, rows, replay)

    monkeypatch.setattr(Trainer, "old_logprobs", old_logprobs)
    metrics = _r3_trainer(tmp_path, "r3once", "steps=1").train_step()
    assert metrics["moe/rollout_routing_mismatch"] == 0.0  # fp32 HF sampler: π_old's experts
    assert calls == [False]


def test_r3_with_an_engine_that_cannot_record_is_an_error(tmp_path):
    cfg = load_config(None, ["model=tiny:qwen3_moe", "moe.routing_replay=r3",
                             "rollout.engine=vllm", f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"rollout\.engine=vllm cannot return"):
        Trainer(cfg, reward_fns=[first_char_digit]).setup()


def test_rollout_and_old_pass_of_an_moe_policy_record_no_autograd_graph(tmp_path):
    """Sampling and the π_old pass of a policy outside the lean passes (here: turned off) run
    under no_grad: ``torch.inference_mode(False)`` would switch gradient recording back on
    inside it, and every layer's output would carry a graph that nothing reads (time and
    memory)."""
    import torch

    cfg = load_config(None, [
        "model=tiny:qwen3_moe", f"output_dir={tmp_path}", "run_name=graph", "progress=false",
        "rollout.max_new_tokens=4", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "task.eval_size=0", "eval_before=false", "lean_forward=false",
        "rollout.fast_decode=false"])
    trainer = Trainer(cfg, reward_fns=[first_char_digit]).setup()
    assert not trainer.inference  # the path under test: no inference mode for this model
    seen = []
    trainer.model.model.layers[0].register_forward_hook(
        lambda _m, _i, out: seen.append((torch.is_grad_enabled(), out[0].requires_grad
                                         if isinstance(out, tuple) else out.requires_grad)))
    _, roll = trainer.rollout()
    assert seen and not any(a or b for a, b in seen)
    seen.clear()
    from gspo.rollout import pad_batch

    batch = pad_batch(roll.prompt_ids, roll.response_ids, trainer.pad_id)
    lp, ent, routing = trainer.old_logprobs(batch)
    assert seen and not any(a or b for a, b in seen)
    assert not lp.requires_grad and not ent.requires_grad and routing is not None


def test_moe_old_pass_in_inference_mode_gives_routing_autograd_can_use(tmp_path):
    """The lean passes cover MoE policies and run the π_old pass in inference mode; the
    experts it records come out as normal tensors, which R2's replay may index under autograd
    (an inference tensor saved for backward raises)."""
    import torch

    from gspo.rollout import pad_batch

    cfg = load_config(None, [
        "model=tiny:qwen3_moe", f"output_dir={tmp_path}", "run_name=inf", "progress=false",
        "rollout.max_new_tokens=4", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "task.eval_size=0", "eval_before=false"])
    trainer = Trainer(cfg, reward_fns=[first_char_digit]).setup()
    assert trainer.inference and trainer.lean
    _, roll = trainer.rollout()
    _, _, routing = trainer.old_logprobs(pad_batch(roll.prompt_ids, roll.response_ids,
                                                   trainer.pad_id))
    assert routing and not any(r.is_inference() for r in routing)
    x = torch.randn(routing[0].shape[0], 8, requires_grad=True)
    x.gather(-1, routing[0]).sum().backward()  # saved for backward: must not be inference


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_router_lr_scale_moves_the_routers_that_much_faster(tmp_path, family):
    """moe.router_lr_scale puts the routers in their own AdamW group at scale × lr: after one
    RL step (4 AdamW steps) the routers' largest change is about scale × the rest's."""
    cfg = load_config(None, [
        f"output_dir={tmp_path}", "run_name=scaled", "progress=false", "steps=1",
        f"model=tiny:{family}", "rollout.max_new_tokens=5", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "task.eval_size=0", "eval_before=false", "optim.lr=1e-4",
        "moe.router_lr_scale=100", "objective.num_minibatches=4"])
    trainer = Trainer(cfg, reward_fns=[char_codes]).setup()
    groups = trainer.optimizer.param_groups
    assert [g["lr"] for g in groups] == pytest.approx([1e-4, 1e-2])
    routers = {id(p) for m in router_modules(trainer.model) for p in m.parameters()}
    assert {id(p) for p in groups[1]["params"]} == routers
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(
        [p for p in trainer.model.parameters() if p.requires_grad])
    router_names = {n for n, p in trainer.model.named_parameters() if id(p) in routers}
    before = _weights(trainer.model)
    trainer.train()
    after = _weights(trainer.model)
    moved = {n: float((after[n] - before[n]).abs().max()) for n in before}
    router_max = max(moved[n] for n in router_names)
    rest_max = max(v for n, v in moved.items() if n not in router_names)
    assert rest_max > 0 and router_max > 20 * rest_max
    rows = _metrics(trainer)
    assert rows[-1]["train/lr"] == pytest.approx(1e-4)  # the policy's lr, as before


def test_router_lr_scale_one_keeps_a_single_group(tmp_path):
    trainer = Trainer(load_config(None, [
        f"output_dir={tmp_path}", "model=tiny:qwen3_moe", "task.eval_size=0"]),
        reward_fns=[char_codes]).setup()
    assert len(trainer.optimizer.param_groups) == 1


def test_router_lr_scale_must_be_positive():
    with pytest.raises(ConfigError, match="router_lr_scale must be > 0"):
        load_config(None, ["moe.router_lr_scale=0"])


def test_router_lr_scale_with_frozen_routers_is_an_error(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path}", "model=tiny:qwen3_moe", "lora.r=4",
                             "lora.target_modules=[q_proj,v_proj]", "moe.router_lr_scale=10",
                             "task.eval_size=0"])
    with pytest.raises(ConfigError, match="routers have no trainable parameters"):
        Trainer(cfg, reward_fns=[char_codes]).setup()
    assert not any(tmp_path.iterdir())


def test_router_lr_scale_scales_a_lora_routers_adapter(tmp_path):
    """lora.target_modules=all-linear adapts a Qwen3-MoE's routers (PEFT wraps the router's
    weight in a ParamWrapper, whose adapter the router module itself does not hold): that
    adapter is the routers' group, at lr × router_lr_scale. It was refused as "the routers
    have no trainable parameters"."""
    cfg = load_config(None, [f"output_dir={tmp_path}", "model=tiny:qwen3_moe", "lora.r=4",
                             "moe.router_lr_scale=10", "task.eval_size=0", "optim.lr=1e-3"])
    trainer = Trainer(cfg, reward_fns=[char_codes]).setup()
    rest, routers = trainer.optimizer.param_groups
    assert routers["lr"] == pytest.approx(10 * rest["lr"])
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    got = sorted(names[id(p)] for p in routers["params"])
    assert got and all(".mlp.gate.lora_" in n for n in got)
    assert not any(".mlp.gate." in names[id(p)] for p in rest["params"])


def _unsupported_moe_folder(tmp_path):
    """A tiny Granite-MoE (a transformers MoE family gspo has no routing adapter for), saved as
    a model folder with the byte tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, GraniteMoeConfig

    from gspo.models.loading import save_model_folder
    from gspo.models.moe import has_routers, is_moe
    from gspo.models.tiny import byte_tokenizer

    tokenizer = byte_tokenizer()
    config = GraniteMoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
        bos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert is_moe(model) and not has_routers(model)
    return save_model_folder(model, tokenizer, tmp_path / "granitemoe")


def test_an_moe_family_without_an_adapter_trains_like_a_dense_model(tmp_path):
    """With every moe.* option at its default, an MoE family gspo cannot hook trains (no
    routing metrics); it used to fail at setup with 'routing replay does not support'."""
    folder = _unsupported_moe_folder(tmp_path)
    rows = _run(tmp_path / "out", "granite", f"model={folder}", "optim.lr=1e-3")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["train/loss"]) for r in rows)
    assert not any(k.startswith("moe/") for r in rows for k in r)


@pytest.mark.parametrize("option", ["moe.routing_replay=r2", "moe.aux_loss_coef=0.01",
                                    "moe.router_lr_scale=2", "moe.log_routing_change=false"])
def test_router_options_on_an_moe_family_without_an_adapter_are_an_error(tmp_path, option):
    folder = _unsupported_moe_folder(tmp_path)
    cfg = load_config(None, [f"model={folder}", option, f"output_dir={tmp_path / 'out'}"])
    with pytest.raises(ConfigError, match=rf"^{option.split('=')[0]}=.*family 'granitemoe'"):
        Trainer(cfg, reward_fns=[first_char_digit]).setup()


def test_routing_change_after_update_skips_minibatches_without_a_valid_row(tmp_path,
                                                                            monkeypatch):
    """Under rollout.mask_truncated a minibatch can hold only masked rows; its routing change
    is a placeholder 0, which moe/routing_change leaves out and the after-update mean must
    too (it was averaged in). Such a minibatch now takes no optimizer step and returns no
    stats (``UpdateResult.empty``); the after-update mean still covers the others only."""
    import gspo.rollout.hf_engine as engine_mod
    import gspo.trainer.trainer as trainer_mod

    real_generate, real_update, updates = engine_mod.generate, trainer_mod.policy_update, []

    def half_truncated(*args, **kwargs):  # the first group's rows: masked out of the loss
        roll = real_generate(*args, **kwargs)
        roll.truncated = [i < roll.group_size for i in range(len(roll))]
        return roll

    def spy(*args, **kwargs):
        updates.append(real_update(*args, **kwargs))
        return updates[-1]

    monkeypatch.setattr(engine_mod, "generate", half_truncated)
    monkeypatch.setattr(trainer_mod, "policy_update", spy)
    # _r3_trainer for its reward with signal in every step; replay off (not needed here)
    trainer = _r3_trainer(tmp_path, "masked", "moe.routing_replay=off", "optim.lr=3e-2",
                          "rollout.mask_truncated=true", "steps=3")
    trainer.train()
    rows = _metrics(trainer)
    empty_after_first = 0
    for row, res in zip(rows, updates, strict=True):
        after = [float(s["moe/routing_change"]) for s, c in zip(res.stats[1:], res.counts[1:])
                 if c["rows"] > 0]
        empty_after_first += len(res.stats) - 1 - len(after)
        assert row["moe/routing_change_after_update"] == pytest.approx(
            sum(after) / len(after) if after else 0.0, rel=1e-6)
    assert empty_after_first == 0  # skipped minibatches return no stats
    assert sum(res.empty for res in updates) > 0  # the case under test happened
    assert any(r["moe/routing_change_after_update"] > 0 for r in rows)  # the routers moved


def test_resume_with_another_router_group_layout_is_a_config_error(tmp_path):
    """moe.router_lr_scale = 1 in one run and ≠ 1 in the other changes the optimizer's
    parameter groups: a one-line config error naming the option, not torch's ValueError."""
    _run(tmp_path, "first", "model=tiny:qwen3_moe", "save_every=1")
    cfg = load_config(None, [
        f"output_dir={tmp_path}", "run_name=first", "progress=false", "steps=3",
        "rollout.max_new_tokens=5", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "task.eval_size=0", "eval_before=false", "model=tiny:qwen3_moe",
        "moe.router_lr_scale=10", f"resume={tmp_path / 'first'}"])
    trainer = Trainer(cfg, reward_fns=[first_char_digit])
    try:
        with pytest.raises(ConfigError, match=r"moe\.router_lr_scale must be 1 in both runs"):
            trainer.setup()
    finally:
        trainer.cleanup()
