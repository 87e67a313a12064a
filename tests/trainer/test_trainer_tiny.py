"""The whole loop on a tiny model: reward rises, checkpoints resume bit-exactly."""

import json
import re
import warnings

import pytest
import torch
from safetensors.torch import load_file

from gspo.config import ConfigError, load_config
from gspo.data import format_prompt
from gspo.models.lean_forward import compile_unsupported
from gspo.trainer import Trainer


def starts_with_digit(prompts, completions, **_):
    return [float(bool(c) and c[0].isdigit()) for c in completions]


def char_codes(prompts, completions, **_):
    """A reward that differs within almost every group: a step with it moves the weights."""
    return [float(sum(map(ord, c)) % 97) for c in completions]


def _cfg(tmp_path, name, *extra):
    return load_config(None, [
        "model=tiny:llama", f"output_dir={tmp_path}", f"run_name={name}", "progress=false",
        "rollout.max_new_tokens=6", "rollout.prompts_per_step=4", "rollout.group_size=6",
        "rollout.temperature=1.0", "task.eval_size=8", "optim.lr=3e-3", *extra])


def _weights(run_dir, step):
    return load_file(f"{run_dir}/checkpoints/step_{step:06d}/model.safetensors")


def test_reward_rises_on_an_easy_task(tmp_path):
    cfg = _cfg(tmp_path, "rise", "steps=30", "objective.name=grpo", "objective.eps_low=0.2",
               "objective.eps_high=0.27")
    trainer = Trainer(cfg, reward_fns=[starts_with_digit]).setup()
    trainer.train()
    rows = [json.loads(x) for x in open(trainer.run_dir / "metrics.jsonl")]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert len(rewards) == 30
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.3, (first, last)


def test_gspo_default_objective_logs_paper_stats(tmp_path):
    trainer = Trainer(_cfg(tmp_path, "stats", "steps=2"), reward_fns=[starts_with_digit]).setup()
    trainer.train()
    row = json.loads(open(trainer.run_dir / "metrics.jsonl").readlines()[1])
    for key in ("objective/clip_frac_tokens", "objective/seq_ratio_max", "objective/approx_kl",
                "train/grad_norm", "train/entropy", "rollout/truncated_frac",
                "perf/rollout_tokens_per_s", "time/update_s", "reward/std_within_group"):
        assert key in row, key
    assert row["rollout/logprob_gap_abs_max"] < 3e-5  # sampler and trainer agree in fp32
    assert (trainer.run_dir / "config.yaml").is_file()


def test_one_minibatch_one_epoch_warns(tmp_path):
    cfg = _cfg(tmp_path, "warn", "steps=1", "objective.num_minibatches=1")
    with pytest.warns(UserWarning, match="every ratio is 1"):
        Trainer(cfg, reward_fns=[starts_with_digit]).setup()


def test_one_minibatch_does_not_warn_when_pi_old_is_the_samplers(tmp_path, recwarn):
    """With π_old taken from the rollout (or an older behaviour policy, async), the ratio of
    one minibatch and one epoch is not 1 and clipping acts: no warning that it never does."""
    cfg = _cfg(tmp_path, "nowarn", "steps=1", "objective.num_minibatches=1",
               "objective.old_logprobs=rollout")
    Trainer(cfg, reward_fns=[starts_with_digit]).setup()
    assert not [w for w in recwarn if "every ratio is 1" in str(w.message)]


@pytest.mark.filterwarnings("ignore:gspo aggregation='token'")
@pytest.mark.parametrize("extra, same", [
    ((), True),
    (("objective.name=grpo", "objective.aggregation=token"), False),
    (("objective.name=grpo", "objective.aggregation=constant", "objective.norm_constant=6"),
     False),
    (("objective.old_logprobs=decoupled", "objective.correction.name=tis",
      "objective.correction.cap=1.001"), False),
])
def test_one_minibatch_warning_claims_equal_updates_only_where_they_are(tmp_path, extra, same):
    """At ratio 1 GSPO, GSPO-token and GRPO share a gradient as per-sequence token means;
    token sums (aggregation=token, Dr. GRPO's constant) and a behaviour correction's token
    weights set them apart: the one-minibatch warning says they agree only where they do
    (each loss bound from the run's objective section, responses of 2 and 4 tokens)."""
    import dataclasses

    from gspo.objectives import objective_from_config

    cfg = _cfg(tmp_path, f"w{len(extra)}", "steps=1", "objective.num_minibatches=1", *extra)
    with pytest.warns(UserWarning, match="every ratio is 1") as record:
        Trainer(cfg, reward_fns=[starts_with_digit]).setup()
    text = " ".join(str(w.message) for w in record if "every ratio is 1" in str(w.message))
    assert ("compute the same update" in text) == same, text
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 5, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 1, 1, 1, 1]] * 2, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    rollout = old + 0.01 * torch.randn(4, 5, generator=gen, dtype=torch.float64)
    grads = {}
    for name in ("gspo", "gspo_token", "grpo"):
        try:
            objective = objective_from_config(dataclasses.replace(cfg.objective, name=name))
        except (ConfigError, ValueError):  # e.g. gspo takes no aggregation=constant
            continue
        logprobs = old.clone().requires_grad_(True)  # θ = θ_old: every ratio is 1
        loss, _ = objective.loss(logprobs, old, adv, mask, rollout_logprobs=rollout)
        (grads[name],) = torch.autograd.grad(loss, logprobs)
    agree = len(grads) == 3 and all(torch.allclose(g, grads["gspo"]) for g in grads.values())
    assert agree == same


def test_logged_lr_is_the_rate_the_steps_updates_ran_at(tmp_path):
    """``train/lr``: the mean learning rate of the step's minibatch updates (warm-up and decay
    move it within a step), not the rate the scheduler holds for the next step's first one."""
    from gspo.trainer.trainer import _lr_lambda

    cfg = _cfg(tmp_path, "lr", "steps=2", "eval_before=false", "task.eval_size=0",
               "objective.num_minibatches=2", "optim.warmup_steps=3", "optim.schedule=linear",
               "logging.samples_every=0")
    trainer = Trainer(cfg, reward_fns=[char_codes]).setup()
    used = []
    trainer.optimizer.register_step_pre_hook(
        lambda opt, *_: used.append(opt.param_groups[0]["lr"]))
    trainer.train()
    factor = _lr_lambda(cfg, 4)
    assert used == pytest.approx([3e-3 * factor(i) for i in range(4)])
    rows = [json.loads(x) for x in open(trainer.run_dir / "metrics.jsonl") if "train/lr" in x]
    assert [r["train/lr"] for r in rows] == pytest.approx([(used[0] + used[1]) / 2,
                                                           (used[2] + used[3]) / 2])


def test_resume_is_bit_identical(tmp_path):
    straight = Trainer(_cfg(tmp_path, "a", "steps=4"), reward_fns=[starts_with_digit]).setup()
    straight.train()
    first = Trainer(_cfg(tmp_path, "b", "steps=2"), reward_fns=[starts_with_digit]).setup()
    first.train()
    resumed = Trainer(_cfg(tmp_path, "ignored", "steps=4", f"resume={first.run_dir}"),
                      reward_fns=[starts_with_digit]).setup()
    assert resumed.step == 2
    resumed.train()
    a, b = _weights(straight.run_dir, 4), _weights(first.run_dir, 4)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    steps = [json.loads(x)["step"] for x in open(first.run_dir / "metrics.jsonl")]
    assert steps == sorted(steps) and steps.count(3) == 1


def test_a_resume_whose_task_does_not_fit_fails_cleanly_and_leaves_the_run_as_it_was(tmp_path):
    """Another task's data position is a one-line ConfigError that names the fix, raised before
    config.yaml and metrics.jsonl change (a resume that fails must not rewrite the run)."""
    from gspo.data.builtin import GSM8K_MINI

    first = Trainer(_cfg(tmp_path, "b", "steps=1"), reward_fns=[starts_with_digit]).setup()
    first.train()
    before = {f: (first.run_dir / f).read_bytes() for f in ("config.yaml", "metrics.jsonl")}
    wrong = _cfg(tmp_path, "ignored", "steps=2", f"resume={first.run_dir}", "task.name=jsonl",
                 f"task.path={GSM8K_MINI}", "task.eval_size=2")
    with pytest.raises(ConfigError, match=r"resume: the checkpoint's data position does not "
                       r"fit task.name=jsonl .*gspo train resume="):
        Trainer(wrong, reward_fns=[starts_with_digit]).setup()
    assert {f: (first.run_dir / f).read_bytes() for f in before} == before


def _one_step(tmp_path, name, *overrides):
    """One training step (lr 1e-2, group 4, no evaluation): the trainer, the step's weights and
    its sequence-ratio spread."""
    t = Trainer(_cfg(tmp_path, name, "steps=1", "eval_before=false", "task.eval_size=0",
                     "rollout.group_size=4", "optim.lr=1e-2", *overrides),
                reward_fns=[char_codes]).setup()
    t.train()
    row = json.loads(open(t.run_dir / "metrics.jsonl").readline())
    assert row["train/grad_norm"] > 1e-3  # the step moved the weights
    return t, _weights(t.run_dir, 1), row["objective/seq_ratio_std"]


def test_packed_and_plain_logprob_paths_give_the_same_update(tmp_path):
    """logprob_packing (each prompt once) and the plain [N, T] pass: one step, same weights
    (lr 1e-2: Adam moves weights by ~1e-2, a wrong log-prob path by as much)."""
    from gspo.models.packing import shared_prefix_logprobs

    out = {}
    for packing in ("true", "false"):
        t, *out[packing] = _one_step(tmp_path, f"p{packing}", "objective.name=grpo",
                                     "objective.eps_low=0.2", "objective.eps_high=0.27",
                                     f"logprob_packing={packing}")
        assert (t.logprob_fn.func is shared_prefix_logprobs) == (packing == "true")
        assert t.logprob_fn.keywords == {"lean": True, "compiled": False, "onednn": False}
    assert out["true"][1] == pytest.approx(out["false"][1], rel=1e-3, abs=1e-7)
    for k in out["true"][0]:  # Adam's first step ≈ lr·sign(g): a gradient entry near zero
        # turns fp32 rounding into up to ~1e-5 of weight; a wrong path moves weights by ~1e-2
        torch.testing.assert_close(out["true"][0][k], out["false"][0][k], rtol=1e-3, atol=1e-4)


def test_matmul_onednn_gives_the_same_update_as_blas(tmp_path, monkeypatch):
    """matmul=onednn (the lean passes' products through oneDNN) against blas: one step, same
    weights and stats to fp32 rounding (lr 1e-2, so a wrong product shows as ~1e-2). auto
    takes oneDNN where gspo.models.onednn.pays says so (here forced), and bad combinations
    are config errors."""
    from gspo.models import onednn

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    out = {}
    for mm in ("onednn", "blas"):
        t, *out[mm] = _one_step(tmp_path, f"m{mm}", f"matmul={mm}")
        assert t.logprob_fn.keywords["onednn"] == (mm == "onednn")
    assert out["onednn"][1] == pytest.approx(out["blas"][1], rel=1e-3, abs=1e-7)
    for k in out["blas"][0]:
        torch.testing.assert_close(out["onednn"][0][k], out["blas"][0][k], rtol=1e-3, atol=1e-4)
    auto = Trainer(_cfg(tmp_path, "auto", "steps=1"), reward_fns=[char_codes]).setup()
    assert auto.logprob_fn.keywords["onednn"] is False  # the tiny preset's layers: too small
    monkeypatch.setattr(onednn, "_cpu", lambda: ("AuthenticAMD", frozenset({"avx512f"})))
    monkeypatch.setattr("gspo.models.decode.packing_pays", lambda m: True)
    auto = Trainer(_cfg(tmp_path, "auto2", "steps=1"), reward_fns=[char_codes]).setup()
    assert auto.logprob_fn.keywords["onednn"] is True
    for bad in (["lean_forward=false"], ["dtype=bfloat16"], ["compile_layers=true"]):
        with pytest.raises(ConfigError, match="matmul=onednn"):
            _cfg(tmp_path, "bad", "matmul=onednn", *bad)


def test_lean_forward_gives_the_same_update_as_forward(tmp_path):
    """lean_forward (the log-prob passes without forward()'s per-call work) against forward:
    one step, same weights and stats; MoE policies take it too, but not compiled."""
    out = {}
    for lean in ("true", "false"):
        t, *out[lean] = _one_step(tmp_path, f"l{lean}", f"lean_forward={lean}")
        assert t.logprob_fn.keywords == {"lean": lean == "true", "compiled": False,
                                          "onednn": False}
    assert out["true"][1] == pytest.approx(out["false"][1], rel=1e-4, abs=1e-8)
    for k in out["true"][0]:  # as above: Adam's first step turns rounding into ~1e-5 of weight
        torch.testing.assert_close(out["true"][0][k], out["false"][0][k], rtol=1e-3, atol=1e-4)
    moe = Trainer(_cfg(tmp_path, "moe", "model=tiny:qwen3_moe", "steps=1"),
                  reward_fns=[char_codes]).setup()
    assert moe.logprob_fn.keywords == {"lean": True, "compiled": False, "onednn": False}
    with pytest.raises(ConfigError, match="compile_layers=true compiles dense decoder layers"):
        Trainer(_cfg(tmp_path, "moe_c", "model=tiny:qwen3_moe", "steps=1",
                     "compile_layers=true"), reward_fns=[char_codes]).setup()


@pytest.mark.slow  # inductor compiles C++ kernels (~1 min on 2 cores, cold cache)
@pytest.mark.skipif(compile_unsupported(torch.device("cpu")) is not None,
                    reason="no C++ compiler for torch.compile's inductor")
def test_compile_layers_gives_the_same_update_as_the_eager_pass(tmp_path):
    """compile_layers=true reaches every log-prob pass of the step (π_old, the update's forward
    and backward) and moves the weights as the eager lean pass does, to fp32 rounding."""
    out = {}
    for compiled in ("true", "false"):
        t, *out[compiled] = _one_step(tmp_path, f"c{compiled}", "objective.num_minibatches=2",
                                      f"compile_layers={compiled}")
        assert t.logprob_fn.keywords == {"lean": True, "compiled": compiled == "true",
                                          "onednn": False}
    assert out["true"][1] == pytest.approx(out["false"][1], rel=1e-3, abs=1e-7)
    for k in out["true"][0]:
        torch.testing.assert_close(out["true"][0][k], out["false"][0][k], rtol=1e-3, atol=1e-4)


def test_old_logprobs_from_inference_mode_come_back_as_normal_tensors(tmp_path):
    """The lean π_old pass runs in inference mode; what it returns (all rows, or some) must be
    usable in place and by autograd like any tensor."""
    from gspo.rollout import pad_batch

    t = Trainer(_cfg(tmp_path, "inf", "steps=1"), reward_fns=[char_codes]).setup()
    assert t.inference
    _, roll = t.rollout()
    batch = pad_batch(roll.prompt_ids, roll.response_ids, t.pad_id, roll.logprobs)
    for rows in (None, torch.tensor([0, 2])):
        lp, ent, _ = t.old_logprobs(batch, rows)
        assert not lp.is_inference() and not ent.is_inference()
        assert (lp != 0).sum() > 0
        lp.add_(0.0)  # an inference tensor refuses in-place updates outside inference mode


def _train_counting_old_passes(trainer, monkeypatch):
    """Train; how many times the trainer ran its log-prob pass (π_old, or π_θ after the
    update), and the metrics rows of the steps."""
    calls = []
    real = trainer.old_logprobs
    monkeypatch.setattr(trainer, "old_logprobs",
                        lambda b, rows=None: calls.append(1) or real(b, rows))
    trainer.train()
    rows = [json.loads(x) for x in open(trainer.run_dir / "metrics.jsonl")]
    return len(calls), [r for r in rows if "reward/mean" in r]


def test_rollout_logprobs_skip_the_old_pass_except_on_check_steps(tmp_path, monkeypatch):
    """objective.old_logprobs=rollout: the π_old pass runs only every rollout_check_every
    steps (for the gap and entropy metrics); the update uses the sampler's log-probs."""
    trainer = Trainer(_cfg(tmp_path, "skip", "steps=3", "eval_before=false", "task.eval_size=0",
                           "objective.old_logprobs=rollout", "logging.rollout_check_every=2"),
                      reward_fns=[starts_with_digit]).setup()
    calls, rows = _train_counting_old_passes(trainer, monkeypatch)
    assert calls == 2  # steps 0 and 2 of 0, 1, 2
    assert ["train/entropy" in r for r in rows] == [True, False, True]
    assert all("objective/clip_frac_tokens" in r for r in rows)


def test_drift_steps_run_the_check_pass_the_drift_is_measured_against(tmp_path, monkeypatch):
    """logging.drift_every with no rollout check on its steps (old_logprobs=rollout,
    rollout_check_every=0): the drift needs π_old on this step's weights, so those steps run
    the π_old pass too and log drift/* (the pass after the update ran, and was thrown away)."""
    trainer = Trainer(_cfg(tmp_path, "drift", "steps=3", "eval_before=false", "task.eval_size=0",
                           "objective.old_logprobs=rollout", "logging.rollout_check_every=0",
                           "logging.drift_every=2"), reward_fns=[starts_with_digit]).setup()
    calls, rows = _train_counting_old_passes(trainer, monkeypatch)
    assert calls == 4  # π_old and the drift pass on steps 0 and 2
    assert ["drift/seq_log_ratio_abs_p50" in r for r in rows] == [True, False, True]
    assert ["mismatch/k3_kl" in r for r in rows] == [True, False, True]


@pytest.mark.parametrize("extra, needle", [
    (["logging.rollout_check_every=2"], "logging.rollout_check_every=2: this run recomputes"),
    (["objective.old_logprobs=decoupled", "objective.correction.name=tis",
      "logging.rollout_check_every=0"], "objective.old_logprobs=decoupled"),
    (["eval_every=2", "task.eval_size=0"], "eval_every=2: there is no held-out set"),
    (["rollout.eval_max_new_tokens=4", "task.eval_size=0"], "rollout.eval_max_new_tokens=4"),
    (["moe.log_routing_change=false"], "moe.log_routing_change need a Mixture-of-Experts"),
    # no π_old pass on any step: train/entropy is never logged, so the signal never fires
    (["objective.old_logprobs=rollout", "logging.rollout_check_every=0",
      "guard.collapse_entropy_floor=0.5"], "guard.collapse_entropy_floor=0.5: train/entropy"),
])
def test_options_this_run_would_not_read_stop_it_at_setup(tmp_path, extra, needle):
    """Options that only the config, the policy and the loop together show to be unused are
    an error at setup, before the run folder is written."""
    with pytest.raises(ConfigError, match=re.escape(needle)):
        Trainer(_cfg(tmp_path, "unused", "steps=1", *extra), reward_fns=[char_codes]).setup()
    assert not (tmp_path / "unused").exists()


def _train_counting_pass_rows(t, monkeypatch):
    """Train ``t``; how many rows each of its trainer passes on this step's weights ran on."""
    seen = []

    def spy(b, rows=None, real=t.old_logprobs):
        seen.append(len(b["input_ids"]) if rows is None else len(rows))
        return real(b, rows)

    monkeypatch.setattr(t, "old_logprobs", spy)
    t.train()
    return seen


@pytest.mark.parametrize("objective", ["gspo", "grpo"])
def test_first_minibatch_forward_as_pi_old_gives_the_same_step(tmp_path, monkeypatch, objective):
    """The π_old pass skips the first minibatch's rows and that minibatch's own forward (at
    θ = θ_old) supplies them: same weights, ratio stats, entropy and sampler gap as the full
    recompute, with the pass run on the other rows only."""
    import gspo.trainer.trainer as trainer_mod

    eps = ("objective.eps_low=0.2", "objective.eps_high=0.27") if objective == "grpo" else ()
    out = {}
    for reuse in (True, False):
        if not reuse:
            monkeypatch.setattr(trainer_mod, "can_reuse_first_forward", lambda *a: False)
        t = Trainer(_cfg(tmp_path, f"r{reuse}{objective}", "steps=2", "eval_before=false",
                         "task.eval_size=0", f"objective.name={objective}", *eps,
                         "objective.num_minibatches=3", "optim.lr=1e-3"),
                    reward_fns=[char_codes]).setup()
        rows_seen = _train_counting_pass_rows(t, monkeypatch)
        assert rows_seen == ([16, 16] if reuse else [24, 24])  # 24 rows in 3 minibatches
        out[reuse] = (_weights(t.run_dir, 2),
                      [json.loads(x) for x in open(t.run_dir / "metrics.jsonl")])
    for k in out[True][0]:
        torch.testing.assert_close(out[True][0][k], out[False][0][k], rtol=1e-3, atol=1e-4)
    for a, b in zip(out[True][1], out[False][1]):
        assert a["train/grad_norm"] > 1e-3
        for key in ("train/entropy", "train/grad_norm", "objective/seq_ratio_mean",
                    "objective/clip_frac_tokens", "reward/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        assert a["rollout/logprob_gap_abs_max"] < 3e-5


def test_dropout_keeps_the_full_pi_old_pass():
    from gspo.models.tiny import build_tiny
    from gspo.trainer.distributed import Dist
    from gspo.trainer.moe_hooks import NO_MOE, MoEHooks
    from gspo.trainer.update import can_reuse_first_forward, has_dropout

    model, _ = build_tiny("llama")
    moe = MoEHooks(build_tiny("qwen3_moe")[0], load_config(None, []).moe)
    assert not has_dropout(model) and can_reuse_first_forward(model, Dist(), NO_MOE)
    assert not can_reuse_first_forward(model, Dist(), moe)  # MoE: π_old routing
    model.config.attention_dropout = 0.1
    assert has_dropout(model) and not can_reuse_first_forward(model, Dist(), NO_MOE)


@pytest.mark.parametrize("extra", [("objective.old_logprobs=rollout",),
                                   ("rollout.async_steps=1",)],
                         ids=["sync-rollout-pi-old", "async-k1"])
def test_first_minibatch_forward_as_this_steps_pass_leaves_pi_old_alone(tmp_path, monkeypatch,
                                                                         extra):
    """Where the trainer's pass measures rather than gives π_old (the engine's log-probs as
    π_old on a ``logging.rollout_check_every`` step; the async loop, whose π_old is the older
    behaviour policy), the first minibatch's forward still supplies the pass's rows at this
    step's weights, but π_old stays what it was: the same weights bit for bit, and the same
    metrics of the pass (sampler gap, entropy, staleness drift) as the full pass, which runs
    on the other rows only."""
    import gspo.trainer.trainer as trainer_mod

    out = {}
    for reuse in (True, False):
        if not reuse:
            monkeypatch.setattr(trainer_mod, "can_reuse_first_forward", lambda *a: False)
        t = Trainer(_cfg(tmp_path, f"r{reuse}", "steps=3", "eval_before=false",
                         "task.eval_size=0", "objective.num_minibatches=3", "optim.lr=1e-2",
                         "logging.rollout_check_every=1", *extra),
                    reward_fns=[char_codes]).setup()
        try:
            rows_seen = _train_counting_pass_rows(t, monkeypatch)
        finally:
            t.cleanup()
        assert rows_seen == ([16] * 3 if reuse else [24] * 3)  # 24 rows in 3 minibatches
        out[reuse] = (_weights(t.run_dir, 3), [json.loads(x) for x in
                                               open(t.run_dir / "metrics.jsonl")
                                               if "train/loss" in x])
    for k in out[True][0]:
        assert torch.equal(out[True][0][k], out[False][0][k]), k
    keys = ["train/entropy", "rollout/logprob_gap_abs_max"]
    if "rollout.async_steps=1" in extra:
        keys += ["async/staleness_drift_abs_max", "async/staleness_drift_mean",
                 "async/behaviour_gap_abs_mean"]
        assert out[True][1][-1]["async/staleness_drift_abs_max"] > 1e-3
    for a, b in zip(out[True][1], out[False][1]):
        assert a["train/loss"] == b["train/loss"]
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=3e-6), key


def constant(prompts, completions, **_):
    return [1.0] * len(completions)


def test_a_resumed_run_keeps_its_zero_signal_streak_and_hides_redone_tensorboard_points(
        tmp_path, capsys):
    """Resumed from the step-2 checkpoint of a run that went on to step 3: the zero-signal
    streak (2 steps) comes back with the checkpoint, so redoing step 3 warns as the run did;
    TensorBoard shows each step once (the first run's step-3 points are past the checkpoint)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    extra = ["steps=3", "save_every=2", "save_final=false", "tensorboard=on",
             "eval_before=false", "task.eval_size=0", "logging.zero_signal_warn_steps=3"]
    first = Trainer(_cfg(tmp_path, "z", *extra), reward_fns=[constant]).setup()
    first.train()
    assert capsys.readouterr().out.count("zero reward variance (3 steps in a row") == 1
    resumed = Trainer(_cfg(tmp_path, "z", *extra, f"resume={first.run_dir}"),
                      reward_fns=[constant]).setup()
    assert resumed.step == 2 and resumed.zero_signal.streak == 2
    resumed.train()
    assert capsys.readouterr().out.count("zero reward variance (3 steps in a row") == 1
    events = EventAccumulator(str(first.run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3]


def test_overlong_counts_the_sampled_tokens_and_evaluation_leaves_it_out(tmp_path, monkeypatch):
    """reward.overlong_buffer: the penalty counts each response's sampled tokens, EOS included
    (re-encoding the decoded text drops EOS, and a byte that is not UTF-8 comes back as several
    tokens); the held-out evaluations score the task without it (a correct answer longer than
    the training budget counted as wrong)."""
    t = Trainer(_cfg(tmp_path, "ol", "steps=1", "task.eval_size=2", "rollout.max_new_tokens=6",
                     "reward.overlong_buffer=3", "rollout.eval_max_new_tokens=8"),
                reward_fns=[char_codes]).setup()
    assert t.scorer.names == ["char_codes", "overlong"]
    overlong, seen, rolls = t.scorer.functions[-1], [], []

    def spy(prompts, completions, *, response_tokens=None, **columns):
        seen.append(response_tokens)
        return overlong(prompts, completions, response_tokens=response_tokens, **columns)

    t.scorer.functions[-1] = spy
    real_rollout = t.rollout

    def rollout(draw=0):
        out = real_rollout(draw)
        rolls.append(out[1])
        return out

    monkeypatch.setattr(t, "rollout", rollout)
    t.train()
    assert len(rolls) == 1 and seen == [[len(r) for r in rolls[0].response_ids]]


def test_evaluation_gives_response_tokens_to_a_reward_that_names_them(tmp_path):
    """A reward function that names ``response_tokens`` gets them in the held-out evaluations
    too: each greedy response's tokens, EOS included, as in training. Evaluation called it
    without them, so every held-out response was unscorable and the run stopped before its
    first step."""
    from gspo.rollout import greedy_generate

    seen = []

    def short(prompts, completions, *, response_tokens, **_):
        seen.append(list(response_tokens))
        return [float(n <= 3) for n in response_tokens]

    t = Trainer(_cfg(tmp_path, "rt", "steps=1", "task.eval_size=3",
                     "rollout.eval_max_new_tokens=5"), reward_fns=[short]).setup()
    out = t.train()
    prompts = [format_prompt(t.tokenizer, ex.prompt, chat_template=True,
                             system_prompt=t.cfg.task.system_prompt)
               for ex in t.task.eval_examples]
    greedy = greedy_generate(t.model, prompts, max_new_tokens=5, eos=t.eos, pad_id=t.pad_id)
    assert seen[-1] == [len(r) for r in greedy]  # the final evaluation's
    assert t.scorer.failures == {}
    assert out["after"]["accuracy"] == sum(len(r) <= 3 for r in greedy) / 3


def test_only_a_reward_that_names_response_tokens_gets_them():
    from gspo.rewards import RewardScorer

    got = {}

    def named(prompts, completions, *, response_tokens, **columns):
        got["named"] = (response_tokens, sorted(columns))
        return [1.0] * len(completions)

    def loose(prompts, completions, **columns):
        got["loose"] = sorted(columns)
        return [1.0] * len(completions)

    scorer = RewardScorer([named, loose], ["named", "loose"], [1.0, 1.0])
    total, _ = scorer(["p", "q"], ["a", "b"], {"answer": ["1", "2"]}, response_tokens=[3, 4])
    assert total == [2.0, 2.0]
    assert got == {"named": ([3, 4], ["answer"]), "loose": ["answer"]}


def test_a_tokenizer_passed_in_without_a_pad_token_gets_its_eos(tmp_path):
    """Llama 3 and Mistral base tokenizers ship without a pad token; the rollout's left
    padding needs one (it stopped the first step with a TypeError)."""
    from gspo.models.tiny import build_tiny

    model, tok = build_tiny("llama")
    tok.pad_token = None
    cfg = _cfg(tmp_path, "nopad", "steps=1", "rollout.max_new_tokens=4",
               "rollout.prompts_per_step=2", "rollout.group_size=2", "task.eval_size=2",
               "eval_before=false")
    trainer = Trainer(cfg, model=model, tokenizer=tok, reward_fns=[starts_with_digit]).setup()
    assert trainer.pad_id == tok.eos_token_id
    assert trainer.train()["steps"] == 1


def test_a_prompt_past_the_models_positions_is_warned_of_once_and_logged(tmp_path):
    """Nothing bounds a prompt's length: one past the model's max_position_embeddings (512 for
    tiny:llama) was sampled and trained on without a word. It still is (a RoPE model runs
    there), but a warning says so once, and rollout/prompt_len_max logs the longest prompt."""
    rows = tmp_path / "long.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i} " + "x" * 600, "answer": "1"}) + "\n"
                            for i in range(4)))
    t = Trainer(_cfg(tmp_path, "long", "steps=2", "eval_before=false", "task.eval_size=0",
                     "task.name=jsonl", f"task.path={rows}", "task.chat_template=false"),
                reward_fns=[char_codes]).setup()
    with pytest.warns(UserWarning, match="past the model's max_position_embeddings=512") as got:
        t.train()
    assert sum("max_position_embeddings" in str(w.message) for w in got) == 1  # once a run
    logged = [json.loads(x) for x in open(t.run_dir / "metrics.jsonl")]
    assert all(row["rollout/prompt_len_max"] >= 600 for row in logged if "step" in row
               and "rollout/prompt_len_max" in row)
    assert any("rollout/prompt_len_max" in row for row in logged)
    short = Trainer(_cfg(tmp_path, "short", "steps=1", "eval_before=false",
                         "task.eval_size=0"), reward_fns=[char_codes]).setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        short._warn_past_context(512)  # prompt + max_new_tokens at the limit: no warning
