"""``gspo export`` and ``gspo eval`` on bad input and on what they must honour.

export: an OUT that holds something is refused (``--force`` replaces a saved model only); OUT
appears complete or not at all; a ``--base`` the adapter does not fit, or ``--base`` on a full
run, is a one-line error. eval: the config keys it reads (dtype, device, num_threads, seed,
rewards, turns) take effect; any other key=value, and ``model=`` next to ``--model``, is an
error (a CONFIG.yaml is a whole run's: eval reads its keys and leaves the training ones).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from gspo.cli import main
from gspo.cli.export import export_merged
from gspo.config import load_config
from gspo.trainer import Trainer

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TINY = ["num_threads=1", "task.eval_size=2", "rollout.eval_max_new_tokens=3"]


def _run(root: Path, name: str, *extra: str) -> Path:
    cfg = load_config(None, [
        "model=tiny:llama", f"output_dir={root}", f"run_name={name}", "progress=false",
        "tensorboard=false", "steps=1", "eval_before=false", "rollout.max_new_tokens=3",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "objective.num_minibatches=2",
        *TINY, *extra])
    trainer = Trainer(cfg)
    trainer.setup()
    try:
        trainer.train()
    finally:
        trainer.cleanup()
    return trainer.run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    torch.set_num_threads(1)
    return {"lora": _run(root, "lora", "lora.r=4", "lora.alpha=8"), "full": _run(root, "full")}


def fails(capsys, cmd: str, *args: str) -> str:
    capsys.readouterr()  # what came before
    code = main([cmd, *args])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = [line for line in err.splitlines()  # less the progress bars of transformers
             if line.strip() and not re.search(r"it/s\]$", line)]
    assert len(lines) == 1 and "Traceback" not in err + out, err
    assert lines[0].startswith(f"gspo {cmd}: error: "), err
    return lines[0]


def leftovers(folder: Path) -> list[str]:
    """Hidden temporary folders an export may have left beside OUT."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def _checkpoint(run: Path) -> Path:
    return run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()


def _copy_run(run: Path, to: Path) -> tuple[Path, Path]:
    """A copy of ``run`` and its checkpoint folder, to break."""
    shutil.copytree(run, to)
    return to, _checkpoint(to)


# ----------------------------------------------------------------------------- export: OUT


def test_export_refuses_an_out_that_holds_something(capsys, runs, tmp_path, monkeypatch):
    import gspo.cli.export as export

    def not_now(*_: Any, **__: Any) -> None:
        raise AssertionError("the base model was loaded before OUT was checked")

    monkeypatch.setattr(export, "load_model", not_now)
    out = tmp_path / "taken"
    out.mkdir()
    (out / "model.safetensors").write_text("another run's weights")
    msg = fails(capsys, "export", str(runs["lora"]), "--merged", str(out))
    assert str(out) in msg and "not empty" in msg
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    assert (out / "model.safetensors").read_text() == "another run's weights"
    assert leftovers(tmp_path) == []
    # --force replaces only a saved model, never a run's checkpoint or any other folder
    for taken in (out, _checkpoint(runs["full"])):
        before = sorted(p.name for p in taken.iterdir())
        msg = fails(capsys, "export", str(runs["lora"]), "--merged", str(taken), "--force")
        assert "--force" in msg and str(taken) in msg
        assert sorted(p.name for p in taken.iterdir()) == before


def test_export_into_an_empty_folder_and_force_replaces_a_model(capsys, runs, tmp_path):
    out = tmp_path / "merged"
    out.mkdir()  # empty: taken as it is
    assert main(["export", str(runs["lora"]), "--merged", str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in out.iterdir()}
    (out / "note.txt").write_text("from the first export")
    assert "not empty" in fails(capsys, "export", str(runs["lora"]), "--merged", str(out))
    assert (out / "note.txt").is_file()
    assert main(["export", str(runs["full"]), "--merged", str(out), "--force"]) == 0
    assert not (out / "note.txt").exists()  # the old folder is gone, as a whole
    assert (out / "tokenizer.json").is_file()
    assert leftovers(tmp_path) == []


def test_export_missing_tokenizer_writes_nothing(capsys, runs, tmp_path):
    """The audit's case: a checkpoint without its tokenizer files left OUT with weights only."""
    run, ckpt = _copy_run(runs["lora"], tmp_path / "run")
    for f in ckpt.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            f.unlink()
    out = tmp_path / "out" / "merged"
    msg = fails(capsys, "export", str(run), "--merged", str(out))
    assert "tokenizer" in msg and str(ckpt) in msg
    assert not out.exists()


def test_export_failing_while_writing_leaves_no_out(runs, tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerBase

    def disk_full(*_: Any, **__: Any) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", disk_full)
    out = tmp_path / "merged"
    with pytest.raises(OSError, match="No space left"):
        export_merged(runs["lora"], out)
    assert not out.exists()  # the weights were written, but not where OUT is
    assert leftovers(tmp_path) == []


# ----------------------------------------------------------------------------- export: --base


def _wide_llama(folder: Path) -> Path:
    """A Llama folder of another width than tiny:llama's: same class, other shapes."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from gspo.models.tiny import byte_tokenizer

    tok = byte_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("case", ["other_class", "other_class_unrecorded", "other_size"])
def test_export_base_the_adapter_does_not_fit(capsys, runs, tmp_path, case):
    run, ckpt = runs["lora"], _checkpoint(runs["lora"])
    base = "tiny:qwen3_moe"  # same hidden size as tiny:llama: the adapter would half-load
    if case == "other_class_unrecorded":  # an adapter_config without auto_mapping (older PEFT)
        run, ckpt = _copy_run(run, tmp_path / "run")
        meta = json.loads((ckpt / "adapter_config.json").read_text())
        meta.pop("auto_mapping", None)
        (ckpt / "adapter_config.json").write_text(json.dumps(meta))
    elif case == "other_size":
        base = str(_wide_llama(tmp_path / "wide"))
    out = tmp_path / "merged"
    msg = fails(capsys, "export", str(run), "--merged", str(out), "--base", base)
    assert f"--base {base}" in msg and str(ckpt) in msg and "adapter" in msg
    assert {"other_class": "a Qwen3MoeForCausalLM, but the LoRA adapter",
            "other_class_unrecorded": "tensors have no place in that model",
            "other_size": "size mismatch for "}[case] in msg
    assert not out.exists()


def test_export_base_on_a_full_run_is_an_error(capsys, runs, tmp_path):
    out = tmp_path / "merged"
    msg = fails(capsys, "export", str(runs["full"]), "--merged", str(out), "--base",
                "tiny:llama")
    assert "--base" in msg and "LoRA" in msg
    assert not out.exists()


# ----------------------------------------------------------------------------- eval


@pytest.mark.parametrize("key", ["optim.lr=1e-3", "steps=1", "lora.r=4",
                                 "rollout.max_new_tokens=3", "reward.max_unscorable_frac=0.3",
                                 "objective.beta=0.1", "keep_freed_memory=false",
                                 "reward.overlong_buffer=2"])
def test_eval_key_it_does_not_read_is_an_error(capsys, key):
    msg = fails(capsys, "eval", "--model", "tiny:llama", *TINY, key)
    assert f"{key.split('=')[0]} is not used by gspo eval" in msg


def test_eval_reads_the_task_and_reward_keys_of_a_whole_run_config(capsys, tmp_path, seen):
    """A CONFIG.yaml (a preset, a run's config.yaml) describes a whole run: eval takes the keys
    it reads from it and leaves the training ones (and the model, which --model gives)."""
    p = tmp_path / "config.yaml"
    p.write_text("model: tiny:mixtral\nsteps: 12\noptim: {lr: 0.1}\nnum_threads: 1\n"
                 "task: {eval_size: 3}\nrollout: {eval_max_new_tokens: 2, max_new_tokens: 9}\n")
    assert main(["eval", "--model", "tiny:llama", str(p)]) == 0
    capsys.readouterr()
    assert seen[0]["n"] == 3 and seen[0]["max_new_tokens"] == 2
    assert "steps is not used" in fails(capsys, "eval", "--model", "tiny:llama", str(p),
                                        "steps=3")  # on the command line: asked for, unused


def test_eval_model_next_to_the_model_flag_is_an_error(capsys):
    msg = fails(capsys, "eval", "--model", "tiny:llama", *TINY, "model=tiny:tiny_moe")
    assert msg.startswith("gspo eval: error: model:") and "--model" in msg


def test_eval_device_is_honoured(capsys):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    assert "device=cuda" in fails(capsys, "eval", "--model", "tiny:llama", *TINY,
                                  "device=cuda")


@pytest.fixture
def seen(monkeypatch) -> list[dict[str, Any]]:
    """What ``evaluate`` was called with (it returns at once)."""
    import gspo.trainer.evaluate as ev

    calls: list[dict[str, Any]] = []

    def fake(model: Any, tokenizer: Any, examples: list[Any], scorer: Any,
             **kw: Any) -> dict[str, float]:
        p = next(model.parameters())
        calls.append({"dtype": p.dtype, "device": p.device, "weights": p.detach().float().sum(),
                      "threads": torch.get_num_threads(), "scorer": scorer, "n": len(examples),
                      "prompts": [ex.prompt for ex in examples], **kw})
        return {"accuracy": 0.0, "reward_mean": 0.0, "n": float(len(examples))}

    monkeypatch.setattr(ev, "evaluate", fake)
    return calls


def test_eval_honours_dtype_seed_threads_rewards_and_turns(capsys, seen):
    torch.set_num_threads(2)  # the one_thread fixture restores it
    base = ["eval", "--model", "tiny:llama", "task.eval_size=3", "device=cpu"]
    assert main([*base, "seed=1"]) == 0
    assert main([*base, "seed=2", "num_threads=1", "reward.timeout_s=5",
                 "rollout.eval_max_new_tokens=4"]) == 0
    assert main([*base, "dtype=bfloat16", "rollout.max_turns=2", "rollout.env=python"]) == 0
    capsys.readouterr()
    first, second, third = seen
    assert first["dtype"] == torch.float32 and third["dtype"] == torch.bfloat16
    assert not torch.equal(first["weights"], second["weights"])  # seed: the tiny model's init
    assert first["threads"] == 2 and second["threads"] == 1
    assert torch.get_num_threads() == 2  # restored after the command
    assert first["device"].type == "cpu" and first["n"] == 3
    assert first["scorer"].timeout_s == 60.0 and second["scorer"].timeout_s == 5.0
    assert first["turns"] is None and third["turns"] is not None
    assert second["max_new_tokens"] == 4


def test_eval_end_to_end(capsys, runs):
    assert main(["eval", "--model", str(_checkpoint(runs["full"])), *TINY]) == 0
    assert capsys.readouterr().out.strip().endswith("n 2")


def test_eval_of_a_runs_checkpoint_holds_out_the_runs_rows(capsys, tmp_path, seen):
    """A JSONL task's held-out rows are drawn with the seed: a checkpoint of a run is evaluated
    with its run's config.yaml (its seed), not on rows it trained on (with task.* on the
    command line and the default seed 0, 9 of 10 prompts of a seed=3 run were training rows);
    a checkpoint outside its run folder is evaluated as told, with a note on the seed."""
    from gspo.data import build_task

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "answer": str(i + 1)})
                            + "\n" for i in range(50)))
    task = ["task.name=jsonl", f"task.path={data}", "task.eval_size=10"]
    run = _run(tmp_path / "runs", "r", "seed=3", *task)
    trained = {ex.prompt for ex in build_task(load_config(run / "config.yaml", []).task, 3).rows}
    capsys.readouterr()
    for args in ([], task):
        assert main(["eval", "--model", str(_checkpoint(run)), *args]) == 0
        assert f"config: {run / 'config.yaml'} (the run's" in capsys.readouterr().out
        assert seen[-1]["n"] == 10 and not trained & set(seen[-1]["prompts"])
    copy = shutil.copytree(_checkpoint(run), tmp_path / "copy")
    assert main(["eval", "--model", str(copy), *task]) == 0
    assert "note: task.name=jsonl holds out rows drawn with the seed" in capsys.readouterr().out
    assert main(["eval", "--model", str(copy), *task, "seed=3"]) == 0
    assert "note:" not in capsys.readouterr().out
    assert not trained & set(seen[-1]["prompts"])


def test_eval_with_nothing_to_evaluate_is_an_error(capsys):
    assert "task.eval_size=0" in fails(capsys, "eval", "--model", "tiny:llama", "num_threads=1",
                                       "task.eval_size=0")


def test_train_names_no_final_checkpoint_that_save_final_false_did_not_write(tmp_path, capsys):
    """``gspo train``'s last line names the weights it wrote; with save_final=false there is
    no checkpoint of the last step, so it must not name one (it did: step_00000N)."""
    args = ["train", "model=tiny:llama", f"output_dir={tmp_path}", "run_name=r",
            "progress=false", "tensorboard=false", "steps=1", "eval_before=false",
            "rollout.max_new_tokens=3", "rollout.prompts_per_step=2", "rollout.group_size=2",
            "objective.num_minibatches=2", *TINY]
    assert main([*args, "save_final=false"]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "r" / "checkpoints").exists()
    assert "step_000001" not in out and "no checkpoint of the last step" in out, out
    assert main([*args, "run_name=saved"]) == 0  # the default: the checkpoint it wrote
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"weights: {tmp_path / 'saved' / 'checkpoints' / 'step_000001'} (" in line, line
    assert (tmp_path / "saved" / "checkpoints" / "step_000001").is_dir()
