"""Smoke runs of the benchmark scripts at tiny scale (the numbers themselves are not checked).

The fast lane covers every gspo-side path in-process; the TRL arm and the TRL objective
comparison import TRL (slow to import, an optional extra) and run in the slow lane.
"""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the benchmarks folder is not an installed package
    sys.path.insert(0, str(ROOT))

TINY = {"model": "tiny:llama", "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4,
        "minibatches": 2, "temperature": 1.0, "lr": 1e-3, "steps": 2, "threads": 1, "seed": 0}


def test_rollout_benchmark_writes_results(tmp_path):
    from benchmarks import bench_rollout

    data = bench_rollout.main(["--model", "tiny:llama", "--reps", "1", "--group-size", "2",
                               "--max-new-tokens", "4", "--greedy-prompts", "3",
                               "--out", str(tmp_path)])
    assert data["greedy_check"]["all_equal"]
    assert json.loads((tmp_path / "rollout_tiny-llama_story.json").read_text())["summary"]
    assert (tmp_path / "rollout_tiny-llama_story.md").read_text().count("|") > 10


def test_gspo_arms_and_summary():
    from benchmarks import bench_vs_trl

    results = []
    for arm in ("gspo", "gspo_rollout_lp"):
        r = bench_vs_trl.run({**TINY, "arm": arm})
        r["peak_rss_mb"] = 1.0
        assert len(r["steps"]) == 2 and all(s["step_cpu_s"] > 0 for s in r["steps"])
        results.append(r)
    summary = bench_vs_trl.summarize(results, warmup=1, clock="cpu")
    assert set(summary["arms"]) == {"gspo", "gspo_rollout_lp"}
    assert summary["arms"]["gspo_rollout_lp"]["tokens"] > 0
    assert summary["arms"]["gspo_rollout_lp"]["old_logprobs_s"] == 0  # no π_old pass
    assert summary["arms"]["gspo"]["old_logprobs_s"] > 0
    header, rows = bench_vs_trl.table("tiny:llama", 1, {"cpu": summary})
    assert len(rows) == 2 and header.startswith("|")


def test_update_benchmark_and_memory_step(tmp_path):
    from benchmarks import bench_update

    data = bench_update.main(["--model", "tiny:llama", "--reps", "1", "--group-size", "2",
                              "--response-len", "4", "--skip", "memory", "--square", "0",
                              "--peak-gflop", "0.05", "--out", str(tmp_path)])
    u = data["update"]
    assert u["plain"]["gflop"] > u["packed"]["gflop"] > 0  # packing executes fewer FLOPs
    for variant in bench_update.MEMORY_VARIANTS:
        for mode in bench_update.MEMORY_MODES:
            m = bench_update.memory_child({"variant": variant, "mode": mode, "vocab": 512,
                                           "hidden": 32, "T": 64, "chunk": 16})
            assert m["extra_peak_mb"] >= 0 and m["value"] < 0


def test_noise_floor_benchmark(tmp_path):
    from benchmarks import bench_noise_floor

    data = bench_noise_floor.main(["--model", "tiny:llama", "--reps", "1", "--group-size", "2",
                                   "--max-new-tokens", "4", "--out", str(tmp_path)])
    assert data["results"]["fp32"]["worst_gap"] < 3e-5
    assert data["results"]["fp32"]["gaps"]["lean_vs_forward"]["max"] < 3e-6


@pytest.mark.slow
def test_trl_arm_and_objective_equivalence(tmp_path):
    pytest.importorskip("trl")
    from benchmarks import bench_objective, bench_vs_trl

    r = bench_vs_trl.run({**TINY, "arm": "trl"})
    assert len(r["steps"]) == 2 and r["steps"][0]["response_tokens"] > 0
    data = bench_objective.main(["--cases", "2", "--out", str(tmp_path)])
    assert data["summary"]["all rows non-empty"]["equal_to_1e-5"]


def test_decode_benchmark(tmp_path):
    from benchmarks import bench_decode

    data = bench_decode.main(["--model", "tiny:llama", "--batch", "4", "--context", "8",
                              "--reps", "2", "--out", str(tmp_path)])
    assert data["decode_step_s"] > 0 and data["linears_at_batch"]["gflops"] > 0
    assert data["dense_decoder_step_s"] > 0
    assert (tmp_path / "decode_tiny-llama.md").read_text().count("|") > 10


def test_matmul_benchmark_times_the_same_products_both_ways():
    """bench_matmul's BLAS and oneDNN calls compute the same forward, ∂x and ∂W products."""
    import torch

    from benchmarks import bench_matmul

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    out = bench_matmul.run({"threads": 1, "reps": 1, "shapes": [(24, 40, 56)]})
    row = out["shapes"]["24x40x56"]
    for kind in bench_matmul.KINDS:
        assert row[f"{kind}_blas"] > 0 and row[f"{kind}_onednn"] > 0
        assert row[f"{kind}_max_abs_diff"] < 1e-4, kind


def test_scaling_benchmark_one_process(tmp_path):
    from benchmarks import bench_scaling

    data = bench_scaling.main(["--model", "tiny:llama", "--prompts", "2", "--group-size", "2",
                               "--max-new-tokens", "3", "--minibatches", "2", "--steps", "2",
                               "--configs", "1:none", "--out", str(tmp_path)])
    r = data["results"]["1:none"]
    assert len(r["steps"]) == 2 and r["peak_rss_mb"] > 0
    assert (tmp_path / "scaling_tiny-llama.md").is_file()


def test_reward_isolation_benchmark_writes_results(tmp_path):
    from benchmarks import bench_reward_isolation

    data = bench_reward_isolation.main(["--sizes", "4", "--reps", "3", "--out", str(tmp_path)])
    assert set(data["summary"]["4"]["median_ms"]) == {"inline", "thread", "process"}
    assert (tmp_path / "reward_isolation.md").read_text().count("|") > 10
@pytest.mark.slow  # ~12 s on a quiet machine (two SmolLM2-free Trainer setups and updates)
def test_length_benchmark_writes_curves(tmp_path):
    from benchmarks import bench_length

    data = bench_length.main(["--model", "tiny:llama", "--lengths", "4", "--prompts", "2",
                              "--group-size", "4", "--minibatches", "2", "--resamples", "2",
                              "--lr", "3e-3", "--out", str(tmp_path)])
    (row,) = data["rows"]
    for name in ("gspo", "grpo"):
        o = row["objectives"][name]
        assert len(o["steps"]) == 2 and o["grad_var_trace"] >= -1e-9
        assert o["steps"][-1]["token_ratio_std"] > 0  # the update moved the policy
    assert (tmp_path / "length.png").is_file() and "| 4 |" in (tmp_path / "length.md").read_text()


def test_async_benchmark_arms_flops_and_summary(tmp_path):
    """bench_async end to end at tiny scale, every arm in its own child process (the async
    engine process, and multiprocessing's resource tracker, must not outlive the arm): a sync
    and an async arm run, the step's FLOPs are counted by phase, and the summary carries the
    thread scaling and the async-vs-bound ratio."""
    from benchmarks import bench_async

    data = bench_async.main(["--model", "tiny:llama", "--group-size", "2", "--max-new-tokens",
                             "4", "--steps", "2", "--warmup", "0", "--reps", "1",
                             "--arms", "sync@1,sync@2,async1@1+1,async1@2+1,async1-remote@1+1",
                             "--out", str(tmp_path)])
    flops, summary = data["flops"], data["summary"]
    assert flops["total"] > 0 and flops["rollout"] > 0 and flops["update"] > 0
    assert summary["arms"]["async1@1+1"]["threads"] == 2
    # 3 threads on 2 cores: measured against the 2-thread limit
    over = summary["arms"]["async1@2+1"]
    assert over["threads"] == 3 and 0 < over["frac_of_limit"] < float("inf")
    # its engine: `gspo engine`; of its 2 steps the last (the pipeline draining) is left out
    assert summary["arms"]["async1-remote@1+1"]["n_steps"] == 1
    assert set(summary["thread_scaling"]) >= {"step_s", "rollout_s", "update_s"}
    assert "async1@1+1 vs sync@1" in summary["async_vs_bound"]
    text = (tmp_path / "async_tiny-llama.md").read_text()
    assert "async1@1+1" in text and "of FLOP limit" in text


def test_isolated_products_rerun_what_was_recorded():
    """bench_thread_scaling --isolated: the dispatch-mode recorder counts each matrix product
    by signature (transposed layouts apart), and its rerun has the recorded shape and FLOPs."""
    import torch

    from benchmarks.bench_thread_scaling import _products_mode, _runner

    a, w = torch.randn(5, 7, requires_grad=True), torch.randn(3, 7, requires_grad=True)
    mode = _products_mode()
    with mode:
        torch.nn.functional.linear(a, w).sum().backward()  # forward mm + two backward mms
        torch.mm(a.detach(), w.detach().t())
        with torch.inference_mode():  # linear arrives whole here
            torch.nn.functional.linear(a, w)
    seen = sorted(mode.seen.values(), key=lambda e: -e["count"])
    assert sum(e["count"] for e in seen) == 5
    assert [e["sig"]["op"] for e in seen].count("aten::linear") == 1
    for e in seen:
        fn, flops = _runner(e["sig"])
        out = fn()
        shapes = [s for s, _ in e["sig"]["operands"]]
        if e["sig"]["op"] == "aten::linear":  # x [m, k], w [n, k]
            assert out.shape == (5, 3) and flops == 2.0 * 5 * 7 * 3
            continue
        assert out.shape == (shapes[-2][0], shapes[-1][1])
        assert flops == 2.0 * shapes[-2][0] * shapes[-2][1] * shapes[-1][1]
        cold, _ = _runner(e["sig"], copies=3)  # cycles through 3 operand sets
        assert [cold().shape for _ in range(4)] == [out.shape] * 4
    strides = {tuple(map(tuple, (st for _, st in e["sig"]["operands"]))) for e in seen}
    assert ((7, 1), (1, 7)) in strides  # a × wᵀ: w's transposed view kept as recorded


def test_isolated_onednn_products_keep_a_plain_weights_layout():
    """matmul=onednn's products (oneDNN on plain weights, transposed views in backward) are
    recorded with the weight's layout and rerun on it; a packed weight is rerun packed."""
    import torch

    from benchmarks.bench_thread_scaling import _products_mode, _runner
    from gspo.models import onednn

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    x, w = torch.randn(5, 7, requires_grad=True), torch.randn(3, 7, requires_grad=True)
    packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 5)
    mode = _products_mode()
    with mode:
        onednn.linear(x, w).sum().backward()  # x Wᵀ, then g W and gᵀ x
        torch.ops.mkldnn._linear_pointwise(x.detach(), packed, None, "none", [], "")
    sigs = [e["sig"] for e in mode.seen.values()]
    assert len(sigs) == 4 and sum("w" not in sig for sig in sigs) == 1  # the packed one
    assert {tuple(map(tuple, sig["w"])) for sig in sigs if "w" in sig} == {
        ((3, 7), (7, 1)), ((7, 3), (1, 7)), ((7, 5), (1, 7))}  # W, Wᵀ, xᵀ as views
    for sig in sigs:
        fn, flops = _runner(sig)
        assert fn().shape[-1] == sig["n"] and flops > 0


def test_thread_scaling_isolated_end_to_end(tmp_path):
    from benchmarks import bench_thread_scaling

    data = bench_thread_scaling.main(["--model", "tiny:llama", "--group-size", "2",
                                      "--max-new-tokens", "4", "--warmup", "1", "--reps", "0",
                                      "--isolated", "--rounds", "1", "--out", str(tmp_path)])
    iso = data["isolated"]
    assert iso["products"] and all(p["t1_s"] > 0 and p["t2_s"] > 0 for p in iso["products"])
    assert set(iso["wall_s"]) == {"1", "2"}
    text = (tmp_path / "thread_scaling_tiny-llama.md").read_text()
    assert "its products, back to back" in text and "outside any op" in text
    assert "cold operands" in text and all(p["cold_t2_s"] > 0 for p in iso["products"])
    assert {"1", "2"} == set(iso["in_situ"]) and iso["in_situ"]["1"]["op_s"]


def _arm(name, step, roll):
    """One bench_async child's result: one counted step of an arm."""
    return {"arm": name, "peak_rss_mb": 1.0, "steps": [
        {"step_s": step, "rollout_s": roll, "response_tokens": 8, "old_logprobs_s": 0.5}]}


def test_async_summary_compares_the_spinning_worker_arm():
    """bench_async's sync-spin@2 arm: its child gets OMP_WAIT_POLICY=ACTIVE, and the summary
    states it against sync@2 phase by phase."""
    from benchmarks import bench_async

    assert bench_async.ARM_ENV["sync-spin@2"] == {"OMP_WAIT_POLICY": "ACTIVE"}

    s = bench_async.summarize([_arm("sync@2", 8.0, 2.0), _arm("sync-spin@2", 4.0, 1.0)], 0,
                              {"total": 1e9}, {"1": 1.0, "2": 2.0})
    assert s["spin_over_sync@2"]["step_s"] == 2.0 and s["spin_over_sync@2"]["rollout_s"] == 2.0
    assert s["arms"]["sync-spin@2"]["threads"] == 2


def test_async_summary_states_compiled_layers_against_eager():
    """bench_async's sync-compile arms: compile_layers=true in the child's overrides, and the
    summary gives their thread scaling and their speed against the eager arm at each count."""
    from benchmarks import bench_async

    assert bench_async.ARMS["sync-compile@2"] == ("gspo", 2, 0, ["compile_layers=true"])

    s = bench_async.summarize([_arm("sync@1", 12.0, 3.0), _arm("sync@2", 8.0, 2.0),
                               _arm("sync-compile@1", 10.0, 3.0),
                               _arm("sync-compile@2", 5.0, 2.0)], 0, {"total": 1e9},
                              {"1": 1.0, "2": 2.0})
    assert s["thread_scaling_compile"]["step_s"] == 2.0
    assert s["compile_over_sync"]["@1"]["step_s"] == 1.2
    assert s["compile_over_sync"]["@2"]["update_s"] == 2.0
    _, rows = bench_async.table("m", s, {"total": 1e9, "rollout": 1, "old_logprobs": 1,
                                        "update": 1}, {"1": 1.0, "2": 2.0})
    assert any(r.startswith("- compile_layers vs default @2: step 1.60× faster") for r in rows)
    assert bench_async.ARM_ENV["sync-thp@1"] == {"THP_MEM_ALLOC_ENABLE": "1"}


def test_async_bind_arms_pin_the_openmp_threads():
    """bench_async's sync-bind arms: their children get GNU OpenMP's binding variables, and
    the summary gives their thread scaling and their speed against the default arm."""
    from benchmarks import bench_async

    for t in (1, 2):
        assert bench_async.ARM_ENV[f"sync-bind@{t}"] == {"OMP_PROC_BIND": "close",
                                                          "OMP_PLACES": "cores"}
        assert bench_async.total_threads(f"sync-bind@{t}") == t
    s = bench_async.summarize([_arm("sync@1", 12.0, 3.0), _arm("sync@2", 8.0, 2.0),
                               _arm("sync-bind@1", 12.0, 3.0), _arm("sync-bind@2", 6.0, 2.0)],
                              0, {"total": 1e9}, {"1": 1.0, "2": 2.0})
    assert s["thread_scaling_bind"]["step_s"] == 2.0
    assert s["bind_over_sync"]["@2"]["step_s"] == 8.0 / 6.0
    _, rows = bench_async.table("m", s, {"total": 1e9, "rollout": 1, "old_logprobs": 1,
                                        "update": 1}, {"1": 1.0, "2": 2.0})
    assert any(r.startswith("- OMP_PROC_BIND=close OMP_PLACES=cores vs default @2: step 1.33×")
               for r in rows)


def test_async_bf16_arms_sample_from_a_bfloat16_copy(tmp_path):
    """bench_async's sync-bf16 arms: the trainer they build samples from a bfloat16 copy of
    the fp32 policy (rollout.precision=bf16) while it trains in fp32, and the summary states
    them against the default arm."""
    import torch

    from benchmarks import bench_async
    from benchmarks.bench_vs_trl import build_trainer

    spec = {"model": "tiny:llama", "seed": 0, "steps": 1, "threads": 1, "prompts_per_step": 1,
            "group_size": 2, "max_new_tokens": 2, "temperature": 1.0, "minibatches": 1,
            "lr": 1e-6, "arm": "gspo", "overrides": bench_async.ARMS["sync-bf16@1"][3]}
    trainer = build_trainer(spec, tmp_path)
    assert trainer.cfg.rollout.precision == "bf16" and trainer.cfg.dtype == "float32"
    assert next(trainer.engine.model.parameters()).dtype == torch.bfloat16
    assert next(trainer.model.parameters()).dtype == torch.float32
    assert bench_async.total_threads("sync-bf16@2") == 2
    s = bench_async.summarize([_arm("sync@1", 12.0, 3.0), _arm("sync-bf16@1", 10.0, 1.0)], 0,
                              {"total": 1e9}, {"1": 1.0, "2": 2.0})
    assert s["bf16_over_sync"]["@1"]["rollout_s"] == 3.0


def test_routing_volatility_grids_are_valid_configs():
    """Every setting of bench_routing_volatility's grids loads as a run config; the router
    grids set the routers' own lr scale, the others leave it at 1."""
    from benchmarks import bench_routing_volatility as bench
    from gspo.config import load_config

    for grid in (bench.GRID, bench.GRANULARITY, bench.ROUTER, bench.UPCYCLED_ROUTER):
        for testbed, lr, state, steps in grid:
            cfg = load_config(None, bench.overrides(testbed, lr, state, steps))
            assert cfg.optim.lr == lr and cfg.steps == steps
            assert cfg.moe.router_lr_scale == state.get("router_lr_scale", 1.0)
    assert sorted(s["router_lr_scale"] for _, _, s, _ in bench.ROUTER) == [1, 10, 30, 100]
    assert [s["router_lr_scale"] for _, _, s, _ in bench.UPCYCLED_ROUTER] == [3, 10, 30]
    assert {cfg.model for cfg in (load_config(None, bench.overrides(*g))
                                  for g in bench.UPCYCLED_ROUTER)} == {
        bench.UPCYCLED.format(std=0.02, noise=0.01)}


def test_flops_mode_counts_onednn_products_attention_and_inference_mode_ops():
    """bench_async.flops_mode by hand: a oneDNN linear forward and backward is 3 products of
    2 M K N; under inference mode ``matmul`` and SDPA reach the mode whole and are counted
    once; the CPU flash attention's forward and backward get torch's SDPA formulas."""
    import torch
    from torch.utils import flop_counter as fc

    from benchmarks import bench_async
    from gspo.models import onednn
    from gspo.models.decode import onednn_available

    if not onednn_available():
        pytest.skip("this torch build has no oneDNN")
    x = torch.randn(6, 5, requires_grad=True)
    w = torch.randn(3, 5, requires_grad=True)
    mode = bench_async.flops_mode()
    with mode:
        onednn.linear(x, w).sum().backward()
    assert mode.total == 3 * 2 * 6 * 5 * 3
    assert mode.by_op == {"mkldnn._linear_pointwise": 3 * 2 * 6 * 5 * 3}

    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 7, 8)
    mode = bench_async.flops_mode()
    with torch.inference_mode(), mode:
        torch.matmul(q, k.transpose(-1, -2)[:, :1])  # [2, 4, 3, 7], K = 8
        torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True)
    assert mode.by_op["aten.matmul"] == 2 * 2 * 4 * 3 * 7 * 8
    assert mode.by_op["aten.scaled_dot_product_attention"] == fc.sdpa_flop_count(
        q.shape, k.shape, k.shape)
    assert mode.total == sum(mode.by_op.values())

    q = torch.randn(2, 4, 3, 8, requires_grad=True)
    k2, v2 = torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 8)
    mode = bench_async.flops_mode()
    with mode:
        torch.nn.functional.scaled_dot_product_attention(q, k2, v2).sum().backward()
    flash = "aten._scaled_dot_product_flash_attention_for_cpu"
    assert mode.by_op[flash] == fc.sdpa_flop_count(q.shape, k2.shape, v2.shape)
    assert mode.by_op[flash + "_backward"] == fc.sdpa_backward_flop_count(
        q.shape, q.shape, k2.shape, v2.shape)


def test_flops_mode_leaves_the_lean_passes_on_where_flop_counter_mode_turns_them_off():
    """FlopCounterMode's module hooks make gspo's decoder and lean passes refuse a model (they
    would bypass hooks), so a step counted under it is not the step that is timed; under
    flops_mode the model stays supported."""
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks import bench_async
    from gspo.models import load_model
    from gspo.models.decode import unsupported

    model, _ = load_model("tiny:llama")
    assert unsupported(model) is None
    with bench_async.flops_mode():
        assert unsupported(model) is None
    with FlopCounterMode(display=False):
        assert unsupported(model) is not None


def test_step_bound_takes_the_longer_of_the_rollouts_flops_and_its_weight_reads():
    """bench_async.step_bound by hand: 10 GFLOP/s at 1 thread; a rollout of 2 GFLOP over
    5 tokens (4 decode steps) reading 1 GB of weights each at 2 GB/s: 2 s of reads > 0.2 s of
    FLOPs; π_old + update 8 GFLOP: 0.8 s. Bound 2.8 s, so at most 10 / (2.8 × 10) of the limit."""
    from benchmarks import bench_async

    flops = {"total": 10e9, "rollout": 2e9, "old_logprobs": 3e9, "update": 5e9}
    limit = {"1": 10.0, "2": 20.0, "weight_bytes": 1e9, "read_gb_s_1": 2.0, "read_gb_s_2": 4.0}
    b = bench_async.step_bound(flops, limit, tokens=5, threads=1)
    assert b["rollout_read_s"] == pytest.approx(2.0) and b["rollout_s"] == pytest.approx(2.0)
    assert b["rest_s"] == pytest.approx(0.8) and b["step_s"] == pytest.approx(2.8)
    assert b["max_frac_of_limit"] == pytest.approx(10 / 28)
    fast = bench_async.step_bound(flops, {**limit, "read_gb_s_2": 400.0}, tokens=5, threads=3)
    assert fast["rollout_s"] == pytest.approx(0.1)  # FLOP-bound: 2 GFLOP at the 2-thread 20
    s = bench_async.summarize([_arm("sync@1", 5.6, 4.0)], 0, flops, limit, tokens=5)
    assert s["bound"]["sync@1"]["step_over_bound"] == pytest.approx(2.0)


def test_async_summary_leaves_out_the_draining_steps_and_states_lent_time():
    """An async arm's last k steps of each child (nothing left to sample: the engine waits)
    are not counted; the lending arms' trainer time on the engine's thread is stated."""
    from benchmarks import bench_async

    def child(arm, times):
        return {"arm": arm, "peak_rss_mb": 1.0, "steps": [
            {"step_s": t, "rollout_s": 0.0, "response_tokens": 8, "lent_s": t / 4,
             "borrowed_s": t / 8} for t in times]}

    assert bench_async.ARMS["async2-lend@1+1"][3][-1] == "rollout.async_lend_threads=true"
    s = bench_async.summarize([child("async1-lend@1+1", [9.0, 4.0, 4.0, 2.0]),
                               child("async2-lend@1+1", [9.0, 4.0, 2.0, 2.0]),
                               child("sync@2", [9.0, 3.0, 3.0, 3.0])], 1, {"total": 1e9},
                              {"1": 1.0, "2": 2.0})
    assert s["arms"]["async1-lend@1+1"]["n_steps"] == 2
    assert s["arms"]["async1-lend@1+1"]["step_s"] == 4.0
    assert s["arms"]["async2-lend@1+1"]["n_steps"] == 1
    assert s["arms"]["sync@2"]["n_steps"] == 3
    _, rows = bench_async.table("m", s, {"total": 1e9, "rollout": 1, "old_logprobs": 1,
                                        "update": 1}, {"1": 1.0, "2": 2.0})
    assert any(r.startswith("Trainer time a step on the engine's lent thread (medians): "
                            "async1-lend@1+1 1.00 s") for r in rows)
    assert any(r.startswith("Engine time a batch on the trainer's lent thread (medians): "
                            "async1-lend@1+1 0.50 s") for r in rows)
