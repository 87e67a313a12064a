"""Stat reductions (gspo.trainer.metrics): declared kinds, minibatch means, cross-rank pooling.

Cross-rank pooling is checked in one process: each "rank" runs ``reduce_stats`` against a fake
``all_reduce`` that returns the elementwise sum / max of what every rank passed at that call.
"""

from __future__ import annotations

import math

import pytest
import torch

from gspo.trainer.metrics import max_over_ranks, mean_stats, reduce_stats, rollout_metrics

KINDS = {"objective/clip_frac_tokens": "tokens", "objective/seq_ratio_mean": "rows",
         "objective/seq_ratio_std": "std", "objective/seq_ratio_max": "max",
         "objective/seq_ratio_min": "min", "train/grad_norm": "rank", "train/loss": "weight"}


def _t(d: dict[str, float]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v) for k, v in d.items()}


def _pooled(per_rank: list[tuple[list[dict], list[dict]]], kinds=KINDS) -> list[list[dict]]:
    """Run reduce_stats on every rank as if the ranks met at each all_reduce."""
    sent: list[list[torch.Tensor]] = [[] for _ in per_rank]
    for r, (stats, counts) in enumerate(per_rank):  # pass 1: record what each rank sends
        def record(t, op="sum", r=r):
            sent[r].append(t.clone())
            return t
        reduce_stats(stats, counts, record, kinds)
    out = []
    for stats, counts in per_rank:  # pass 2: every call returns the reduction over ranks
        calls = iter(range(len(sent[0])))

        def combine(t, op="sum", calls=calls):
            i = next(calls)
            parts = torch.stack([s[i] for s in sent])
            return parts.sum(0) if op == "sum" else parts.max(0).values
        out.append(reduce_stats(stats, counts, combine, kinds))
    return out


RANK0 = (_t({"objective/clip_frac_tokens": 0.5, "objective/seq_ratio_mean": 1.0,
             "objective/seq_ratio_std": 0.1, "objective/seq_ratio_max": 1.2,
             "objective/seq_ratio_min": 0.9, "train/grad_norm": 2.0, "train/loss": 0.3}),
         {"rows": 2.0, "tokens": 10.0, "weight": 2.0})
RANK1 = (_t({"objective/clip_frac_tokens": 0.25, "objective/seq_ratio_mean": 2.0,
             "objective/seq_ratio_std": 0.2, "objective/seq_ratio_max": 1.5,
             "objective/seq_ratio_min": 0.7, "train/grad_norm": 4.0, "train/loss": 0.6}),
         {"rows": 1.0, "tokens": 30.0, "weight": 1.0})
# The hand-computed global values of that one minibatch.
EXPECTED = {
    "objective/clip_frac_tokens": (0.5 * 10 + 0.25 * 30) / 40,  # token-weighted
    "objective/seq_ratio_mean": (1.0 * 2 + 2.0 * 1) / 3,  # row-weighted
    # pooled: E[x²] over the rows of both ranks minus the global mean squared
    "objective/seq_ratio_std": math.sqrt(((0.01 + 1.0) * 2 + (0.04 + 4.0) * 1) / 3 - (4 / 3) ** 2),
    "objective/seq_ratio_max": 1.5,
    "objective/seq_ratio_min": 0.7,
    "train/grad_norm": 3.0,  # each rank's own value, averaged over ranks
    "train/loss": (0.3 * 2 + 0.6 * 1) / 3,  # Σ w·loss / Σ w
}


def test_cross_rank_pooling_matches_hand_values():
    per_rank = [([RANK0[0]], [RANK0[1]]), ([RANK1[0]], [RANK1[1]])]
    for rank_out in _pooled(per_rank):
        (row,) = rank_out
        assert set(row) == set(EXPECTED)
        for k, v in EXPECTED.items():
            assert float(row[k]) == pytest.approx(v, rel=1e-6), k


def test_a_rank_without_rows_does_not_count():
    """A rank that ran a stand-in row (zero counts) must not move any global value, its
    extremes included."""
    empty = (_t({k: 100.0 for k in KINDS}), {"rows": 0.0, "tokens": 0.0, "weight": 0.0})
    alone = _pooled([([RANK0[0]], [RANK0[1]])])[0][0]
    with_empty = _pooled([([RANK0[0]], [RANK0[1]]), ([empty[0]], [empty[1]])])
    for rank_out in with_empty:
        for k in KINDS:
            assert float(rank_out[0][k]) == pytest.approx(float(alone[k]), rel=1e-6), k


def test_every_stat_needs_a_declared_kind():
    stats = [{**RANK0[0], "objective/new_stat": torch.tensor(1.0)}]
    with pytest.raises(KeyError, match="objective/new_stat"):
        reduce_stats(stats, [RANK0[1]], lambda t, op="sum": t, KINDS)
    with pytest.raises(KeyError, match="objective/new_stat"):
        mean_stats(stats, KINDS)


def test_mean_stats_reads_kinds_not_names():
    """Over minibatches: min/max kinds take the extreme, everything else the mean, whatever
    the key's name says."""
    stats = [_t({"a_max": 1.0, "b": 1.0, "c": 5.0}), _t({"a_max": 3.0, "b": 4.0, "c": 2.0})]
    out = mean_stats(stats, {"a_max": "rows", "b": "max", "c": "min"})
    assert out == {"a_max": 2.0, "b": 4.0, "c": 2.0}
    assert mean_stats([], {}) == {}


def test_mean_stats_leaves_out_a_minibatch_without_valid_rows():
    """A minibatch whose rows are all masked (rollout.mask_truncated) returns placeholder
    stats (0; under torchrun ±inf extremes): they change neither the step's ratio mean nor its
    minimum, in one process as over ranks; only the ``rank`` kinds keep it."""
    kinds = {"r_mean": "rows", "r_min": "min", "r_max": "max", "loss": "weight",
             "gnorm": "rank"}
    full = {"rows": 2.0, "tokens": 5.0, "signal_rows": 2.0, "signal_tokens": 5.0, "weight": 2.0}
    empty = dict.fromkeys(full, 0.0)
    stats = [_t({"r_mean": 0.98, "r_min": 0.97, "r_max": 0.99, "loss": 0.5, "gnorm": 2.0}),
             _t({"r_mean": 0.0, "r_min": 0.0, "r_max": 0.0, "loss": 0.0, "gnorm": 0.0})]
    out = mean_stats(stats, kinds, [full, empty])
    assert out["r_mean"] == pytest.approx(0.98) and out["r_min"] == pytest.approx(0.97)
    assert out["r_max"] == pytest.approx(0.99) and out["loss"] == pytest.approx(0.5)
    assert out["gnorm"] == pytest.approx(1.0)
    over_ranks = [stats[0], _t({"r_mean": 0.0, "r_min": math.inf, "r_max": -math.inf,
                                "loss": 0.0, "gnorm": 0.0})]
    assert mean_stats(over_ranks, kinds, [full, empty])["r_min"] == pytest.approx(0.97)
    assert mean_stats(stats[1:], kinds, [empty])["r_min"] == 0.0


SIGNAL_KINDS = {"objective/clip_frac_seqs_signal": "signal_rows",
                "objective/clip_frac_tokens_signal": "signal_tokens"}


def test_signal_fractions_pool_over_rows_with_signal_only():
    """Across ranks a ``signal_*`` fraction is weighted by each rank's rows (tokens) with
    Â ≠ 0, not by all its rows: a rank whose rows all have Â = 0 moves nothing."""
    c0 = {"rows": 4.0, "tokens": 20.0, "signal_rows": 2.0, "signal_tokens": 8.0, "weight": 4.0}
    c1 = {"rows": 4.0, "tokens": 20.0, "signal_rows": 0.0, "signal_tokens": 0.0, "weight": 4.0}
    c2 = {"rows": 2.0, "tokens": 12.0, "signal_rows": 2.0, "signal_tokens": 12.0, "weight": 2.0}
    s0 = _t({"objective/clip_frac_seqs_signal": 0.5, "objective/clip_frac_tokens_signal": 0.25})
    s1 = _t({"objective/clip_frac_seqs_signal": 0.0, "objective/clip_frac_tokens_signal": 0.0})
    s2 = _t({"objective/clip_frac_seqs_signal": 1.0, "objective/clip_frac_tokens_signal": 0.5})
    out = _pooled([([s0], [c0]), ([s1], [c1]), ([s2], [c2])], SIGNAL_KINDS)
    for (row,) in out:
        assert float(row["objective/clip_frac_seqs_signal"]) == pytest.approx(3 / 4)
        assert float(row["objective/clip_frac_tokens_signal"]) == pytest.approx(8 / 20)


def test_mean_stats_weights_signal_fractions_by_each_minibatchs_signal_rows():
    """Over minibatches the ``signal_*`` kinds are weighted by their rows (tokens) with signal
    (a minibatch of zero-advantage groups adds nothing); without counts, the plain mean."""
    stats = [_t({"objective/clip_frac_seqs_signal": s, "objective/clip_frac_tokens_signal": t})
             for s, t in ((0.5, 0.3), (0.0, 0.0), (1.0, 0.6))]
    counts = [{"signal_rows": 4.0, "signal_tokens": 10.0},
              {"signal_rows": 0.0, "signal_tokens": 0.0},
              {"signal_rows": 2.0, "signal_tokens": 20.0}]
    out = mean_stats(stats, SIGNAL_KINDS, counts)
    assert out["objective/clip_frac_seqs_signal"] == pytest.approx((0.5 * 4 + 1.0 * 2) / 6)
    assert out["objective/clip_frac_tokens_signal"] == pytest.approx((3 + 12) / 30)
    none = [{"signal_rows": 0.0, "signal_tokens": 0.0}] * 3
    assert mean_stats(stats, SIGNAL_KINDS, none)["objective/clip_frac_seqs_signal"] == 0.0
    assert mean_stats(stats, SIGNAL_KINDS)["objective/clip_frac_seqs_signal"] == 0.5


class _TwoRanks:
    """A world of two where the other rank sends ``other`` (keys in sorted order)."""

    enabled = True

    def __init__(self, other: list[float]) -> None:
        self.other, self.ops = torch.tensor(other, dtype=torch.float64), []

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.ops.append(op)
        return torch.maximum(t, self.other) if op == "max" else t + self.other


def test_max_over_ranks_logs_the_slowest_ranks_engine():
    """Each key's value is the larger of the two ranks', whichever rank has it."""
    mine = {"time/rollout_engine_s": 2.0, "async/engine_sync_s": 0.25,
            "time/publish_send_s": 1.0}
    world = _TwoRanks([0.5, 1.5, 3.0])  # async/engine_sync_s, time/publish_send_s, time/rollout…
    assert max_over_ranks(mine, world) == {"time/rollout_engine_s": 3.0,
                                           "async/engine_sync_s": 0.5,
                                           "time/publish_send_s": 1.5}
    assert world.ops == ["max"]
    assert max_over_ranks({}, world) == {} and world.ops == ["max"]  # nothing to send
    one = type("One", (), {"enabled": False})()
    assert max_over_ranks(mine, one) == mine


def test_extremes_over_minibatches_skip_those_without_rows():
    """A minibatch whose rows all have zero loss weight (rollout.mask_truncated) returns the
    objective's 0 for its empty min/max; one process must not log that 0 as the step's
    smallest ratio, as the torchrun path (which drops rank-minibatches without rows) does not."""
    full = _t({"objective/seq_ratio_min": 0.9, "objective/seq_ratio_max": 1.1,
               "objective/seq_ratio_mean": 1.0})
    empty = _t({"objective/seq_ratio_min": 0.0, "objective/seq_ratio_max": 0.0,
                "objective/seq_ratio_mean": 0.0})
    counts = [{"rows": 4.0, "tokens": 20.0}, {"rows": 0.0, "tokens": 0.0}]
    one = mean_stats([full, empty], KINDS, counts)
    assert one["objective/seq_ratio_min"] == pytest.approx(0.9)
    assert one["objective/seq_ratio_max"] == pytest.approx(1.1)
    pooled = mean_stats(_pooled([([full, empty], [{**c, "weight": c["rows"]} for c in counts])])[0],
                        KINDS, counts)
    assert pooled["objective/seq_ratio_min"] == pytest.approx(one["objective/seq_ratio_min"])
    # nothing with rows at all: the values as they are
    assert mean_stats([empty], KINDS, counts[1:])["objective/seq_ratio_min"] == 0.0


def test_entropy_over_no_response_tokens_is_nan_not_zero():
    """rollout.mask_truncated with every response truncated: no token to average the entropy
    over. It was logged as 0.0, which guard.collapse_entropy_floor read as a collapse."""
    from types import SimpleNamespace

    from gspo.config import GuardConfig
    from gspo.rollout import Rollout
    from gspo.trainer.guard import Guard

    roll = Rollout([[7], [7]], [[1, 2, 3], [4, 5, 6]], [torch.zeros(3)] * 2, [True, True], 2)
    mask = torch.zeros(2, 5)
    batch = {"response_mask": mask, "attention_mask": torch.ones(2, 5, dtype=torch.long)}
    one = SimpleNamespace(enabled=False, all_reduce=lambda t, op="sum": t)
    entropy = torch.full((2, 5), 2.0)
    out = rollout_metrics(roll, batch, entropy, torch.zeros(2), {"rollout": 1.0, "update": 1.0},
                          1, one)
    assert math.isnan(out["train/entropy"])
    assert math.isnan(out["rollout/logprob_gap_abs_max"])  # measured on no token either
    assert Guard(GuardConfig(collapse_entropy_floor=0.1)).observe(out) is None
    mask[0, 2:] = 1.0
    out = rollout_metrics(roll, batch, entropy, torch.zeros(2), {"rollout": 1.0, "update": 1.0},
                          1, one)
    assert out["train/entropy"] == pytest.approx(2.0)


def test_rollout_lengths_and_truncation_leave_out_stand_in_rows():
    """Dynamic sampling's stand-in rows (torchrun) join no minibatch: the response lengths,
    truncated fraction and update throughput describe the other rows, as one process (which
    has no stand-ins) logs them."""
    from types import SimpleNamespace

    from gspo.rollout import Rollout

    one = SimpleNamespace(enabled=False, all_reduce=lambda t, op="sum": t)
    t = {"rollout": 1.0, "update": 1.0}

    def batch(rows):
        return {"response_mask": torch.ones(len(rows), 6), "attention_mask": torch.tensor(
            [[1] * (1 + len(r)) + [0] * (6 - len(r)) for r in rows])}

    rows = [[1, 2], [3, 4, 5], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]]
    truncated = [False, False, True, True]
    roll = Rollout([[7]] * 4, rows, [torch.zeros(len(r)) for r in rows], truncated, 2)
    kept = Rollout([[7]] * 2, rows[:2], [torch.zeros(len(r)) for r in rows[:2]],
                   truncated[:2], 2)
    got = rollout_metrics(roll, batch(rows), None, None, t, 1, one,
                          stand_ins=torch.tensor([False, False, True, True]))
    want = rollout_metrics(kept, batch(rows[:2]), None, None, t, 1, one)
    sampled = "perf/rollout_tokens_per_s"  # the stand-ins were sampled: their tokens count
    assert got.pop(sampled) == 17.0 and want.pop(sampled) == 5.0
    assert got == pytest.approx(want)
    assert got["rollout/truncated_frac"] == 0.0 and got["rollout/response_len_max"] == 3.0
