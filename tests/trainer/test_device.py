"""The ``device`` option: one process training and sampling on a GPU.

Fast lane, any machine: how ``device`` resolves, the config errors, the one-copy weight
publish the async engine uses for GPU policies, ``save_final``. The ``cuda`` tests run where
torch sees a GPU (``python -m pytest -m cuda tests/trainer/test_device.py``, what
``scripts/gpu_check.sh`` runs first) and skip elsewhere.
"""

from __future__ import annotations

import json

import pytest
import torch

from gspo.config import ConfigError, load_config
from gspo.models import load_model
from gspo.rollout.async_engine import _copy_flat, _layout, _named_tensors, _views
from gspo.trainer import Trainer
from gspo.trainer.distributed import resolve_device

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def char_codes(prompts, completions, **_):
    """A reward that differs within almost every group: every step moves the weights."""
    return [float(sum(map(ord, c)) % 97) for c in completions]


def _cfg(tmp_path, name, *extra):
    return load_config(None, [
        "model=tiny:llama", f"output_dir={tmp_path}", f"run_name={name}", "progress=false",
        "tensorboard=false", "num_threads=1", "rollout.max_new_tokens=5",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.temperature=1.0",
        "objective.num_minibatches=2", "task.eval_size=4", "optim.lr=3e-3", "steps=2",
        "eval_before=false", "logging.samples_every=0", *extra])


def _train(cfg):
    trainer = Trainer(cfg, reward_fns=[char_codes]).setup()
    try:
        trainer.train()
        trainer.device_seen = next(trainer.model.parameters()).device
    finally:
        trainer.cleanup()
    rows = [json.loads(x) for x in open(trainer.run_dir / "metrics.jsonl") if "train/loss" in x]
    return trainer, rows


# ----------------------------------------------------------------------------- any machine


def test_auto_is_the_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="device=cuda: CUDA is not available"):
        resolve_device("cuda")


def test_auto_is_the_gpu_when_torch_sees_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto").type == "cuda"
    with pytest.raises(ConfigError, match="only 1 GPU"):
        resolve_device("cuda:3")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "mps"])
def test_a_device_that_is_not_one_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="device: "):
        load_config(None, [f"device={bad}"])


def test_device_cuda_without_a_gpu_fails_before_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="device=cuda"):
        Trainer(_cfg(tmp_path, "nogpu", "device=cuda"), reward_fns=[char_codes]).setup()
    assert not (tmp_path / "nogpu").exists()


def test_one_copy_per_dtype_publish_equals_the_per_tensor_one():
    """The GPU publish path (one concatenated copy per dtype) fills a slot exactly as the CPU
    path (one copy per distinct tensor, tied ones once) does."""
    model, _ = load_model("tiny:llama", seed=3)
    model.model.layers[0].self_attn.q_proj.weight.data.normal_()  # not the init pattern
    entries, sizes = _layout(model)
    first: dict[tuple[str, int], int] = {}
    for i, e in enumerate(entries):
        first.setdefault((e.dtype, e.offset), i)
    unique = sorted(first.values())
    srcs = [t for *_, t in _named_tensors(model)]
    per_tensor = {k: torch.full((n,), float("nan"), dtype=getattr(torch, k))
                  for k, n in sizes.items()}
    views = _views(entries, per_tensor)
    torch._foreach_copy_([views[i] for i in unique], [srcs[i].detach() for i in unique])
    flat = {k: torch.full((n,), float("nan"), dtype=getattr(torch, k)) for k, n in sizes.items()}
    _copy_flat(flat, entries, unique, srcs)
    for k in sizes:
        assert not per_tensor[k].isnan().any()
        assert torch.equal(per_tensor[k], flat[k])


def test_save_final_false_keeps_metrics_and_writes_no_checkpoint(tmp_path):
    trainer, rows = _train(_cfg(tmp_path, "nosave", "save_final=false", "device=cpu"))
    assert len(rows) == 2
    assert (trainer.run_dir / "final_eval.json").exists()
    assert not list((trainer.run_dir / "checkpoints").glob("step_*"))


# ----------------------------------------------------------------------------- on a GPU


@cuda
@pytest.mark.cuda
def test_cuda_run_trains_and_its_sampler_matches_its_trainer(tmp_path):
    """Two steps on the GPU: the policy lives there, the loss is finite, the trainer's fp32
    π_old pass agrees with the sampler's log-probs to fp32 rounding, peak memory is logged."""
    trainer, rows = _train(_cfg(tmp_path, "gpu", "device=cuda"))
    assert trainer.device_seen.type == "cuda"
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["train/loss"])) for r in rows)
    assert max(r["rollout/logprob_gap_abs_max"] for r in rows) < 1e-4
    assert rows[-1]["perf/gpu_peak_memory_gib"] > 0
    assert (trainer.run_dir / "final_eval.json").exists()


@cuda
@pytest.mark.cuda
def test_cuda_and_cpu_runs_sample_the_same_first_batch(tmp_path):
    """Uniforms come from CPU generators, so on identical weights both devices draw the same
    tokens unless a logit lands within rounding of a CDF boundary: step 1's rewards agree."""
    _, on_gpu = _train(_cfg(tmp_path, "g", "device=cuda", "steps=1"))
    _, on_cpu = _train(_cfg(tmp_path, "c", "device=cpu", "steps=1"))
    assert on_gpu[0]["reward/mean"] == pytest.approx(on_cpu[0]["reward/mean"])


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("k", [1, 2])
def test_cuda_async_engine_samples_on_the_gpu(tmp_path, k):
    _trainer, rows = _train(_cfg(tmp_path, f"a{k}", "device=cuda", f"rollout.async_steps={k}",
                                "steps=3"))
    assert len(rows) == 3
    assert [r["async/staleness_max"] for r in rows] == [min(s, k) for s in range(3)]
    # the engine process's pass on the behaviour weights vs its sampler: same device, fp32
    assert max(r["async/engine_mismatch_abs_max"] for r in rows) < 1e-4


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("replay", ["off", "r2", "r3"])
def test_cuda_moe_with_routing_replay(tmp_path, replay):
    _trainer, rows = _train(_cfg(tmp_path, f"moe_{replay}", "device=cuda", "model=tiny:qwen3_moe",
                                f"moe.routing_replay={replay}"))
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["train/loss"])) for r in rows)


@cuda
@pytest.mark.cuda
def test_cuda_resume_continues_the_run(tmp_path):
    """Checkpoint at step 1, resume to step 2 on the GPU: the resumed run's step-2 rewards
    equal the straight run's (same samples); its weights are compared and the largest
    difference printed (GPU kernels need not be bit-deterministic)."""
    _, straight = _train(_cfg(tmp_path, "straight", "device=cuda"))
    cfg = _cfg(tmp_path, "cut", "device=cuda", "save_every=1", "steps=1")
    _train(cfg)
    _resumed, rows = _train(_cfg(tmp_path, "cut", "device=cuda", "save_every=1",
                                f"resume={tmp_path / 'cut'}"))
    assert [r["reward/mean"] for r in rows][-1] == pytest.approx(straight[-1]["reward/mean"])


@cuda
@pytest.mark.cuda
def test_cuda_compare_probe_measures_routing_change(tmp_path):
    """gspo compare's one-update routing probe on a GPU policy (routing recorded on the CPU,
    masks on the GPU)."""
    from gspo.analysis.compare import first_update_probe

    res = first_update_probe(_cfg(tmp_path, "probe", "device=cuda", "model=tiny:qwen3_moe",
                                  "steps=0"))
    assert 0.0 <= res["expert_change"] <= 1.0 and len(res["expert_change_per_layer"]) > 0
