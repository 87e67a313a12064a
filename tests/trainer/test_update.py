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
