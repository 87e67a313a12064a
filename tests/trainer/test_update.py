"""The policy update (gspo.trainer.update): its plan, what it returns, what it never touches."""

from __future__ import annotations

import math

import pytest
import torch

from gspo.config import ObjectiveConfig
from gspo.models import token_logprobs
from gspo.models.tiny import build_tiny
from gspo.objectives import objective_from_config
from gspo.rollout import pad_batch
from gspo.trainer.update import UpdateBatch, UpdatePlan, plan_update, policy_update


def _batch(model, n: int = 6, seed: int = 0) -> UpdateBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 250, (4,), generator=g).tolist() for _ in range(n)]
    responses = [torch.randint(3, 250, (int(torch.randint(1, 5, (1,), generator=g)),),
                               generator=g).tolist() for _ in range(n)]
    b = pad_batch(prompts, responses, pad_id=0)
    with torch.no_grad():
        lp, _ = token_logprobs(model, b["input_ids"], b["attention_mask"], b["response_mask"])
    old = (lp + 0.01 * torch.randn(lp.shape, generator=g)) * b["response_mask"]
    return UpdateBatch(b["input_ids"], b["attention_mask"], b["response_mask"], old,
                       torch.randn(n, generator=g))


def _run(model, batch, plan, **kw):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    objective = objective_from_config(ObjectiveConfig(num_minibatches=len(plan.minibatches[0])))
    return policy_update(model, opt, sched, batch, plan, objective=objective, temperature=1.0,
                         chunk=5, grad_clip=1.0, **kw)


def test_plan_is_a_sorted_partition_per_epoch_drawn_like_randperm():
    plan = plan_update(10, num_minibatches=3, epochs=2, generator=torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(4)
    for minibatches in plan.minibatches:
        expected = torch.randperm(10, generator=g).tensor_split(3)
        assert [mb.tolist() for mb in minibatches] == [sorted(e.tolist()) for e in expected]
        assert sorted(torch.cat(minibatches).tolist()) == list(range(10))
    assert plan.old_pass_rows(10) is None
    reuse = UpdatePlan(plan.minibatches, old_from_first=True)
    rest = reuse.old_pass_rows(10)
    assert sorted(rest.tolist() + plan.minibatches[0][0].tolist()) == list(range(10))


def test_first_minibatch_gives_pi_old_without_writing_into_the_input():
    model, _ = build_tiny("llama")
    batch = _batch(model)
    before = batch.old_logprobs.clone()
    with torch.no_grad():  # π at the initial weights: what the first forward must return
        at_start, _ = token_logprobs(model, batch.input_ids, batch.attention_mask,
                                     batch.response_mask)
    plan = plan_update(6, num_minibatches=2, epochs=2, generator=torch.Generator().manual_seed(1),
                       old_from_first=True)
    result = _run(model, batch, plan)
    assert torch.equal(batch.old_logprobs, before)  # the caller's tensor is left alone
    first = plan.minibatches[0][0]
    assert torch.equal(result.first_rows, first)
    width = result.first_entropy.shape[1]
    torch.testing.assert_close(result.old_logprobs[first, :width], at_start[first, :width],
                               rtol=1e-5, atol=1e-6)
    others = plan.old_pass_rows(6)
    assert torch.equal(result.old_logprobs[others], before[others])
    assert len(result.stats) == 4 and result.skipped == 0
    assert float(result.stats[0]["train/grad_norm"]) > 0  # ratio 1 at the first step: unclipped


def test_non_finite_pi_old_skips_the_step_and_leaves_the_weights():
    model, _ = build_tiny("llama")
    batch = _batch(model)
    batch.old_logprobs[batch.response_mask > 0] = math.inf
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    plan = plan_update(6, num_minibatches=3, epochs=1, generator=torch.Generator())
    result = _run(model, batch, plan)
    assert result.skipped == 3 and result.stats == []
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_old_from_first_needs_one_process():
    model, _ = build_tiny("llama")

    class TwoRanks:  # just enough of Dist for the check
        enabled = True

    plan = plan_update(6, num_minibatches=2, epochs=1, generator=torch.Generator(),
                       old_from_first=True)
    with pytest.raises(ValueError, match="one process"):
        _run(model, _batch(model), plan, dist=TwoRanks())


def _objective(num_minibatches: int):
    return objective_from_config(ObjectiveConfig(num_minibatches=num_minibatches))


def test_the_forward_runs_at_the_sampling_temperature():
    """The first minibatch's π_old is log_softmax(logits / T) at the rollout's temperature."""
    model, _ = build_tiny("llama")
    batch = _batch(model)
    with torch.no_grad():
        at_t, _ = token_logprobs(model, batch.input_ids, batch.attention_mask,
                                 batch.response_mask, temperature=0.6)
    plan = plan_update(6, num_minibatches=2, epochs=1, generator=torch.Generator().manual_seed(1),
                       old_from_first=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    result = policy_update(model, opt, sched, batch, plan, objective=_objective(2),
                           temperature=0.6, chunk=5, grad_clip=1.0)
    first, width = result.first_rows, result.first_entropy.shape[1]
    torch.testing.assert_close(result.old_logprobs[first, :width], at_t[first, :width],
                               rtol=1e-5, atol=1e-6)


def test_the_scheduler_steps_once_per_minibatch_step():
    model, _ = build_tiny("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    plan = plan_update(6, num_minibatches=2, epochs=2, generator=torch.Generator().manual_seed(2))
    result = policy_update(model, opt, sched, _batch(model), plan, objective=_objective(2),
                           temperature=1.0, chunk=5, grad_clip=1.0)
    assert result.skipped == 0
    assert result.lrs == pytest.approx([1e-3, 1e-3 / 2, 1e-3 / 3, 1e-3 / 4])
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 / 5)


def test_grad_clip_bounds_the_update_and_the_logged_norm_is_before_clipping():
    """With SGD at lr 1 the parameter change is the clipped gradient: its norm is at most
    ``grad_clip``, while ``train/grad_norm`` reports the norm before clipping."""
    model, _ = build_tiny("llama")
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    plan = plan_update(6, num_minibatches=1, epochs=1, generator=torch.Generator().manual_seed(3))
    clip = 1e-4
    result = policy_update(model, opt, sched, _batch(model), plan, objective=_objective(1),
                           temperature=1.0, chunk=5, grad_clip=clip)
    moved = torch.stack([(p.detach() - b).pow(2).sum()
                         for p, b in zip(model.parameters(), before)]).sum().sqrt()
    assert float(result.stats[0]["train/grad_norm"]) > 10 * clip
    assert 0 < float(moved) <= clip * (1 + 1e-3)


def test_counts_take_rows_with_a_negative_advantage_as_signal():
    """``signal_rows`` / ``signal_tokens``: rows with Â ≠ 0 (either sign) and their tokens."""
    model, _ = build_tiny("llama")
    batch = _batch(model)
    batch.advantages = torch.tensor([-1.0, 0.0, 2.0, -0.5, 0.0, 0.3])
    plan = plan_update(6, num_minibatches=1, epochs=1, generator=torch.Generator().manual_seed(4))
    result = _run(model, batch, plan)
    on = batch.response_mask > 0
    signal = batch.advantages != 0
    (counts,) = result.counts
    assert counts["rows"] == 6 and counts["tokens"] == float(on.sum())
    assert counts["signal_rows"] == 4
    assert counts["signal_tokens"] == float(on[signal].sum())


def test_rank_multipliers_give_the_gradient_of_the_global_mean():
    """Σ_ranks share_r · (Σ_local w_i x_i / Σ_local w_i), averaged over the W ranks (what DDP's
    gradient average does), is the global weighted mean Σ w_i x_i / Σ w_i."""
    from gspo.trainer.distributed import Dist
    from gspo.trainer.update import _local_rows

    w = torch.tensor([3.0, 1.0, 0.0, 2.0, 5.0, 4.0])  # global row weights, 3 rows per rank
    x = torch.tensor([0.5, -1.0, 7.0, 2.0, 0.25, -3.0])
    mb = torch.tensor([0, 1, 3, 4, 5])
    total = 0.0
    for rank in range(2):
        local, share, empty = _local_rows(mb, 3 * rank, 3, w, Dist(rank=rank, world_size=2))
        g = local + 3 * rank
        assert not empty
        total += share * float((w[g] * x[g]).sum() / w[g].sum())
    assert total / 2 == pytest.approx(float((w[mb] * x[mb]).sum() / w[mb].sum()))


def test_a_non_finite_policy_log_prob_skips_the_step_even_when_the_loss_is_finite():
    """A −inf log π_θ on a response token gives GSPO a finite loss (the ratio is clamped
    before exp) and a finite gradient: the step must still be skipped."""
    model, _ = build_tiny("llama")
    batch = _batch(model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []

    def broken(*args, **kwargs):
        lp, ent = token_logprobs(*args, **kwargs)
        on = args[3] > 0
        first = on.float().argmax(-1)  # each row's first response token
        hit = torch.zeros_like(on)
        hit[torch.arange(on.shape[0]), first] = True
        out = lp.masked_fill(hit & on, -math.inf)
        loss, _ = _objective(1).loss(out, batch.old_logprobs[:out.shape[0], :out.shape[1]],
                                     torch.ones(out.shape[0]), args[3])
        seen.append(bool(torch.isfinite(loss)))
        return out, ent

    plan = plan_update(6, num_minibatches=1, epochs=1, generator=torch.Generator())
    result = _run(model, batch, plan, logprob_fn=broken)
    assert seen == [True]  # the loss alone would not have caught it
    assert result.skipped == 1 and result.stats == []
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_a_minibatch_without_a_valid_row_takes_no_optimizer_step():
    """Every response of a minibatch masked (e.g. all truncated under rollout.mask_truncated):
    its gradient is zero, but AdamW's momentum and weight decay would still move the weights.
    The step is skipped (counted in ``empty``, not as a fault): the weights, the lr schedule
    and the stats are those of the update without that minibatch."""
    def run(minibatches):
        model, _ = build_tiny("llama")
        batch = _batch(model)
        batch.response_mask[3:] = 0.0
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
        plan = UpdatePlan([[torch.tensor(mb) for mb in minibatches]])
        result = policy_update(model, opt, sched, batch, plan,
                               objective=_objective(len(minibatches)), temperature=1.0, chunk=5,
                               grad_clip=1.0)
        return model.state_dict(), opt.param_groups[0]["lr"], result

    with_empty, lr, result = run([[0, 1, 2], [3, 4, 5]])
    without, want_lr, want = run([[0, 1, 2]])
    assert all(torch.equal(with_empty[k], without[k]) for k in without)
    assert result.empty == 1 and result.skipped == 0 and want.empty == 0
    assert lr == want_lr == pytest.approx(1e-3 / 2)  # the schedule advanced once
    assert len(result.stats) == 1 and result.counts == want.counts
    assert float(result.stats[0]["train/grad_norm"]) == float(want.stats[0]["train/grad_norm"])
