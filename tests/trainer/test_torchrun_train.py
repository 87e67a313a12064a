"""`gspo train` under torchrun, end to end, against one process: FSDP2's checkpoints.

Slow lane: each run starts 2 trainer processes (~15 s here).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
WORLD = 2
COMMON = ["model=tiny:llama", "run_name=r", "progress=false", "tensorboard=false",
          "num_threads=1", "rollout.max_new_tokens=5", "rollout.prompts_per_step=4",
          "rollout.group_size=4", "rollout.temperature=1.0", "objective.num_minibatches=2",
          "task.eval_size=0", "eval_before=false", "optim.lr=1e-4", "save_every=1",
          "logging.samples_every=0", "logging.rollout_check_every=1", "logging.drift_every=1",
          "objective.scale_rewards=batch", "reward.functions=[async_reward:char_codes]"]
REWARD = """
def char_codes(prompts, completions, **_):
    return [float(sum(map(ord, c)) % 97) for c in completions]
"""  # differs within almost every group: every step moves the weights (tiny models score 0)


def _env(out: Path, world: int) -> dict[str, str]:
    """The environment of a run in ``out``: the reward's module importable; a plain process
    (``world`` 1) without torchrun's variables."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "async_reward.py").write_text(REWARD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(out)])}
    return env if world > 1 else {k: v for k, v in env.items() if k not in ("WORLD_SIZE", "RANK")}


def _train(out: Path, *extra: str, world: int = WORLD, engines: list[str] = ()) -> Path:
    """`gspo train` on ``world`` processes (torchrun; 1: plain), with a `gspo engine` started
    at each of ``engines``; the run folder."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
                 "--standalone", "-m", "gspo"] if world > 1 else [sys.executable, "-m", "gspo"])
    env = _env(out, world)
    servers = [subprocess.Popen([sys.executable, "-m", "gspo", "engine", a, "--timeout", "300"],
                                env=env, stderr=subprocess.PIPE, text=True) for a in engines]
    try:
        proc = subprocess.run([*launcher, "train", *COMMON, f"output_dir={out}", *extra],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "terminate called" not in proc.stderr
        for s in servers:
            assert s.wait(timeout=60) == 0, s.stderr.read()[-2000:]
    finally:
        for s in servers:
            s.kill()
    return out / "r"


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in open(run / "metrics.jsonl") if "train/loss" in x]


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run / f"checkpoints/step_{step:06d}/model.safetensors")


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_fsdp2_checkpoints_leave_adamw_untouched(tmp_path):
    """The step-0 checkpoint of `save_every` used to gather the optimizer state with
    `get_optimizer_state_dict`, which creates a missing state by a zero-gradient step: AdamW
    then bias-corrected every later update for one step too many, and the 2-rank run drifted
    from the one-process run (1.7e-4 after one step at lr 1e-4). Now the two agree to fp32
    rounding, and a run resumed from that step-0 checkpoint is the same run bit for bit."""
    extra = ["dist.strategy=fsdp2", "steps=1"]
    one = _train(tmp_path / "one", *extra, world=1)
    two = _train(tmp_path / "two", *extra)
    assert _max_diff(_weights(one, 1), _weights(two, 1)) < 1e-5
    assert _max_diff(_weights(two, 1), _weights(two, 0)) > 1e-4  # the step moved them
    crashed = tmp_path / "crashed" / "r"
    shutil.copytree(two, crashed)
    shutil.rmtree(crashed / "checkpoints" / "step_000001")
    (crashed / "checkpoints" / "latest").write_text("step_000000")
    resumed = _train(crashed.parent, *extra, f"resume={crashed}")
    assert _max_diff(_weights(resumed, 1), _weights(two, 1)) == 0.0
