"""The FLOPs the benchmarks divide by time are the work each arm does (bench_async, bench_update).

bench_async counts one synchronous gspo step; an async arm's engine runs the π_old pass over
every row and TRL's step runs other passes, so their GFLOP/s and fraction of the FLOP limit
must come from their own work, not from the sync step's.
"""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the benchmarks folder is not an installed package
    sys.path.insert(0, str(ROOT))

TINY = {"model": "tiny:llama", "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4,
        "minibatches": 2, "temperature": 1.0, "lr": 1e-3, "steps": 1, "threads": 1, "seed": 0}


def _child(arm, step):
    """Two steps of ``arm`` (an async arm's last is left out: its pipeline drains there)."""
    return {"arm": arm, "peak_rss_mb": 1.0, "steps": [
        {"step_s": step, "rollout_s": 0.0, "response_tokens": 8, "old_logprobs_s": 0.0}] * 2}


def test_each_arms_flop_rate_is_of_the_work_it_does():
    """By hand: the sync step 10 GFLOP (π_old over the rows outside the first minibatch 1,
    over every row 2); an async arm's engine runs the 2 and its trainer the diagnostic 1
    (none with rollout_check_every=0); TRL's step 17. All take 1 s at 2 threads (limit 20)."""
    from benchmarks import bench_async

    flops = {"total": 10e9, "rollout": 2e9, "old_logprobs": 1e9, "update": 7e9,
             "old_logprobs_all": 2e9}
    trl = {"total": 17e9, "rollout": 4e9, "rest": 13e9}
    arms = ("sync@2", "async1@1+1", "async1-nocheck@1+1", "trl@2")
    s = bench_async.summarize([_child(a, 1.0) for a in arms], 0, flops,
                              {"1": 10.0, "2": 20.0}, trl_flops=trl)["arms"]
    want = {"sync@2": 10.0, "async1@1+1": 12.0, "async1-nocheck@1+1": 11.0, "trl@2": 17.0}
    for arm, gflop in want.items():
        assert s[arm]["work_gflop"] == pytest.approx(gflop)
        assert s[arm]["gflops"] == pytest.approx(gflop)
        assert s[arm]["frac_of_limit"] == pytest.approx(gflop / 20)
        assert s[arm]["sync_work_frac_of_limit"] == pytest.approx(0.5)  # 10 GFLOP in 1 s
    # a result without the counts (an older file): every arm on the sync step's work
    old = bench_async.summarize([_child("trl@2", 1.0)], 0, {"total": 10e9},
                                {"1": 10.0, "2": 20.0})["arms"]["trl@2"]
    assert old["frac_of_limit"] == pytest.approx(0.5)
    _, rows = bench_async.table("m", {"arms": s}, flops, {"1": 10.0, "2": 20.0})
    assert any("| trl@2 | 2 | 1.00 |" in r and "| 17.0 | 17.0 | 85% | 50% |" in r for r in rows)


def test_the_counted_step_also_counts_the_pi_old_pass_over_every_row():
    """count_step_flops on tiny:llama: the pass over every row (the async engine's) is counted
    apart, larger than the sync step's pass over half the rows, and left out of the total."""
    from benchmarks import bench_async

    f = bench_async.count_step_flops(TINY)
    assert f["old_logprobs_all"] > f["old_logprobs"] > 0
    assert f["total"] == pytest.approx(f["rollout"] + f["old_logprobs"] + f["update"])
    assert sum(f["by_op"].values()) == pytest.approx(f["total"])


def test_trl_step_is_counted_on_trl():
    pytest.importorskip("trl")
    from benchmarks import bench_async

    gspo = bench_async.count_step_flops(TINY)
    trl = bench_async.count_trl_flops(TINY)
    assert trl["rollout"] > 0 and trl["rest"] > 0
    # no shared prefill, π_old over every row, the plain [N, T] passes: more work than gspo's
    assert trl["total"] > gspo["total"]
    assert bench_async.arm_work("trl@2", gspo, trl) == trl["total"]


def test_update_benchmark_counts_the_cpu_attention():
    """bench_update.count_flops: a CPU attention call (the lean passes' SDPA) is counted,
    4·b·h·s²·d forward; FlopCounterMode had no formula for the CPU kernel and counted 0."""
    import torch
    import torch.nn.functional as F

    from benchmarks import bench_update

    b, h, s, d = 2, 4, 8, 16
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    with torch.no_grad():
        assert bench_update.count_flops(lambda: F.scaled_dot_product_attention(q, k, v)) == (
            4 * b * h * s * s * d)


def test_count_only_writes_both_steps_work(tmp_path):
    pytest.importorskip("trl")
    from benchmarks import bench_async

    args = ["--model", "tiny:llama", "--prompts-per-step", "2", "--group-size", "2",
            "--max-new-tokens", "4", "--count-only", "--out", str(tmp_path)]
    data = bench_async.main(args)
    assert data["flops_trl"]["total"] > data["flops"]["total"] > 0
    table = (tmp_path / "async_flops_tiny-llama.md").read_text()
    assert "| TRL / gspo | total |" in table and "| gspo (sync) | old_logprobs_all |" in table


def test_flops_mode_counts_in_place_products():
    """``g.addmm_(a, b)`` and ``baddbmm_`` are counted as addmm / baddbmm (torch's registry has
    no in-place entries, so they counted 0): gspo's output layer past its first chunk and TRL's
    fused LM head accumulate their gradient products so. By hand, gspo's head over 2 chunks,
    forward and backward: the logits, their recomputation, ∂h and ∂W, 4 products of 2 M H V."""
    import torch

    from benchmarks import bench_async
    from gspo.models.logprobs import head_logprobs

    a, b, acc = torch.randn(6, 5), torch.randn(5, 3), torch.zeros(6, 3)
    x, y, bacc = torch.randn(2, 6, 5), torch.randn(2, 5, 3), torch.zeros(2, 6, 3)
    with bench_async.flops_mode() as mode:
        acc.addmm_(a, b)
        bacc.baddbmm_(x, y)
    assert mode.by_op == {"aten.addmm": 2 * 6 * 5 * 3, "aten.baddbmm": 2 * 2 * 6 * 5 * 3}

    m, h, v = 24, 8, 40
    hidden = torch.randn(m, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    labels = torch.randint(0, v, (m,))
    with bench_async.flops_mode() as mode:
        head_logprobs(hidden, weight, None, labels, chunk=m // 2)[0].sum().backward()
    assert mode.total == 4 * 2 * m * h * v
