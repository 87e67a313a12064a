"""The guard: numerical faults and collapse signals lead to rollback, lower_lr or stop;
SIGINT/SIGTERM finish the step and checkpoint (a second one abandons it)."""

from __future__ import annotations

import copy
import json
import math
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from gspo.cli import EXIT_GUARD_STOP, main
from gspo.config import GuardConfig, load_config
from gspo.trainer import Trainer
from gspo.trainer import guard as guard_module
from gspo.trainer import reliability as reliability_module
from gspo.trainer.guard import Guard, GuardStop
from gspo.trainer.update import _all_finite

FAST = ["model=tiny:llama", "progress=false", "tensorboard=false", "num_threads=1",
        "rollout.max_new_tokens=4", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "rollout.temperature=1.0", "objective.num_minibatches=2", "task.eval_size=0",
        "eval_before=false", "optim.lr=3e-3"]


def first_char_mod7(prompts, completions, **_):
    """Varied rewards within a group, so every step really updates the weights."""
    return [float(ord(c[0]) % 7) if c else 0.0 for c in completions]


def _trainer(tmp_path, name, *extra, **kw):
    cfg = load_config(None, [*FAST, f"output_dir={tmp_path}", f"run_name={name}", *extra])
    return Trainer(cfg, reward_fns=[first_char_mod7], **kw).setup()


def _rows(trainer):
    return [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]


def _ckpt(trainer, step):
    return trainer.run_dir / "checkpoints" / f"step_{step:06d}"


def _poison(monkeypatch, trainer, bad_steps, corrupt_at=None):
    """Log-probs are NaN during ``bad_steps``; at ``corrupt_at`` the weights are wrecked first
    (what a bad update would leave behind)."""
    real_logprobs, real_step = trainer.logprob_fn, trainer.train_step

    def logprobs(*args, **kwargs):
        lp, ent = real_logprobs(*args, **kwargs)
        return (lp * math.nan if trainer.step + 1 in bad_steps else lp), ent

    def train_step():
        if trainer.step + 1 == corrupt_at:
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.add_(1.0)
        return real_step()

    monkeypatch.setattr(trainer, "logprob_fn", logprobs)
    monkeypatch.setattr(trainer, "train_step", train_step)


# ----------------------------------------------------------------------------- unit


def _guard(**kw):
    return Guard(GuardConfig(**kw))


def test_fault_streak_fires_after_k_consecutive_and_resets():
    g = _guard(max_consecutive_faults=2)
    assert g.observe({"train/skipped_updates": 1}) is None
    assert g.observe({"train/skipped_updates": 0}) is None  # the streak is broken
    assert g.observe({"train/skipped_updates": 2}) is None
    assert "2 consecutive steps" in g.observe({"train/skipped_updates": 1})
    assert g.metrics() == {"guard/faults": 3, "guard/consecutive_faults": 2,
                           "guard/rollbacks": 0}
    g.acted(rolled_back=True)
    assert g.metrics()["guard/rollbacks"] == 1 and g.consecutive == 0
    never = _guard(max_consecutive_faults=0)
    assert all(never.observe({"train/skipped_updates": 4}) is None for _ in range(10))


def test_collapse_signals():
    assert "entropy" in _guard(collapse_entropy_floor=0.5).observe({"train/entropy": 0.1})
    assert _guard(collapse_entropy_floor=0.5).observe({"train/entropy": math.nan}) is None
    assert "ratio" in _guard(collapse_ratio_ceiling=2).observe({"objective/seq_ratio_max": 3})
    assert _guard().observe({"train/entropy": 0.0, "objective/seq_ratio_max": 1e9}) is None

    g = _guard(collapse_reward_drop=0.5, collapse_window=2)
    verdicts = [g.observe({"reward/mean": r}) for r in (1.0, 1.0, 0.9, 0.6, 0.2, 0.1)]
    assert verdicts[:4] == [None] * 4  # windows 1.0, 0.95, 0.75: at most 0.25 below the best
    assert "fell 0.6 below its best (1)" in verdicts[4]  # window mean 0.4


def test_with_dynamic_sampling_the_reward_drop_reads_every_sampled_response():
    """Dynamic sampling keeps groups with reward variance, so reward/mean stays near the middle
    of the range while the sampled responses' mean collapses: the guard reads the latter."""
    g = _guard(collapse_reward_drop=0.5, collapse_window=2)
    steps = [{"reward/mean": 0.5, "dynamic/sampled_reward_mean": r} for r in (0.9, 0.9, 0.1, 0.1)]
    verdicts = [g.observe(m) for m in steps]
    assert verdicts[:3] == [None] * 3 and "fell 0.8 below its best (0.9)" in verdicts[3]


def test_a_step_with_nothing_scored_is_not_a_reward_drop():
    """A reward outage (reward.max_unscorable_frac=1 lets the run go on) leaves no reward mean:
    reward/mean is 0 then, which the reward-drop window read as a collapse and rolled back
    healthy weights for; dynamic sampling's mean is NaN then, and skipped."""
    g = _guard(collapse_reward_drop=0.5, collapse_window=1)
    assert g.observe({"reward/mean": 1.0, "reward/unscorable_frac": 0.0}) is None
    assert g.observe({"reward/mean": 0.0, "reward/unscorable_frac": 1.0}) is None
    assert list(g.recent_rewards) == [1.0]
    assert "fell 0.8 below" in g.observe({"reward/mean": 0.2, "reward/unscorable_frac": 0.5})


def test_only_checkpoints_written_while_healthy_are_good():
    g = _guard(collapse_entropy_floor=1.0, max_consecutive_faults=3)
    g.observe({"train/entropy": 2.0})
    g.saved(1)
    g.observe({"train/entropy": 2.0, "train/skipped_updates": 1})  # a streak starts
    g.saved(2)
    assert g.last_good_step == 1
    g.observe({"train/entropy": 2.0})
    g.saved(3)
    assert g.last_good_step == 3
    assert g.observe({"train/entropy": 0.5})  # a signal nobody acted on (guard.on_fault=stop)
    g.saved(4)
    assert g.last_good_step == 3
    g.acted(rolled_back=True)
    g.saved(5)
    assert g.last_good_step == 5


def test_guard_state_round_trips_and_decides_identically():
    kw = {"collapse_reward_drop": 0.3, "collapse_window": 3, "max_consecutive_faults": 3}
    a, b = _guard(**kw), _guard(**kw)
    for r in (1.0, 0.9, 0.8):
        a.observe({"reward/mean": r, "train/skipped_updates": 1})
    a.saved(3)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for m in ({"reward/mean": 0.1, "train/skipped_updates": 0}, {"reward/mean": 0.0}):
        assert a.observe(m) == b.observe(m)
    assert a.state_dict() == b.state_dict()


def test_non_finite_log_probs_are_caught_on_response_tokens_only():
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    lp, old, loss = torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor(0.5)
    assert _all_finite(loss, lp, old, mask)
    padded = old.clone()
    padded[1, 2] = -math.inf  # padding: ignored
    assert _all_finite(loss, lp, padded, mask)
    for bad in (-math.inf, math.nan):
        old_bad, lp_bad = old.clone(), lp.clone()
        old_bad[0, 1] = lp_bad[1, 1] = bad
        assert not _all_finite(loss, lp, old_bad, mask)  # a clipped loss may still be finite
        assert not _all_finite(loss, lp_bad, old, mask)
    assert not _all_finite(torch.tensor(math.nan), lp, old, mask)


# ----------------------------------------------------------------------------- in the loop


@pytest.mark.parametrize("action", ["rollback", "lower_lr"])
def test_fault_streak_rolls_back_to_the_last_good_checkpoint(tmp_path, monkeypatch, capsys,
                                                              action):
    # keep_checkpoints=1: step_2, the last good checkpoint, must outlive the streak's saves.
    trainer = _trainer(tmp_path, action, "steps=5", "save_every=1", "keep_checkpoints=1",
                       "guard.max_consecutive_faults=2", f"guard.on_fault={action}")
    _poison(monkeypatch, trainer, bad_steps={3, 4}, corrupt_at=3)
    seen = {}
    real_roll_back = guard_module.roll_back

    def roll_back(ckpt, model, optimizer, scheduler, **kw):
        seen["before"] = {k: v.clone() for k, v in model.state_dict().items()}
        seen["restored"] = real_roll_back(ckpt, model, optimizer, scheduler, **kw)
        seen["ckpt"], seen["after"] = ckpt, {k: v.clone() for k, v in model.state_dict().items()}
        seen["on_disk"] = load_file(ckpt / "model.safetensors")
        seen["moments"] = torch.load(ckpt / "optimizer.pt", weights_only=True)["optimizer"]
        seen["live"] = copy.deepcopy(optimizer.state_dict())  # step 5 updates it in place
        return seen["restored"]

    monkeypatch.setattr(reliability_module, "roll_back", roll_back)
    trainer.train()
    out = capsys.readouterr().out
    assert "guard: step 4: 2 consecutive steps with updates skipped" in out
    assert "guard: rolled back to step_000002" in out
    assert seen["ckpt"].name == "step_000002" and seen["restored"] == 2
    key = "model.norm.weight"
    assert not torch.equal(seen["before"][key], seen["on_disk"][key])  # wrecked at step 3
    assert all(torch.equal(seen["after"][k], seen["on_disk"][k]) for k in seen["on_disk"])
    for i, st in seen["moments"]["state"].items():
        assert torch.equal(st["exp_avg"], seen["live"]["state"][i]["exp_avg"])
    rows = {r["step"]: r for r in _rows(trainer) if "reward/mean" in r}
    assert [rows[s]["train/skipped_updates"] for s in range(1, 6)] == [0, 0, 2, 2, 0]
    assert [rows[s]["guard/faults"] for s in range(1, 6)] == [0, 0, 1, 2, 2]
    assert [rows[s]["guard/rollbacks"] for s in range(1, 6)] == [0, 0, 0, 1, 1]
    lr = [rows[s]["train/lr"] for s in range(1, 6)]
    assert lr[:4] == [3e-3] * 4
    assert lr[4] == pytest.approx(1.5e-3 if action == "lower_lr" else 3e-3, rel=1e-12)
    if action == "lower_lr":  # the lower lr and the guard's counts survive a resume
        resumed = _trainer(tmp_path, "x", "steps=6", f"resume={trainer.run_dir}",
                           "guard.on_fault=lower_lr")
        assert resumed.scheduler.get_last_lr()[0] == pytest.approx(1.5e-3, rel=1e-12)
        assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(1.5e-3, rel=1e-12)
        resumed.train()
        last = [r for r in _rows(resumed) if "reward/mean" in r][-1]
        assert last["step"] == 6 and last["guard/rollbacks"] == 1
        assert last["train/lr"] == pytest.approx(1.5e-3, rel=1e-12)


def rollback_at(monkeypatch, trainer, step):
    """The guard fires after ``step`` (a collapse signal, say), whatever the metrics."""
    guard = trainer.reliability.guard
    real = guard.observe
    monkeypatch.setattr(guard, "observe", lambda m: "injected" if trainer.step == step
                        else real(m))


def test_after_a_rollback_an_engine_with_its_own_copy_samples_the_restored_weights(
        tmp_path, monkeypatch):
    """rollout.precision=bf16 samples from a copy that the trainer syncs after each update;
    after a rollback the copy must hold the restored weights before the next rollout, not the
    discarded ones of the update that was just undone."""
    trainer = _trainer(tmp_path, "copy", "steps=4", "save_every=1", "rollout.precision=bf16")
    rollback_at(monkeypatch, trainer, step=2)
    engine, seen = trainer.engine, []
    real_generate = engine.generate

    def generate(*args, **kwargs):
        seen.append(all(torch.equal(c, p.to(c.dtype)) for c, p in
                        zip(engine.model.parameters(), trainer.model.parameters(), strict=True)))
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", generate)
    trainer.train()
    assert [r["guard/rollbacks"] for r in _rows(trainer) if "reward/mean" in r] == [0, 1, 1, 1]
    assert seen == [True] * 4


@pytest.mark.parametrize("model", ["tiny:llama", "tiny:qwen3_moe", "tiny:mixtral"])
def test_a_rollback_restores_the_weights_the_checkpoint_was_written_from(tmp_path, monkeypatch,
                                                                         model):
    """The policy after a rollback holds, exactly, the weights it held when the checkpoint
    was written. A Mixture-of-Experts checkpoint keeps its fused expert tensors as one tensor
    per expert on disk (transformers 5), so a rollback that read the files as they are failed
    on every MoE policy ("weights do not match the model")."""
    trainer = _trainer(tmp_path, "w", "steps=3", "save_every=1", f"model={model}")
    rollback_at(monkeypatch, trainer, step=2)
    saved, before, after = {}, {}, {}
    real_save, real_respond = trainer.save_checkpoint, trainer.reliability.respond

    def weights():
        return {k: v.clone() for k, v in trainer.model.state_dict().items()}

    def save_checkpoint():
        saved[trainer.step] = weights()
        return real_save()

    def respond(*args, **kwargs):
        before[trainer.step] = weights()
        out = real_respond(*args, **kwargs)
        after[trainer.reliability.restored_step] = weights()
        return out

    monkeypatch.setattr(trainer, "save_checkpoint", save_checkpoint)
    monkeypatch.setattr(trainer.reliability, "respond", respond)
    trainer.train()
    assert list(before) == [2] and list(after) == [1]  # after step 2, back to step 1's
    assert saved[1].keys() == after[1].keys()
    assert all(torch.equal(after[1][k], saved[1][k]) for k in saved[1])
    assert any(not torch.equal(saved[1][k], before[2][k]) for k in saved[1])  # step 2 moved


def test_a_rollback_keeps_the_optim_values_of_a_resumed_run(tmp_path, monkeypatch):
    """`gspo train resume=RUN optim.lr=...` applies the new optim values; a rollback to a
    checkpoint the first run wrote loads its moments, not its betas, weight decay and base lr
    (they came back with the checkpoint's optimizer state, and a later resume scaled the lr by
    the first run's base lr: 1e-3 became 1e-3 x 1e-3 / 3e-3)."""
    first = _trainer(tmp_path, "o", "steps=1", "save_every=1")
    first.train()
    first.cleanup()
    new = ["optim.lr=1e-3", "optim.weight_decay=0.1", "optim.betas=[0.5,0.9]", "save_every=1",
           f"resume={first.run_dir}"]
    resumed = _trainer(tmp_path, "x", "steps=2", *new)
    rollback_at(monkeypatch, resumed, step=2)  # back to step_000001, written by the first run
    resumed.train()
    assert resumed.reliability.restored_step == 1
    group = resumed.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-3, (0.5, 0.9), 0.1)
    assert group["initial_lr"] == 1e-3
    resumed.cleanup()
    again = _trainer(tmp_path, "x", "steps=3", *new)
    group = again.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-3, (0.5, 0.9), 0.1)
    assert again.scheduler.base_lrs == [1e-3]


@pytest.mark.parametrize("extra, why", [
    (["save_every=1", "guard.max_rollbacks=1"], "rolled back 1 times already"),
    (["save_every=0"], "no checkpoint to roll back to"),
])
def test_rollback_gives_up_into_a_stop(tmp_path, extra, why):
    trainer = _trainer(tmp_path, "r", "steps=4", "guard.collapse_ratio_ceiling=0.5", *extra)
    with pytest.raises(GuardStop, match=why):
        trainer.train()
    stopped = 2 if "save_every=1" in extra else 1
    assert trainer.step == stopped
    assert _rows(trainer)[-1]["step"] == stopped  # the step that stopped it is logged ...
    assert (_ckpt(trainer, stopped) / "state.json").is_file()  # ... and checkpointed


def test_stop_from_the_cli_exits_3_with_a_clear_message(tmp_path, capsys):
    code = main(["train", *FAST, f"output_dir={tmp_path}", "run_name=s", "steps=3",
                 "guard.on_fault=stop", "guard.collapse_entropy_floor=100"])
    err = capsys.readouterr().err
    assert code == EXIT_GUARD_STOP
    assert "guard stopped the run at step 1: entropy" in err
    assert f"{tmp_path}/s/checkpoints/step_000001" in err
    assert (tmp_path / "s" / "checkpoints" / "step_000001" / "state.json").is_file()


# ----------------------------------------------------------------------------- signals


def _signal_during_step(monkeypatch, trainer, step, times=1):
    real = trainer.train_step

    def train_step():
        if trainer.step + 1 == step:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGTERM)
        return real()

    monkeypatch.setattr(trainer, "train_step", train_step)


def test_sigterm_finishes_the_step_then_checkpoints(tmp_path, monkeypatch, capsys):
    trainer = _trainer(tmp_path, "t", "steps=5", "save_every=0")
    _signal_during_step(monkeypatch, trainer, step=2)
    before = signal.getsignal(signal.SIGTERM)
    result = trainer.train()
    assert result["interrupted"] and result["steps"] == trainer.step == 2
    out = capsys.readouterr().out
    assert f"interrupted at step 2; resume with: gspo train resume={trainer.run_dir}\n" in out
    assert (_ckpt(trainer, 2) / "state.json").is_file()  # written although save_every=0
    assert not (trainer.run_dir / "final_eval.json").exists()
    assert signal.getsignal(signal.SIGTERM) is before


def test_second_signal_abandons_the_step(tmp_path, monkeypatch, capsys):
    trainer = _trainer(tmp_path, "t2", "steps=5", "save_every=1")
    _signal_during_step(monkeypatch, trainer, step=2, times=2)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    out = capsys.readouterr().out
    assert "work in progress abandoned; resume from step_000001" in out
    assert not _ckpt(trainer, 2).exists()
    assert [r["step"] for r in _rows(trainer)] == [1]
    assert signal.getsignal(signal.SIGTERM) is before
