"""The command line on bad input: exit code 2, one line on stderr, no run folder.

Everything runs in-process through ``gspo.cli.main``. No test loads or trains a model: every
error must be raised before the model is loaded.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from gspo.cli import main
from gspo.config import describe_fields


def fail(capsys, tmp_path: Path, *args: str, cmd: str = "train") -> str:
    runs = tmp_path / "runs"
    code = main([cmd, *args, f"output_dir={runs}"])
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert code == 2, (out, err)
    assert len(lines) == 1, err
    assert lines[0].startswith(f"gspo {cmd}: error: "), err
    assert "Traceback" not in err + out
    assert "run folder" not in out
    assert not runs.exists() or not any(runs.iterdir()), list(runs.iterdir())
    return lines[0]


def jsonl(tmp_path: Path, *lines: str) -> str:
    p = tmp_path / "data.jsonl"
    p.write_text("".join(line + "\n" for line in lines))
    return str(p)


TINY = "model=tiny:llama"  # never the real model, even if an error were not raised


# ----------------------------------------------------------------------------- config errors


def test_unknown_key(capsys, tmp_path):
    assert "'stpes'" in fail(capsys, tmp_path, TINY, "stpes=3")


def test_unknown_nested_key(capsys, tmp_path):
    assert "objective.eps" in fail(capsys, tmp_path, TINY, "objective.eps=0.1")


def test_wrong_type(capsys, tmp_path):
    assert "steps" in fail(capsys, tmp_path, TINY, "steps=abc")
    assert "eval_before" in fail(capsys, tmp_path, TINY, "eval_before=3")


@pytest.mark.parametrize("cmd", ["train", "validate"])
def test_option_the_objective_does_not_take(capsys, tmp_path, cmd):
    """CISPO takes no objective.aggregation: set, it is an error, never silently ignored."""
    line = fail(capsys, tmp_path, TINY, "objective.name=cispo", "objective.aggregation=token",
                cmd=cmd)
    assert "objective.aggregation" in line and "'cispo'" in line


def test_group_size_one(capsys, tmp_path):
    assert "rollout.group_size" in fail(capsys, tmp_path, TINY, "rollout.group_size=1")


def test_missing_config_file(capsys, tmp_path):
    assert "not found" in fail(capsys, tmp_path, str(tmp_path / "nope.yaml"), TINY)


def test_bad_yaml_file(capsys, tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("steps: [1\nmodel: 2001-13-45\n")
    assert "bad.yaml" in fail(capsys, tmp_path, str(p), TINY)
    p.write_text("model: 2001-13-45\nseed: !!int nope\n")
    assert "bad.yaml" in fail(capsys, tmp_path, str(p), TINY)


def test_positional_after_config(capsys, tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("steps: 1\n")
    assert "key=value" in fail(capsys, tmp_path, str(p), "steps", TINY)


def test_override_with_line_break_stays_one_line(capsys, tmp_path):
    fail(capsys, tmp_path, TINY, "ste\nps=1")


# ----------------------------------------------------------------------------- model errors


def test_missing_model_folder(capsys, tmp_path):
    msg = fail(capsys, tmp_path, "model=/nonexistent")
    assert "/nonexistent" in msg


def test_model_folder_without_config(capsys, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"")
    assert "config.json" in fail(capsys, tmp_path, f"model={folder}")


@pytest.mark.parametrize(("module", "args", "needle"), [
    ("llama_cpp", ["rollout.engine=llamacpp"], "rollout.engine=llamacpp needs llama-cpp-python"),
    ("vllm", ["rollout.engine=vllm"], "rollout.engine=vllm needs vLLM"),
    ("vllm", ["rollout.engine=vllm", "rollout.async_steps=1"], "rollout.engine=vllm needs vLLM"),
    ("peft", ["lora.r=4"], "lora.r > 0 needs the peft package"),
    # a reward's package: it failed only at the first scoring, after the run folder was made
    ("math_verify", ["reward.functions=[math_verify]"],
     "the math_verify reward needs the math_verify package (pip install math-verify)"),
    ("reasoning_gym", ["task.name=reasoning_gym", "task.subset=chain_sum",
                       "reward.functions=[reasoning_gym]"],
     "the reasoning_gym reward needs the reasoning_gym package"),
])
def test_an_optional_package_that_is_not_installed(capsys, tmp_path, monkeypatch, module, args,
                                                   needle):
    """An engine's (or LoRA's, or a reward's) package that is not installed: the one-line error
    saying what to install, before the run folder is made (it was a traceback; with
    async_steps=1 the engine process failed after the run folder's config.yaml was written)."""
    monkeypatch.setitem(sys.modules, module, None)  # `import module` fails as if absent
    assert needle in fail(capsys, tmp_path, TINY, *args)


def test_a_package_that_fails_to_import_keeps_its_traceback(tmp_path, monkeypatch):
    """Only an absent package is the one-line MissingPackage: one that is installed but whose
    own import fails raises that failure (a real bug, not "pip install vllm")."""
    from gspo.config import MissingPackage
    from gspo.rollout.vllm_engine import _import_vllm

    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("import gspo_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    with pytest.raises(ModuleNotFoundError, match="gspo_no_such_dependency") as e:
        _import_vllm()
    assert not isinstance(e.value, MissingPackage)
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    (tmp_path / "math_verify").mkdir()  # the same for a reward's package, when it scores
    (tmp_path / "math_verify" / "__init__.py").write_text("import gspo_no_such_dependency\n")
    monkeypatch.delitem(sys.modules, "math_verify", raising=False)
    from gspo.rewards.math import _import_math_verify

    with pytest.raises(ModuleNotFoundError, match="gspo_no_such_dependency") as e:
        _import_math_verify()
    assert not isinstance(e.value, MissingPackage)
    monkeypatch.delitem(sys.modules, "math_verify", raising=False)


# ----------------------------------------------------------------------------- dataset errors


def test_dataset_row_missing_answer(capsys, tmp_path):
    path = jsonl(tmp_path, '{"prompt": "1+1?", "answer": 2}', '{"prompt": "2+2?"}')
    msg = fail(capsys, tmp_path, TINY, "task.name=jsonl", f"task.path={path}")
    assert f"{path}:2: missing field 'answer'" in msg


def test_dataset_custom_answer_field_missing(capsys, tmp_path):
    path = jsonl(tmp_path, '{"prompt": "1+1?", "answer": 2}')
    msg = fail(capsys, tmp_path, TINY, "task.name=jsonl", f"task.path={path}",
               "task.answer_field=target")
    assert "'target'" in msg


@pytest.mark.parametrize("cmd", ["train", "validate"])
@pytest.mark.parametrize("field", ["prompt_field", "answer_field"])
def test_row_column_for_a_task_that_reads_no_rows(capsys, tmp_path, cmd, field):
    """task.prompt_field / task.answer_field name columns of rows; the arithmetic task (the
    default) reads none, so setting them is an error, never silently ignored."""
    msg = fail(capsys, tmp_path, TINY, f"task.{field}=question", cmd=cmd)
    assert f"task.{field}" in msg and "task.name=arithmetic reads no rows" in msg


def test_empty_dataset(capsys, tmp_path):
    path = jsonl(tmp_path)
    assert "empty" in fail(capsys, tmp_path, TINY, "task.name=jsonl", f"task.path={path}")
    path = jsonl(tmp_path, "", "   ")
    assert "empty" in fail(capsys, tmp_path, TINY, "task.name=jsonl", f"task.path={path}")


def test_invalid_json_line(capsys, tmp_path):
    path = jsonl(tmp_path, json.dumps({"prompt": "a", "answer": 1}), "{not json")
    msg = fail(capsys, tmp_path, TINY, "task.name=jsonl", f"task.path={path}")
    assert f"{path}:2: invalid JSON" in msg


def test_missing_dataset_and_eval_file(capsys, tmp_path):
    missing = tmp_path / "missing.jsonl"
    assert "not found" in fail(capsys, tmp_path, TINY, "task.name=jsonl", f"task.path={missing}")
    path = jsonl(tmp_path, json.dumps({"prompt": "a", "answer": 1}))
    msg = fail(capsys, tmp_path, TINY, "task.name=jsonl", f"task.path={path}",
               f"task.eval_path={missing}")
    assert "missing.jsonl" in msg


def test_jsonl_without_path(capsys, tmp_path):
    assert "task.path" in fail(capsys, tmp_path, TINY, "task.name=jsonl")


def test_unknown_task(capsys, tmp_path):
    assert "unknown task" in fail(capsys, tmp_path, TINY, "task.name=gsm8k")


# ----------------------------------------------------------------------------- names


def test_unknown_reward(capsys, tmp_path):
    assert "unknown reward 'nope'" in fail(capsys, tmp_path, TINY, "reward.functions=[nope]")


@pytest.mark.parametrize("spec", ["no_such_mod_xyz:f", ":f", "..rel:f", "json:nothing"])
def test_unimportable_reward(capsys, tmp_path, spec):
    assert spec in fail(capsys, tmp_path, TINY, f"reward.functions=['{spec}']")


def test_unknown_objective(capsys, tmp_path):
    msg = fail(capsys, tmp_path, TINY, "objective.name=nope")
    assert "nope" in msg and "gspo" in msg


def test_unknown_advantage(capsys, tmp_path):
    assert "nope" in fail(capsys, tmp_path, TINY, "objective.advantage=nope")


def test_resume_without_checkpoint(capsys, tmp_path):
    empty = tmp_path / "old_run"
    empty.mkdir()
    assert "checkpoint" in fail(capsys, tmp_path, TINY, f"resume={empty}")


def test_resume_refuses_a_run_name_naming_another_folder(capsys, tmp_path):
    """``resume=RUN`` continues in RUN: a run_name (with the output_dir) naming another folder
    would be silently ignored, so it is a one-line error (the run's own name is fine)."""
    run = tmp_path / "old" / "first"
    run.mkdir(parents=True)
    err = fail(capsys, tmp_path, TINY, f"resume={run}", "run_name=forked")
    assert "another one" in err and "forked" in err
    # the run's own folder, written another way, is no error (it fails later: no checkpoint)
    assert main(["train", TINY, f"resume={run}/", f"output_dir={tmp_path / 'old'}",
                 "run_name=first"]) == 2
    _, err = capsys.readouterr()
    assert "checkpoint" in err and "another one" not in err


def test_resume_of_a_copied_run_or_from_another_directory_keeps_its_saved_name(
        capsys, tmp_path, monkeypatch):
    """RUN/config.yaml names the folder the run was started in (output_dir relative to the
    directory it was started from): ``gspo train resume=COPY`` (what the refusal itself advises
    for a fork) and a resume from another directory continue the run; only a run_name given
    on the command line is checked (each fails later here: there is no checkpoint)."""
    from gspo.config import load_config, to_dict

    monkeypatch.chdir(tmp_path)
    saved = to_dict(load_config(None, [TINY, "output_dir=runs", "run_name=first"]))
    for name in ("first", "fork"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "config.yaml").write_text(yaml.safe_dump(saved))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for cwd, run in ((tmp_path, "runs/fork"), (elsewhere, str(tmp_path / "runs" / "first"))):
        monkeypatch.chdir(cwd)
        assert main(["train", f"resume={run}"]) == 2
        _, err = capsys.readouterr()
        assert "checkpoint" in err and "another one" not in err, err
    assert main(["train", f"resume={tmp_path / 'runs' / 'first'}", "run_name=forked"]) == 2
    assert "another one" in capsys.readouterr().err


def test_resume_refuses_another_model(capsys, tmp_path):
    """``resume=RUN model=OTHER``: the resumed policy is the checkpoint's, so OTHER was
    silently unused (a nonexistent model resumed fine) or, with objective.beta > 0, became the
    KL reference of a run that trained against its own model; train and validate refuse it,
    and the run's own model, written as another path to the same folder, is no error."""
    runs = tmp_path / "runs"
    args = ["train", TINY, "steps=1", "eval_before=false", "task.eval_size=0",
            "objective.beta=0.01", "rollout.prompts_per_step=1", "rollout.group_size=2",
            "rollout.max_new_tokens=4", "objective.num_minibatches=1", f"output_dir={runs}",
            "run_name=r"]
    assert main(args) == 0
    capsys.readouterr()
    run = runs / "r"
    for cmd in ("train", "validate"):
        assert main([cmd, f"resume={run}", "model=tiny:mixtral", "steps=2"]) == 2
        err = capsys.readouterr().err
        assert "model=tiny:mixtral: resume=" in err and "whose model is tiny:llama" in err, err
    assert main(["validate", f"resume={run}", "steps=2"]) == 0
    capsys.readouterr()
    # LoRA on for a run that trained its full weights: a one-line error (it was a raw
    # FileNotFoundError for adapter_config.json)
    assert main(["train", f"resume={run}", "lora.r=4", "steps=2"]) == 2
    assert "lora.r=4: resume=" in capsys.readouterr().err


def test_resume_continues_with_the_runs_own_config(tmp_path, monkeypatch):
    """``gspo train resume=RUN`` (the line an interrupted run prints) continues the run with
    RUN/config.yaml, not with the defaults (which silently switched a GRPO run on a tiny model
    to GSPO on SmolLM2); key=value overrides given with it still apply on top."""
    import dataclasses

    import gspo.trainer
    from gspo.config import load_config, to_dict

    run = tmp_path / "run"
    run.mkdir()
    started = load_config("tiny_cpu", ["objective.name=grpo", "objective.eps_low=0.2",
                                       "objective.eps_high=0.27", "task.eval_size=4"])
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(started), sort_keys=False))

    class Built(Exception):
        pass

    seen = []

    class Recorder:  # stands in for the Trainer: records the config, trains nothing
        def __init__(self, cfg):
            seen.append(cfg)
            raise Built

    monkeypatch.setattr(gspo.trainer, "Trainer", Recorder)
    with pytest.raises(Built):
        main(["train", f"resume={run}", "steps=20"])
    assert seen == [dataclasses.replace(started, resume=str(run), steps=20)]


# ----------------------------------------------------------------------------- commands


def test_unknown_command(capsys):
    assert main(["trian", "steps=1"]) == 2
    _, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gspo: ")
    assert "unknown command 'trian'" in lines[0] and "train" in lines[0]


def test_top_level_help(capsys):
    assert main(["--help"]) == 0
    out, err = capsys.readouterr()
    assert "usage: gspo" in out and "train" in out and "validate" in out
    assert err == ""


@pytest.mark.parametrize("cmd", ["train", "validate"])
def test_command_help_lists_every_key(capsys, cmd):
    assert main([cmd, "--help"]) == 0
    out, _ = capsys.readouterr()
    for key, _, help_text in describe_fields():
        assert key in out, key
        assert help_text in out, key


def test_validate_yaml(capsys, tmp_path):
    p = tmp_path / "preset.yaml"
    p.write_text(yaml.safe_dump({"model": "tiny:llama", "steps": 2,
                                 "objective": {"eps_low": "3e-4", "name": "grpo"},
                                 "task": {"levels": [1, 3]}}))
    assert main(["validate", str(p), "seed=3"]) == 0
    out, err = capsys.readouterr()
    assert "ok" in out and err == ""
    assert main(["validate"]) == 0  # defaults
    capsys.readouterr()


def test_validate_errors(capsys, tmp_path):
    p = tmp_path / "preset.yaml"
    p.write_text("rollout:\n  group_size: 1\n")
    msg = fail(capsys, tmp_path, str(p), cmd="validate")
    assert "group_size" in msg


def test_eval_missing_model_folder(capsys, tmp_path):
    code = main(["eval", "--model", str(tmp_path / "nope"), "task.eval_size=2"])
    _, err = capsys.readouterr()
    assert code == 2
    assert err.splitlines() == [f"gspo eval: error: model: folder not found: {tmp_path / 'nope'}"]


def test_eval_of_a_lora_checkpoint_says_to_merge_it(capsys, tmp_path):
    """A LoRA run's checkpoint holds an adapter, no config.json: the error says how to get a
    model out of it."""
    ckpt = tmp_path / "step_000002"
    ckpt.mkdir()
    (ckpt / "adapter_config.json").write_text("{}")
    assert main(["eval", "--model", str(ckpt), "task.eval_size=2"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "LoRA adapter" in line and "gspo export RUN_DIR --merged OUT" in line


@pytest.mark.parametrize("model, needle", [
    ("tiny:lama", "unknown tiny model 'tiny:lama'"),
    ("/nonexistent/model", "folder not found: /nonexistent/model"),
    ("sfft:tiny_moe", "unknown model source 'sfft:'"),
])
def test_validate_checks_the_model_name_without_loading_it(capsys, tmp_path, model, needle):
    assert needle in fail(capsys, tmp_path, f"model={model}", cmd="validate")


@pytest.mark.parametrize("args, needle", [
    (["reward.functions=[nope]"], "unknown reward 'nope'"),
    (["reward.functions=[nomod:fn]"], "reward 'nomod:fn' cannot be imported"),
    (["task.name=nope"], "task.name: unknown task 'nope'"),
    (["rollout.max_turns=2", "rollout.env=nope"], "rollout.env: unknown environment 'nope'"),
    (["resume=/nonexistent/run"], "resume: no complete checkpoint in /nonexistent/run"),
    (["logging.rollout_check_every=2"], "logging.rollout_check_every=2: this run recomputes"),
    (["model=tiny:qwen3_moe", "objective.old_logprobs=rollout",
      "logging.rollout_check_every=2"], "(an MoE policy's routing), so it is unused"),
    (["moe.routing_replay=r2"], "need a Mixture-of-Experts model; tiny:llama is dense"),
    (["model=sft:llama", "moe.aux_loss_coef=0.01"], "sft:llama is dense"),
    (["model=tiny:qwen3_moe", "compile_layers=true"], "this policy has Mixture-of-Experts"),
    (["model=tiny:qwen3_moe", "rollout.engine=llamacpp", "moe.routing_replay=r3"],
     "moe.routing_replay=r3 needs rollout-recorded routing"),
    (["task.eval_size=0", "eval_every=2"], "eval_every=2: there is no held-out set"),
    # gspo's own sampler decodes only evaluation when another engine samples the rollouts
    (["rollout.engine=llamacpp", "rollout.decode_matmul=blas", "task.eval_size=0",
      "eval_before=false"], "rollout.decode_matmul=blas: there is no held-out set"),
    (["objective.old_logprobs=rollout", "logging.rollout_check_every=0",
      "guard.collapse_entropy_floor=0.5"], "guard.collapse_entropy_floor=0.5: train/entropy"),
    (["rollout.async_steps=1", "rollout.async_engines=5"],
     "rollout.async_engines=5: each engine needs a prompt"),
    (["lora.r=4", "lora.target_modules=[q_proj,nope_proj]"],
     "lora: target_modules ['nope_proj'] match no module of LlamaForCausalLM"),
    (["lora.r=4", "lora.target_modules=[lm_head]"], "whose weight LlamaForCausalLM shares"),
])
def test_validate_refuses_what_train_refuses_at_setup_without_loading(capsys, tmp_path, args,
                                                                       needle):
    """What `gspo train` refuses at setup and the config, the registries, ``resume`` and the
    model's architecture (its config on the meta device, no weights) decide, `gspo validate`
    refuses too, by the same check (it said "ok" to each of these, which train then refused);
    train refuses them with the same message."""
    assert needle in fail(capsys, tmp_path, TINY, *args, cmd="validate")


def test_validate_says_what_it_leaves_to_train(capsys):
    """Its last lines: what only `gspo train` checks, then "ok"; an option whose use depends
    on the launch (vLLM at async_steps=0 runs the engine-process pipeline under torchrun
    only) passes, with a line saying so; an MoE option on a cold start's MoE passes."""
    assert main(["validate", TINY]) == 0
    out = capsys.readouterr().out
    assert out.endswith("not checked before loading: what needs the model's weights and "
                        "tokenizer (compile_layers, matmul, reward.overlong_buffer, "
                        "moe.router_lr_scale with lora), the task's rows, the launch (device, "
                        "torchrun, rollout.async_address hosts, the engine's package), a "
                        "resumed checkpoint's contents\ndefaults: ok\n"), out
    assert main(["validate", TINY, "rollout.engine=vllm", "logging.rollout_check_every=2"]) == 0
    out = capsys.readouterr().out
    assert "not checked: logging.rollout_check_every=2: this run recomputes" in out
    assert "under torchrun" in out and out.endswith("defaults: ok\n")
    assert main(["validate", "model=sft:tiny_moe", "moe.routing_replay=r2"]) == 0
    # evaluation decodes with gspo's sampler whatever the engine: its kernels may be chosen
    assert main(["validate", TINY, "rollout.engine=llamacpp", "rollout.decode_matmul=blas"]) == 0
    assert main(["validate", TINY, "rollout.async_steps=1", "logging.rollout_check_every=2",
                 "task.eval_size=0", "eval_before=false"]) == 0
    capsys.readouterr()


def test_validate_resume_checks_the_runs_own_config(capsys, tmp_path):
    """`gspo validate resume=RUN` checks RUN/config.yaml, as `gspo train resume=RUN` runs it
    (it checked the defaults: the bundled SmolLM2, the run's model unseen)."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "checkpoints" / "step_000001" / "state.json").write_text("{}")
    (run / "config.yaml").write_text(yaml.safe_dump({"model": "tiny:llama",
                                                     "moe": {"routing_replay": "r2"}}))
    msg = fail(capsys, tmp_path, f"resume={run}", cmd="validate")
    assert "need a Mixture-of-Experts model; tiny:llama is dense" in msg
    (run / "config.yaml").write_text(yaml.safe_dump({"model": "tiny:llama",
                                                     "output_dir": str(tmp_path),
                                                     "run_name": "run"}))
    assert main(["validate", f"resume={run}"]) == 0
    assert capsys.readouterr().out.endswith(f"{run / 'config.yaml'}: ok\n")
    assert "continues the run in its own folder" in fail(
        capsys, tmp_path, f"resume={run}", "run_name=other", cmd="validate")


def test_validate_refuses_a_run_name_whose_folder_holds_a_run(capsys, tmp_path):
    """A new run into a folder that holds one: train refuses it at setup, validate too."""
    (tmp_path / "runs" / "done").mkdir(parents=True)
    (tmp_path / "runs" / "done" / "metrics.jsonl").write_text("")
    assert main(["validate", TINY, f"output_dir={tmp_path / 'runs'}", "run_name=done"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gspo validate: error: run folder {tmp_path / 'runs' / 'done'} "
                          "already holds a run"), err
    assert main(["validate", TINY, f"output_dir={tmp_path / 'runs'}", "run_name=new"]) == 0
    capsys.readouterr()


def test_validate_a_compare_file_with_overrides_checks_every_arm(capsys):
    assert main(["validate", "moe/compare", "steps=2"]) == 0  # it took `base` for a config key
    assert capsys.readouterr().out.endswith(": ok\n")
    assert main(["validate", "moe/compare", "objective.tau_pos=2"]) == 2
    err = capsys.readouterr().err
    assert "arm 'gspo': objective.tau_pos=2.0: objective 'gspo' does not take" in err
    assert main(["validate", "moe/compare", "model=tiny:nope"]) == 2
    assert "arm 'gspo': model: unknown tiny model" in capsys.readouterr().err


def test_a_path_that_is_not_a_folder_is_a_one_line_error(capsys, tmp_path):
    (tmp_path / "afile").write_text("")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    assert main(["plot", str(run), "--out", str(tmp_path / "afile" / "plots")]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("gspo plot: error: ") and len(err.splitlines()) == 1
    assert "Traceback" not in out + err


@pytest.mark.parametrize("preset", [None, "random", "7"])
def test_the_gspo_command_fixes_string_hashing(preset):
    """`gspo` (here `entry`, what the console script and `python -m gspo` call) without
    PYTHONHASHSEED starts itself again with PYTHONHASHSEED=0, so every process of a run
    hashes strings alike (reasoning-gym datasets that draw in set order drew other problems
    in each process); a value the user set is kept, and the command runs once."""
    import subprocess

    code = ("import os, sys\nfrom gspo.cli import entry\n"
            "print('hash', os.environ.get('PYTHONHASHSEED'), hash('gspo'), flush=True)\n"
            "sys.argv = ['gspo', 'nope']\nsys.exit(entry())\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if preset is not None:
        env["PYTHONHASHSEED"] = preset
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=120) for _ in range(2)]
    for r in runs:
        assert r.returncode == 2 and "unknown command 'nope'" in r.stderr, r.stderr
    lines = [[ln.split() for ln in r.stdout.splitlines() if ln.startswith("hash")] for r in runs]
    if preset is None:
        assert [ln[-1][1] for ln in lines] == ["0", "0"]
        assert [len(ln) for ln in lines] == [2, 2]  # the first pass, then the command again
        assert lines[0][-1][2] == lines[1][-1][2]  # the same hashes in two processes
    else:
        assert [ln[0][1] for ln in lines] == [preset, preset]
        assert [len(ln) for ln in lines] == [1, 1]
