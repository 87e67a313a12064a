"""Crash safety: atomic checkpoints, logs cut back on resume, and, through the real CLI,
SIGKILL anywhere and SIGTERM, then resume to the end.

Each slow test runs ``python -m gspo train`` in a subprocess on ``tiny:llama`` with
``save_every=1``, interrupts it, resumes it with ``resume=RUN_DIR`` until it finishes, and
checks the final weights are bit-identical to an uninterrupted run with the same seed, that
every ``step_*`` folder on disk was complete at every kill, and that ``metrics.jsonl`` holds
each step exactly once.

Kills inside a checkpoint write use the test hook ``GSPO_TEST_CHECKPOINT_PAUSE=PHASE:STEP``
(gspo/trainer/checkpoint.py): the writer announces that phase on stderr and waits to be killed.
"""

from __future__ import annotations

import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gspo.config import load_config
from gspo.trainer import Trainer
from gspo.trainer.checkpoint import (
    PAUSE_ENV,
    PHASES,
    latest_checkpoint,
    load_weights,
    save_checkpoint,
)
from gspo.trainer.guard import roll_back

REPO = Path(__file__).resolve().parents[2]
STEPS = 12
REWARD = "crash_rewards:starts_with_digit"
REWARD_SOURCE = '''
def starts_with_digit(prompts, completions, **_):
    return [float(bool(c) and c[0].isdigit()) for c in completions]
'''
# Keys that differ between runs by wall-clock only.
TIMING = ("time/", "perf/")
WAIT_S = 600  # per wait; generous for a loaded CI machine


ASYNC = ("rollout.async_steps=2",)  # the async case: the engine process 2 steps ahead


def _overrides(out: Path, name: str, extra: tuple[str, ...] = ()) -> list[str]:
    return [*extra, "model=tiny:llama", f"output_dir={out}", f"run_name={name}", f"steps={STEPS}",
            "save_every=1", "keep_checkpoints=2", "progress=false", "tensorboard=false",
            "num_threads=1", "seed=3", "rollout.max_new_tokens=5", "rollout.prompts_per_step=2",
            "rollout.group_size=4", "rollout.temperature=1.0", "objective.num_minibatches=2",
            "task.eval_size=4", "rollout.eval_max_new_tokens=4", "optim.lr=3e-3",
            f"reward.functions=[{REWARD}]", "logging.samples_every=1"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("crash")
    (d / "crash_rewards.py").write_text(REWARD_SOURCE)
    return d


def _reference(workdir: Path, name: str, extra: tuple[str, ...] = ()) -> Path:
    """The uninterrupted run, in this process (the CLI builds the same Trainer)."""
    sys.path.insert(0, str(workdir))
    threads = torch.get_num_threads()
    trainer = None
    try:
        trainer = Trainer(load_config(None, _overrides(workdir, name, extra))).setup()
        trainer.train()
    finally:
        if trainer is not None:
            trainer.cleanup()
        sys.path.remove(str(workdir))
        torch.set_num_threads(threads)
    run = workdir / name
    weights = _weights(run, STEPS)
    assert not all(torch.equal(weights[k], _weights(run, STEPS - 1)[k]) for k in weights), \
        "the last step changed nothing: bit-identity would prove nothing"
    return run


@pytest.fixture(scope="module")
def reference(workdir):
    return _reference(workdir, "reference")


@pytest.fixture(scope="module")
def async_reference(workdir):
    return _reference(workdir, "async_reference", ASYNC)


class Cli:
    """``python -m gspo train`` in a subprocess; its merged stdout/stderr read line by line."""

    def __init__(self, workdir: Path, args: list[str], env: dict[str, str] | None = None):
        full_env = {**os.environ, "PYTHONPATH": f"{workdir}{os.pathsep}{REPO}",
                    "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "gspo", "train", *args], cwd=REPO,
                                     env=full_env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, predicate, timeout: float = WAIT_S) -> None:
        """Block until ``predicate()`` holds, checking at every output line and every 20 ms."""
        end = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None and self.lines.empty():
                raise AssertionError(f"trainer exited ({self.proc.returncode}) first:\n"
                                     + "".join(self.seen[-30:]))
            if time.monotonic() > end:
                self.proc.kill()
                raise AssertionError("timed out:\n" + "".join(self.seen[-30:]))
            try:
                self.seen.append(self.lines.get(timeout=0.02))
            except queue.Empty:
                pass

    def finish(self) -> str:
        rc = self.proc.wait(timeout=WAIT_S)
        self.pump.join(timeout=10)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        out = "".join(self.seen)
        assert rc == 0, out[-3000:]
        return out

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=WAIT_S)


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"step_{step:06d}" / "model.safetensors")


def _steps_logged(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            break
    return [r["step"] for r in rows if "reward/mean" in r]


def _check_checkpoints_complete(run: Path, expected_files: set[str]) -> list[str]:
    """Every ``step_*`` folder is whole and loads; the resume target exists. Returns names."""
    root = run / "checkpoints"
    names = sorted(p.name for p in root.glob("step_*"))
    for name in names:
        folder = root / name
        assert {p.name for p in folder.iterdir()} == expected_files, name
        load_file(folder / "model.safetensors")
        torch.load(folder / "optimizer.pt", weights_only=True)
        assert json.loads((folder / "state.json").read_text())["step"] == int(name[5:])
    assert latest_checkpoint(root) is not None
    return names


def _assert_same_run(run: Path, reference: Path) -> None:
    ref_rows = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows]  # no line lost or doubled
    assert _steps_logged(run) == list(range(1, STEPS + 1))
    for a, b in zip(rows, ref_rows):
        assert {k: v for k, v in a.items() if not k.startswith(TIMING)} == \
               {k: v for k, v in b.items() if not k.startswith(TIMING)}, a["step"]
    want, got = _weights(reference, STEPS), _weights(run, STEPS)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    if (reference / "samples.jsonl").is_file():
        assert (run / "samples.jsonl").read_text() == (reference / "samples.jsonl").read_text()
    assert json.loads((run / "final_eval.json").read_text())["steps"] == STEPS


def _newest_and_logged(run: Path) -> tuple[int, int]:
    """(step of the checkpoint a resume starts from, or -1; highest step in metrics.jsonl)."""
    ckpt = latest_checkpoint(run / "checkpoints")
    return (int(ckpt.name[5:]) if ckpt else -1), max(_steps_logged(run), default=0)


def _step_seconds(run: Path, step: int) -> float:
    """How long step ``step`` took (its ``time/*`` metrics)."""
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row["step"] == step and "reward/mean" in row:
            return sum(v for k, v in row.items() if k.startswith("time/") and v)
    return 0.0


def _kill_plan(rng: random.Random) -> list[str]:
    """One kill in each phase of a checkpoint write and two at a random instant, in random
    order; then two in the final save (after the final evaluation)."""
    kinds = [*PHASES, "anytime", "anytime"]
    rng.shuffle(kinds)
    return [*kinds, f"final:{rng.choice(PHASES[:3])}", "final:pointed"]


@pytest.mark.slow
def test_sigkill_anywhere_then_resume_is_bit_identical(workdir, reference):
    rng = random.Random(4)
    kills = _kill_then_resume(workdir, reference, "killed", _kill_plan(rng), rng)
    assert len(kills) == len(PHASES) + 4


@pytest.mark.slow
def test_async_sigkill_then_resume_is_bit_identical(workdir, async_reference):
    """rollout.async_steps=2: a kill loses the in-flight batches of the engine process;
    the resumed run takes them from the checkpoint (they were sampled from weights older
    than the checkpoint's) and ends bit-identical to the uninterrupted async run. Fewer kills
    than the synchronous case: each start also starts an engine process (~10 s of imports)."""
    rng = random.Random(5)
    plan = [rng.choice(PHASES), "anytime", rng.choice(PHASES), "anytime", "final:pointed"]
    kills = _kill_then_resume(workdir, async_reference, "async_killed", plan, rng, ASYNC)
    assert len(kills) == len(plan)


@pytest.mark.slow
def test_async_sigkill_with_an_engine_elsewhere_then_resume_is_bit_identical(workdir,
                                                                            async_reference):
    """The same with the engine started by `gspo engine` (rollout.async_address), a new one
    for every start (the killed trainer's engine exits): the weights reach each new engine
    whole at its first publish, the in-flight batches come from the checkpoint, and the run
    ends on the spawned engine's uninterrupted run bit for bit."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    rng = random.Random(6)
    plan = ["anytime", rng.choice(PHASES), "anytime"]
    kills = _kill_then_resume(workdir, async_reference, "remote_killed", plan, rng,
                              (*ASYNC, f"rollout.async_address={address}"), engine=address)
    assert len(kills) == len(plan)


class _Engine:
    """A `gspo engine ADDRESS` beside one start of the trainer."""

    def __init__(self, address: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "gspo", "engine", address,
                                      "--timeout", str(WAIT_S)], cwd=REPO,
                                     stderr=subprocess.PIPE, text=True)

    def wait(self, clean: bool) -> None:
        """After a trainer that finished: its exit, 0. After a killed one: gone (killed)."""
        try:
            if clean:
                assert self.proc.wait(timeout=WAIT_S) == 0, self.proc.stderr.read()[-3000:]
        finally:
            self.proc.kill()
            self.proc.wait(timeout=60)


def _kill_then_resume(workdir: Path, reference: Path, name: str, plan: list[str],
                      rng: random.Random, extra: tuple[str, ...] = (),
                      engine: str | None = None) -> list[tuple]:
    """Run ``name``, SIGKILL it at each point of ``plan`` and resume it, then resume it to
    the end and check it against ``reference``; the kills made. ``engine``: an address to
    start a `gspo engine` at beside every start."""
    run = workdir / name
    args = _overrides(workdir, name, extra)
    expected = {p.name for p in (reference / "checkpoints" / f"step_{STEPS:06d}").iterdir()}
    kills = []
    for i, kind in enumerate(plan):
        server = _Engine(engine) if engine else None
        # Pick a kill point the resumed run reaches: a write of a step past the checkpoint it
        # starts from, or (anytime) a step not logged yet; never the step-0 checkpoint.
        newest, logged = _newest_and_logged(run)
        resume = [f"resume={run}"] if i else []
        if kind == "anytime":  # a random instant within the step after `step` is logged
            step = max(newest, logged) + 1
            assert step < STEPS, f"no room left for the kill plan: {kills}"
            cli = Cli(workdir, [*args, *resume])
            cli.wait_for(lambda s=step: s in _steps_logged(run))
            time.sleep(rng.uniform(0.0, _step_seconds(run, step)))
        else:
            phase = kind.removeprefix("final:")
            step = STEPS if kind.startswith("final:") else max(1, newest + 1 + rng.randint(0, 1))
            assert newest < step <= STEPS, f"no room left for the kill plan: {kills}"
            cli = Cli(workdir, [*args, *resume], env={PAUSE_ENV: f"{phase}:{step}"})
            cli.wait_for(lambda c=cli: any("[checkpoint]" in line for line in c.seen))
        cli.kill()
        if server is not None:
            server.wait(clean=False)
        kills.append((kind, step, _check_checkpoints_complete(run, expected)))
        print("killed:", kills[-1], "logged:", _steps_logged(run), flush=True)
    server = _Engine(engine) if engine else None
    out = Cli(workdir, [*args, f"resume={run}"]).finish()
    if server is not None:
        server.wait(clean=True)
    assert "held-out accuracy" in out
    _check_checkpoints_complete(run, expected)
    _assert_same_run(run, reference)
    return kills


@pytest.mark.slow
def test_sigterm_checkpoints_exits_zero_and_resume_is_bit_identical(workdir, reference):
    run = workdir / "terminated"
    args = _overrides(workdir, "terminated")
    cli = Cli(workdir, args)
    cli.wait_for(lambda: 2 in _steps_logged(run))
    cli.proc.send_signal(signal.SIGTERM)
    out = cli.finish()  # exit code 0
    stopped = int(out.split("interrupted at step ")[1].split(";")[0])
    assert f"interrupted at step {stopped}; resume with: gspo train resume={run}\n" in out
    assert 2 <= stopped < STEPS
    assert latest_checkpoint(run / "checkpoints").name == f"step_{stopped:06d}"
    assert not (run / "final_eval.json").exists()
    Cli(workdir, [*args, f"resume={run}"]).finish()
    _assert_same_run(run, reference)


# ----------------------------------------------------------------------------- fast lane


class _Saves:
    """Stands in for a model or tokenizer: ``save_pretrained`` writes one file."""

    def __init__(self, filename: str, fail: bool = False) -> None:
        self.filename, self.fail = filename, fail

    def save_pretrained(self, path, **_):
        if self.fail:
            raise OSError("disk full")
        (Path(path) / self.filename).write_text("x")


def _save(root, step, keep=2, protect=(), fail=False, note=""):
    return save_checkpoint(root, step, _Saves("model.safetensors"), _Saves("tokenizer.json", fail),
                           {"optimizer": {}}, {"step": step, "note": note}, keep, protect)


def test_a_failed_write_leaves_no_step_folder_and_is_cleaned_up_later(tmp_path):
    _save(tmp_path, 1)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 2, fail=True)
    assert (tmp_path / ".tmp-step_000002").is_dir() and not (tmp_path / "step_000002").exists()
    assert latest_checkpoint(tmp_path).name == "step_000001"
    _save(tmp_path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001", "step_000003"]


def test_pruning_spares_protected_folders_and_a_resave_replaces_the_folder(tmp_path):
    for step in range(1, 5):
        _save(tmp_path, step, keep=1, protect=("step_000002",))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002", "step_000004"]
    _save(tmp_path, 4, keep=1, note="again")
    assert json.loads((tmp_path / "step_000004" / "state.json").read_text())["note"] == "again"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000004"]


def test_load_weights_round_trip_and_mismatch(tmp_path):
    from gspo.config import LoRAConfig
    from gspo.models import load_model
    from gspo.models.lora import apply_lora

    model, _ = load_model("tiny:llama", seed=0)
    model.save_pretrained(tmp_path / "dense")
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    load_weights(model, tmp_path / "dense")  # the tied output layer comes back with the input
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError):
        load_weights(model, tmp_path / "empty")
    (tmp_path / "partial").mkdir()
    model.config.save_pretrained(tmp_path / "partial")
    save_file({k: v for k, v in want.items() if k != "model.norm.weight"},
              tmp_path / "partial" / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        load_weights(model, tmp_path / "partial")

    lora = apply_lora(load_model("tiny:llama", seed=0)[0], LoRAConfig(r=4))
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_" in n:
                p.normal_()
    lora.save_pretrained(tmp_path / "adapter")
    adapter = {n: p.clone() for n, p in lora.named_parameters() if "lora_" in n}
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_" in n:
                p.zero_()
    load_weights(lora, tmp_path / "adapter")
    assert all(torch.equal(p, adapter[n]) for n, p in lora.named_parameters() if "lora_" in n)


def test_resume_cuts_the_logs_back_to_the_checkpoint(tmp_path):
    def cfg(*extra):
        return load_config(None, [
            "model=tiny:llama", f"output_dir={tmp_path}", "run_name=r", "progress=false",
            "tensorboard=false", "num_threads=1", "rollout.max_new_tokens=3",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "objective.num_minibatches=2",
            "task.eval_size=0", "save_every=1", *extra])

    first = Trainer(cfg("steps=2")).setup()
    first.train()
    run = first.run_dir
    with open(run / "metrics.jsonl", "a") as fh:  # a step after the checkpoint, then a torn line
        fh.write(json.dumps({"step": 3, "reward/mean": 0.0}) + "\n" + '{"step": 4, "rew')
    resumed = Trainer(cfg("steps=3", f"resume={run}")).setup()
    assert resumed.step == 2
    resumed.train()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and "train/loss" in rows[-1]


def test_a_resumed_run_keeps_the_initial_policy_as_its_kl_reference(tmp_path):
    """With objective.beta > 0 the KL term pulls towards the initial policy. A resumed run
    loads the policy from its checkpoint, so its reference must be loaded again from the
    initial model, not copied from the resumed weights (which it was: the resumed run's
    `objective/kl_ref` restarted near 0 and the weights left the uninterrupted run's)."""
    def cfg(out, *extra):
        return load_config(None, [
            "model=tiny:llama", f"output_dir={out}", "run_name=r", "progress=false",
            "tensorboard=false", "num_threads=1", "rollout.max_new_tokens=4",
            "rollout.prompts_per_step=2", "rollout.group_size=4", "objective.num_minibatches=2",
            "task.eval_size=0", "eval_before=false", "save_every=1", "keep_checkpoints=5",
            "objective.beta=0.05", "optim.lr=1e-3", "rollout.temperature=1.0", *extra])

    whole = Trainer(cfg(tmp_path / "whole", "steps=3")).setup()
    whole.train()
    cut = tmp_path / "cut" / "r"
    shutil.copytree(whole.run_dir, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000003")
    (cut / "checkpoints" / "latest").write_text("step_000002")
    resumed = Trainer(cfg(tmp_path / "cut", "steps=3", f"resume={cut}")).setup()
    resumed.train()
    rows = [[json.loads(x) for x in open(d / "metrics.jsonl") if "train/loss" in x]
            for d in (whole.run_dir, cut)]
    assert rows[0][-1]["objective/kl_ref"] > 0
    assert rows[1][-1]["objective/kl_ref"] == rows[0][-1]["objective/kl_ref"]
    a, b = (load_file(d / "checkpoints/step_000003/model.safetensors")
            for d in (whole.run_dir, cut))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_applies_the_optim_values_it_is_given(tmp_path):
    """`gspo train resume=RUN optim.lr=...` (overrides apply on resume, and config.yaml records
    them): loading the checkpoint's optimizer and schedule put back the first run's lr, betas
    and weight decay, so the resumed run trained with values it did not record. The lr keeps
    its place in the schedule and a guard.on_fault=lower_lr factor."""
    def cfg(*extra):
        return load_config(None, [
            "model=tiny:llama", f"output_dir={tmp_path}", "run_name=r", "progress=false",
            "tensorboard=false", "num_threads=1", "rollout.max_new_tokens=3",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "objective.num_minibatches=2",
            "task.eval_size=0", "save_every=1", "optim.lr=3e-3", *extra])

    first = Trainer(cfg("steps=1")).setup()
    first.train()
    # a lower_lr rollback halved the rate: the resumed run keeps that factor
    roll_back(first.run_dir / "checkpoints" / "step_000001", first.model, first.optimizer,
              first.scheduler, dist=first.dist, lr_factor=0.5)
    first.save_checkpoint()
    first.cleanup()

    same = Trainer(cfg("steps=2", f"resume={first.run_dir}")).setup()
    group = same.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (1.5e-3, (0.9, 0.999), 0.0)
    assert same.scheduler.base_lrs == [1.5e-3]
    same.cleanup()

    other = Trainer(cfg("steps=2", f"resume={first.run_dir}", "optim.lr=1e-3",
                        "optim.betas=[0.5,0.9]", "optim.weight_decay=0.1")).setup()
    group = other.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(5e-4) and other.scheduler.base_lrs == [pytest.approx(5e-4)]
    assert (group["betas"], group["weight_decay"]) == ((0.5, 0.9), 0.1)
    other.train()
    last = json.loads((first.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2 and last["train/lr"] == pytest.approx(5e-4)
