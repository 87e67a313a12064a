"""DAPO dynamic sampling, truncation masking, the zero-signal warning and the whole-step
diagnostics: units on hand-built inputs, then the loop on a tiny model (resume included)."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from gspo.config import ConfigError, load_config
from gspo.objectives import objective_from_config
from gspo.rollout import Rollout
from gspo.trainer import Trainer
from gspo.trainer.diagnostics import StepDiagnostics
from gspo.trainer.dynamic_sampling import (
    Draw,
    ZeroSignalWatch,
    collect,
    mask_truncated,
    signal_groups,
)

pytestmark = pytest.mark.usefixtures("one_thread")
G = 2


def _draw(rewards, tag):
    """A fake scored draw with groups of G; example j of draw ``tag`` is named f"{tag}{j}"."""
    n = len(rewards)
    roll = Rollout([[1]] * n, [[tag, i] for i in range(n)], [torch.zeros(2)] * n,
                   [False] * n, G)
    return Draw([f"{tag}{j}" for j in range(n // G)], roll, torch.tensor(rewards))


def test_signal_groups_needs_two_scorable_different_rewards():
    r = torch.tensor([0.0, 1.0, 1.0, 1.0, math.nan, 1.0, math.nan, math.nan, 0.5, 0.25])
    assert signal_groups(r, 2).tolist() == [True, False, False, False, True]


def test_collect_draws_until_enough_groups_carry_signal():
    first = _draw([0, 1, 1, 1, 0, 0], 0)  # one group with signal of three
    later = {1: _draw([1, 1, 0, 1, 0, 0], 1), 2: _draw([0, 1, 1, 0, 0, 1], 2)}
    seen = []
    got = collect(first, lambda d: seen.append(d) or later[d], prompts_per_step=3,
                  max_extra_batches=5)
    assert seen == [1, 2]  # stops once 3 groups have signal; the surplus of draw 2 is dropped
    assert got.examples == ["00", "11", "20"]
    assert got.rewards.tolist() == [0, 1, 0, 1, 0, 1]
    assert [y[0] for y in got.roll.response_ids] == [0, 0, 1, 1, 2, 2]
    m = got.metrics
    assert (m["dynamic/groups_sampled"], m["dynamic/groups_kept"], m["dynamic/extra_batches"],
            m["dynamic/cap_reached"], m["dynamic/groups_filled"]) == (9, 3, 2, 0, 0)
    assert m["dynamic/responses_sampled"] == 18
    assert m["dynamic/response_tokens_sampled"] == 18 * 2
    assert m["dynamic/zero_signal_frac_sampled"] == pytest.approx(4 / 9)
    assert m["dynamic/sampled_reward_mean"] == pytest.approx(9 / 18)


def test_collect_keeps_each_reward_functions_values_of_the_groups_kept():
    def scored(rewards, tag):
        d = _draw(rewards, tag)
        d.parts = {"a": d.rewards * 10, "b": -d.rewards}
        return d

    got = collect(scored([0, 1, 1, 1], 0), lambda d: scored([1, 1, 1, 0], d),
                  prompts_per_step=2, max_extra_batches=2)
    assert got.examples == ["00", "11"]
    assert got.parts["a"].tolist() == [0, 10, 10, 0] and got.parts["b"].tolist() == [0, -1, -1, 0]


def test_collect_past_the_cap_trains_on_what_it_has_and_tops_up_for_minibatches():
    first = _draw([1, 1, 0, 1, 0, 0], 0)
    got = collect(first, lambda d: _draw([0, 0, 1, 1, 1, 1], d), prompts_per_step=3,
                  max_extra_batches=1)
    assert got.examples == ["01"] and got.metrics["dynamic/cap_reached"] == 1.0
    # 4 minibatches need 4 rows: one zero-signal group (in draw order) joins, advantage 0
    got = collect(first, lambda d: _draw([0, 0, 1, 1, 1, 1], d), prompts_per_step=3,
                  max_extra_batches=1, min_rows=4)
    assert got.examples == ["00", "01"] and got.metrics["dynamic/groups_filled"] == 1.0
    none = collect(_draw([1, 1], 0), lambda d: _draw([0, 0], d), prompts_per_step=1,
                   max_extra_batches=2)
    assert none.examples == ["00"] and none.metrics["dynamic/groups_kept"] == 0.0


def test_collect_keeps_a_full_draw_as_it_is():
    first = _draw([0, 1, 1, 0], 0)
    got = collect(first, lambda d: pytest.fail("no extra draw needed"), prompts_per_step=2,
                  max_extra_batches=3)
    assert got.roll is first.roll and got.rewards is first.rewards


def test_joined_draws_keep_each_rows_observation_mask_and_pipeline_fields():
    """Multi-turn rows carry which tokens the policy sampled; a batch joined from several draws
    must keep each row's mask (it once came back without any, and the update then trained on
    the environment's tokens), and the episode metrics describe the joined rows."""
    def turns_draw(rewards, tag, obs):
        d = _draw(rewards, tag)
        n = len(rewards)
        d.roll.response_ids = [[tag, i] + [9] * obs + [tag] for i in range(n)]
        d.roll.logprobs = [torch.zeros(3 + obs)] * n
        d.roll.model_mask = [[True, True] + [False] * obs + [True]] * n
        d.roll.extras = {"rollout/turns_mean": -1.0}  # the draw's own, not the joined rows'
        d.roll.versions = [tag] * n
        d.roll.trainer_logprobs = [torch.full((3 + obs,), float(tag))] * n
        return d

    first = turns_draw([0, 0, 0, 1], 0, obs=1)  # group 0 flat, group 1 kept
    got = collect(first, lambda d: turns_draw([1, 0, 1, 1], d, obs=3), prompts_per_step=2,
                  max_extra_batches=1)
    assert got.examples == ["01", "10"]
    assert got.roll.model_mask == [[True, True, False, True]] * 2 + [
        [True, True, False, False, False, True]] * 2
    assert got.roll.versions == [0, 0, 1, 1]
    assert [float(t[0]) for t in got.roll.trainer_logprobs] == [0, 0, 1, 1]
    assert got.roll.extras == {"rollout/turns_mean": 2.0, "rollout/model_tokens_mean": 3.0,
                               "rollout/observation_tokens_mean": 2.0}


def test_mask_truncated_zeroes_whole_rows():
    mask = torch.ones(3, 4)
    out = mask_truncated(mask, [False, True, False])
    assert out.tolist() == [[1] * 4, [0] * 4, [1] * 4] and mask.sum() == 12


def test_zero_signal_warning_after_k_steps_once_per_streak():
    watch = ZeroSignalWatch(3)
    seen = [watch.observe({"reward/frac_groups_zero_std": f})
            for f in (0.9, 0.8, 0.75, 0.9, 0.2, 0.6, 0.6, 0.6)]
    assert [s is not None for s in seen] == [False, False, True, False, False, False, False, True]
    assert "task.levels" in seen[2] and "rollout.group_size" in seen[2]
    assert "temperature" in seen[2] and "mostly empty" in seen[2]
    assert ZeroSignalWatch(0).observe({"reward/frac_groups_zero_std": 1.0}) is None
    dyn = ZeroSignalWatch(1).observe({"dynamic/zero_signal_frac_sampled": 0.7,
                                      "reward/frac_groups_zero_std": 0.0})
    assert "discards most rollouts" in dyn


def test_step_diagnostics_reduce_over_the_whole_step():
    cfg = load_config(None, ["objective.name=grpo", "objective.eps_low=0.2",
                             "objective.eps_high=0.27"])
    objective = objective_from_config(cfg.objective)
    torch.manual_seed(0)
    diag, parts = StepDiagnostics(objective, max_new_tokens=8), []
    for _ in range(2):
        mask = torch.zeros(5, 8)
        for i, n in enumerate([1, 3, 5, 8, 0]):
            mask[i, :n] = 1
        old = -torch.rand(5, 8)
        new = old + 0.5 * torch.randn(5, 8)
        adv = torch.randn(5)
        diag.observe(new, old, adv, mask)
        parts.append((new, old, adv, mask))
    m = diag.metrics()
    log_s = torch.cat([((n - o) * k).sum(-1)[k.sum(-1) > 0] / k.sum(-1)[k.sum(-1) > 0]
                       for n, o, _, k in parts]).double()
    for name, q in (("p01", 0.01), ("p50", 0.5), ("p99", 0.99)):
        assert m[f"diag/seq_ratio_{name}"] == pytest.approx(float(log_s.exp().quantile(q)),
                                                            rel=1e-6)
    # bucket q1 (length 1..2 of 8) holds row 0 of both minibatches: its own clip flags
    flags = [((torch.exp(n - o)[0, 0] > 1.27) & (a[0] > 0)) | ((torch.exp(n - o)[0, 0] < 0.8)
                                                             & (a[0] < 0))
             for n, o, a, _ in parts]
    assert m["diag/clip_frac_len_q1"] == pytest.approx(sum(map(float, flags)) / 2)
    assert set(m) >= {"diag/seq_ratio_p01", "diag/seq_ratio_p99", "diag/clip_frac_len_q4"}


# --------------------------------------------------------------------- the loop, tiny model


def first_char_is_digit(prompts, completions, **_):
    """Most groups of a random tiny model get all-equal rewards with it: little signal."""
    return [float(bool(c) and c[0].isdigit()) for c in completions]


def char_codes(prompts, completions, **_):
    """Rewards that differ within almost every group."""
    return [float(sum(map(ord, c)) % 97) for c in completions]


def _cfg(tmp_path, name, *extra):
    return load_config(None, [
        "model=tiny:llama", f"output_dir={tmp_path}", f"run_name={name}", "progress=false",
        "tensorboard=false", "rollout.max_new_tokens=5", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "rollout.temperature=1.0", "objective.num_minibatches=2",
        "task.eval_size=2", "rollout.eval_max_new_tokens=2", "optim.lr=3e-3", *extra])


def _weights(run_dir, step):
    return load_file(f"{run_dir}/checkpoints/step_{step:06d}/model.safetensors")


def _rows(run_dir):
    return [json.loads(x) for x in open(run_dir / "metrics.jsonl")]


def test_dynamic_sampling_with_signal_everywhere_is_the_plain_step(tmp_path):
    runs = {}
    for flag in ("false", "true"):
        t = Trainer(_cfg(tmp_path, f"dyn_{flag}", "steps=2", f"rollout.dynamic_sampling={flag}"),
                    reward_fns=[char_codes]).setup()
        t.train()
        runs[flag] = t.run_dir
    a, b = _weights(runs["false"], 2), _weights(runs["true"], 2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    row = _rows(runs["true"])[-2]
    assert row["dynamic/extra_batches"] == 0 and row["dynamic/groups_kept"] == 2


def test_dynamic_sampling_draws_more_and_resumes_bit_exactly(tmp_path):
    extra = ["rollout.dynamic_sampling=true", "rollout.dynamic_max_extra_batches=2"]
    straight = Trainer(_cfg(tmp_path, "a", "steps=3", *extra),
                       reward_fns=[first_char_is_digit]).setup()
    straight.train()
    first = Trainer(_cfg(tmp_path, "b", "steps=1", *extra),
                    reward_fns=[first_char_is_digit]).setup()
    first.train()
    resumed = Trainer(_cfg(tmp_path, "x", "steps=3", f"resume={first.run_dir}", *extra),
                      reward_fns=[first_char_is_digit]).setup()
    resumed.train()
    a, b = _weights(straight.run_dir, 3), _weights(first.run_dir, 3)
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows_a = [r for r in _rows(straight.run_dir) if "dynamic/groups_sampled" in r]
    rows_b = [r for r in _rows(first.run_dir) if "dynamic/groups_sampled" in r]
    keys = ("dynamic/groups_sampled", "dynamic/groups_kept", "reward/mean",
            "diag/seq_ratio_p50", "objective/clip_frac_tokens")
    assert [[r[k] for k in keys] for r in rows_a] == [[r[k] for k in keys] for r in rows_b]
    assert sum(r["dynamic/extra_batches"] for r in rows_a) > 0  # the reward is sparse here
    assert all(r["dynamic/groups_sampled"] >= r["dynamic/groups_kept"] for r in rows_a)


def zero(prompts, completions, **_):
    """A second reward term that adds nothing: the total is first_char_is_digit's."""
    return [0.0] * len(completions)


def test_extra_draws_count_in_reward_terms_and_rollout_throughput(tmp_path):
    """With extra draws, ``reward/<name>`` is over the groups trained on, as ``reward/mean``
    (it was the first draw's), and ``perf/rollout_tokens_per_s`` counts the tokens of every
    draw the rollout time was spent on (it counted the kept rows only)."""
    t = Trainer(_cfg(tmp_path, "parts", "steps=2", "rollout.dynamic_sampling=true",
                     "rollout.dynamic_max_extra_batches=2"),
                reward_fns=[first_char_is_digit, zero]).setup()
    sampled, rollout = [], t.rollout

    def counting(draw=0):
        examples, roll = rollout(draw=draw)
        sampled.append(sum(len(y) for y in roll.response_ids))
        return examples, roll

    t.rollout = counting
    extra = 0.0
    for _ in range(2):
        sampled.clear()
        m = t.train_step()
        extra += m["dynamic/extra_batches"]
        assert m["reward/first_char_is_digit"] == pytest.approx(m["reward/mean"])
        assert m["reward/zero"] == 0.0
        assert m["dynamic/response_tokens_sampled"] == sum(sampled)
        assert m["perf/rollout_tokens_per_s"] * m["time/rollout_s"] == pytest.approx(sum(sampled))
    assert extra > 0  # the reward is sparse here: the case in question ran


def test_mask_truncated_gives_truncated_responses_no_loss_weight(tmp_path):
    t = Trainer(_cfg(tmp_path, "m", "steps=1", "rollout.mask_truncated=true"),
                reward_fns=[char_codes]).setup()
    examples, roll = t.rollout()
    # the random tiny model rarely samples EOS within 5 tokens: mark half the rows as finished
    roll.truncated = [i % 2 == 0 for i in range(len(roll))]
    rewards, _ = t.score(examples, roll)
    plan = t.plan(roll)
    batch, _ = t.update_batch(roll, t.advantages(rewards, roll), plan)
    assert any(roll.truncated) and not all(roll.truncated)
    for i, cut in enumerate(roll.truncated):
        assert (batch.response_mask[i].sum() == 0) == cut
    assert float(t.objective.row_weights(batch.response_mask).sum()) == roll.truncated.count(False)


def test_an_unused_dynamic_option_is_a_config_error():
    with pytest.raises(ConfigError, match="dynamic_sampling=false"):
        load_config(None, ["rollout.dynamic_max_extra_batches=2"])


def test_dynamic_sampling_with_r3_replays_the_experts_of_every_joined_row(tmp_path):
    """An MoE policy with Routing Replay R3: joined draws keep the experts the sampler chose
    for each row, re-padded to the joined batch's layout. The sampler and the trainer's π_old
    pass run the same fp32 code on the same weights, so every expert the sampler recorded is
    the one π_old chose (``moe/rollout_routing_mismatch`` = 0); a misaligned join would not
    be."""
    rows = []
    t = Trainer(_cfg(tmp_path, "r3", "steps=3", "model=tiny:qwen3_moe",
                     "moe.routing_replay=r3", "objective.name=grpo", "objective.eps_low=0.2",
                     "objective.eps_high=0.27", "rollout.dynamic_sampling=true",
                     "rollout.dynamic_max_extra_batches=2"),
                reward_fns=[first_char_is_digit]).setup()
    try:
        t.train()
    finally:
        t.cleanup()
    rows = [r for r in _rows(t.run_dir) if "dynamic/groups_sampled" in r]
    assert sum(r["dynamic/extra_batches"] for r in rows) > 0  # rows were joined
    assert all(r["moe/rollout_routing_mismatch"] == 0.0 for r in rows)


def test_each_rank_takes_its_groups_advantages_when_a_capped_batch_splits_unevenly():
    """Under torchrun a batch past the cap may hold fewer groups than prompts_per_step; each
    rank's advantages are its own contiguous groups' of the global batch, split by the
    batch's group count (2 groups on 2 ranks: one each), not by prompts_per_step."""
    from types import SimpleNamespace

    from gspo.config import TrainConfig
    from gspo.objectives import compute_advantages
    from gspo.trainer.distributed import Dist

    cfg = TrainConfig()
    cfg.rollout.prompts_per_step, g = 4, 2
    rewards = torch.tensor([0.0, 1.0, 3.0, 5.0])  # 2 groups kept
    want = compute_advantages(cfg.objective.advantage, rewards, g,
                              scale=cfg.objective.scale_rewards)
    for rank in range(2):
        me = SimpleNamespace(cfg=cfg, dist=Dist(rank=rank, world_size=2), stand_ins=None)
        roll = Rollout([[1]] * g, [[2]] * g, [torch.zeros(1)] * g, [False] * g, g)
        got = Trainer.advantages(me, rewards, roll)
        assert torch.equal(got, want[rank * g:(rank + 1) * g])


def test_stand_ins_get_zero_advantage_and_stay_out_of_the_batch_std():
    """scale_rewards=batch on 2 ranks with a stand-in group (rank 1's): the trained group's
    advantages are one process's, whose batch holds that group only (before, the stand-in's
    rewards entered the batch std and rescaled them); the stand-in's are 0."""
    from types import SimpleNamespace

    from gspo.config import TrainConfig
    from gspo.objectives import ADVANTAGES
    from gspo.trainer.distributed import Dist

    cfg = TrainConfig()
    cfg.objective.scale_rewards, g = "batch", 2
    rewards = torch.tensor([0.0, 1.0, 3.0, 3.0])  # group 1: rank 1's stand-in
    want = ADVANTAGES[cfg.objective.advantage](rewards[:g], g, scale="batch")
    stand_ins = torch.tensor([False, False, True, True])
    roll = Rollout([[1]] * g, [[2]] * g, [torch.zeros(1)] * g, [False] * g, g)
    got = [Trainer.advantages(SimpleNamespace(cfg=cfg, dist=Dist(rank=rank, world_size=2),
                                              stand_ins=stand_ins), rewards, roll)
           for rank in range(2)]
    assert torch.allclose(got[0], want) and torch.equal(got[1], torch.zeros(g))


def test_the_samples_file_holds_the_groups_trained_on(tmp_path):
    """With extra draws the samples are the rows the update trains on (each draw's scoring
    left its own rows there, so they were the last draw's, groups that may have been
    dropped), with each function's values, one function too."""
    t = Trainer(_cfg(tmp_path, "samples", "steps=2", "rollout.dynamic_sampling=true",
                     "rollout.dynamic_max_extra_batches=2", "logging.samples_every=1"),
                reward_fns=[first_char_is_digit]).setup()
    trained, update_batch = [], t.update_batch

    def spy(roll, adv, plan):
        trained.append(t.tokenizer.batch_decode(roll.response_ids, skip_special_tokens=True))
        return update_batch(roll, adv, plan)

    t.update_batch = spy
    extra = 0.0
    for _ in range(2):
        m = t.train_step()
        extra += m["dynamic/extra_batches"]
        prompts, completions, rewards, per_fn, _ = t.last_samples
        assert completions == trained[-1] and len(prompts) == len(completions)
        assert per_fn["first_char_is_digit"] == rewards
        assert "reward/first_char_is_digit" not in m  # one function: reward/mean says it
    assert extra > 0  # the case in question ran


def test_collect_tops_up_to_min_groups_with_stand_ins_it_does_not_count_as_filled():
    """Under torchrun every rank needs a group: past the cap with fewer groups than ranks, the
    zero-signal groups that join only for that are stand-ins (listed, not counted in
    ``dynamic/groups_filled``), so the trainer can keep them out of the update."""
    first = _draw([1, 1, 0, 1, 0, 0], 0)
    got = collect(first, lambda d: _draw([0, 0, 1, 1, 1, 1], d), prompts_per_step=3,
                  max_extra_batches=1, min_groups=3)
    assert got.examples == ["00", "01", "02"] and got.stand_ins == [0, 2]
    assert got.metrics["dynamic/groups_filled"] == 0.0
    got = collect(first, lambda d: _draw([0, 0, 1, 1, 1, 1], d), prompts_per_step=3,
                  max_extra_batches=1, min_rows=4, min_groups=2)  # the filled group suffices
    assert got.examples == ["00", "01"] and got.stand_ins == []


def test_collect_lists_the_stand_ins_of_a_first_draw_it_keeps_whole():
    """prompts_per_step = 2 on 2 ranks, one group with signal: the other joins only as rank
    1's stand-in, which makes every group of the first draw chosen. The draw's own tensors are
    kept, with that group still listed as a stand-in (before, the list was dropped, and the
    step trained on it: reward/mean 0.25 against one process's 0.5, the loss diluted)."""
    first = _draw([1, 0, 0, 0], 0)
    got = collect(first, lambda d: pytest.fail("no extra draw allowed"), prompts_per_step=2,
                  max_extra_batches=0, min_rows=2, min_groups=2)
    assert got.roll is first.roll and got.stand_ins == [1]
    assert got.metrics["dynamic/groups_filled"] == 0.0
    got = collect(first, lambda d: pytest.fail("no extra draw allowed"), prompts_per_step=2,
                  max_extra_batches=0, min_rows=2)  # one process: the signal group only
    assert got.examples == ["00"] and got.stand_ins == []


def slow_first_char_is_digit(prompts, completions, **kw):
    """:func:`first_char_is_digit`, scored slowly (a sandboxed or remote reward)."""
    import time

    time.sleep(SCORE_S)
    return first_char_is_digit(prompts, completions, **kw)


SCORE_S = 0.2


def test_async_rollout_throughput_leaves_out_the_extra_draws_scoring(tmp_path):
    """At k = 1 ``perf/rollout_tokens_per_s`` divides every draw's tokens by the engine's
    time on the pipeline's batch plus the time the extra draws took to sample; it added all of
    ``dynamic/extra_s``, which also holds their scoring (a slow reward made the throughput
    look many times lower than the synchronous loop's, which never counts scoring)."""
    t = Trainer(_cfg(tmp_path, "tps", "steps=2", "rollout.async_steps=1",
                     "rollout.dynamic_sampling=true", "rollout.dynamic_max_extra_batches=2"),
                reward_fns=[slow_first_char_is_digit]).setup()
    try:
        t.train()
    finally:
        t.cleanup()
    rows = [r for r in _rows(t.run_dir) if "dynamic/groups_sampled" in r]
    assert sum(r["dynamic/extra_batches"] for r in rows) > 0  # the case in question ran
    for r in rows:
        seconds = r["dynamic/response_tokens_sampled"] / r["perf/rollout_tokens_per_s"]
        assert seconds >= r["time/rollout_engine_s"] - 1e-6
        # every extra draw was scored for at least SCORE_S, none of it sampling time
        scored = SCORE_S * r["dynamic/extra_batches"]
        assert seconds <= r["time/rollout_engine_s"] + r["dynamic/extra_s"] - scored + 1e-6
