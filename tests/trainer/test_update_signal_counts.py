"""The signal counts the update returns (which weight ``objective/clip_frac_*_signal`` over
minibatches and ranks) are those of the rows the loss itself calls signal: with a behaviour
correction that zeroes a row's weight (mis, icepop, offpolicy_mask), that row is no longer one."""

from __future__ import annotations

import pytest
import torch

from gspo.config import CorrectionConfig, ObjectiveConfig
from gspo.models import token_logprobs
from gspo.models.tiny import build_tiny
from gspo.objectives import objective_from_config
from gspo.rollout import pad_batch
from gspo.trainer.metrics import reduce_stats
from gspo.trainer.moe_hooks import NO_MOE
from gspo.trainer.update import UpdateBatch, UpdatePlan, _counts, policy_update, stat_kinds


def _masked_rows_objective(num_minibatches: int):
    """GSPO with a sequence-level masked-IS correction (cap 2): a row whose π_old / π_rollout
    geometric mean exceeds 2 gets weight 0."""
    return objective_from_config(ObjectiveConfig(
        eps_low=0.2, eps_high=0.2, num_minibatches=num_minibatches, old_logprobs="decoupled",
        correction=CorrectionConfig(name="mis", level="sequence")))


def test_counts_leave_out_rows_a_correction_masks():
    """Rows 0 and 4 are masked by ``mis`` (π_rollout far below π_old): the loss's signal
    fractions leave them out, so must the ``signal_rows`` / ``signal_tokens`` counts."""
    model, _ = build_tiny("llama")
    g = torch.Generator().manual_seed(0)
    n = 8
    prompts = [torch.randint(3, 250, (4,), generator=g).tolist() for _ in range(n)]
    responses = [torch.randint(3, 250, (3 + i % 3,), generator=g).tolist() for i in range(n)]
    b = pad_batch(prompts, responses, pad_id=0)
    with torch.no_grad():
        lp, _ = token_logprobs(model, b["input_ids"], b["attention_mask"], b["response_mask"])
    old = lp * b["response_mask"]
    rollout = old.clone()
    masked = torch.tensor([0, 4])
    rollout[masked] -= 5.0 * b["response_mask"][masked]  # ρ_i = e^5 > cap: weight 0
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0, -2.0, 1.5, -0.5, 0.25])
    batch = UpdateBatch(b["input_ids"], b["attention_mask"], b["response_mask"], old, adv,
                        rollout_logprobs=rollout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    plan = UpdatePlan([[torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 6, 7])]])
    result = policy_update(model, opt, sched, batch, plan, objective=_masked_rows_objective(2),
                           temperature=1.0, chunk=5, grad_clip=1.0)
    on = b["response_mask"] > 0
    for mb, counts in zip(plan.minibatches[0], result.counts):
        signal = (adv[mb] != 0) & ~torch.isin(mb, masked)
        assert counts["signal_rows"] == float(signal.sum())
        assert counts["signal_tokens"] == float(on[mb][signal].sum())
        assert counts["rows"] == float(len(mb))


def test_signal_clip_fractions_of_two_ranks_equal_one_process():
    """The same minibatch held by one process and split over two ranks: every objective stat,
    the signal clip fractions included, reduces to the one process's value."""
    torch.manual_seed(1)
    n, t = 8, 9
    mask = torch.zeros(n, t)
    for i, length in enumerate([9, 2, 0, 5, 1, 7, 3, 4]):
        mask[i, :length] = 1
    old = -torch.rand(n, t, dtype=torch.float64) * 3
    logp = old + torch.randn(n, t, dtype=torch.float64) * 0.3
    rollout = old + torch.randn(n, t, dtype=torch.float64) * 0.05
    rollout[:3] -= 1.0  # rows 0-2: ρ_i = e > cap 2, weight 0
    adv = torch.randn(n, dtype=torch.float64)
    adv[3] = adv[7] = 0.0
    objective = _masked_rows_objective(1)
    kinds = stat_kinds(objective, NO_MOE)

    def run(rows):
        _, stats = objective.loss(logp[rows], old[rows], adv[rows], mask[rows],
                                  rollout_logprobs=rollout[rows])
        seen = objective.seen_advantages(logp[rows], old[rows], adv[rows], mask[rows],
                                         rollout_logprobs=rollout[rows])
        return stats, _counts(mask[rows], seen, float(objective.row_weights(mask[rows]).sum()))

    whole, _ = run(torch.arange(n))
    assert 0 < float(whole["objective/clip_frac_seqs_signal"]) < 1  # the case is not trivial
    parts = [run(torch.arange(4)), run(torch.arange(4, n))]
    sent: list[list[torch.Tensor]] = [[], []]
    for (stats, counts), out in zip(parts, sent):
        reduce_stats([stats], [counts], lambda x, op, out=out: out.append(x) or x, kinds)
    totals = iter([sent[0][0] + sent[1][0], torch.maximum(sent[0][1], sent[1][1])])
    (two,) = reduce_stats([parts[0][0]], [parts[0][1]], lambda x, op: next(totals), kinds)
    for key, value in whole.items():
        assert float(two[key]) == pytest.approx(float(value), abs=1e-6), key
