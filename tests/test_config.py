"""gspo.config: defaults, YAML + dotted overrides, type checking, cross-field validation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from gspo.config import (
    ConfigError,
    TrainConfig,
    describe_fields,
    load_config,
    parse_override,
    to_dict,
    validate,
)

ROOT = Path(__file__).resolve().parents[1]


def _one_line_error(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert len(msg.splitlines()) == 1, msg
    return msg


# ----------------------------------------------------------------------------- defaults


def test_defaults_validate():
    cfg = TrainConfig()
    validate(cfg)
    assert load_config() == cfg
    assert load_config(None, []) == cfg


def test_default_lists_are_not_shared():
    a, b = TrainConfig(), TrainConfig()
    a.task.levels.append(4)
    a.reward.functions.append("x")
    assert b.task.levels == [1, 2]
    assert b.reward.functions == ["numeric_match"]


# ----------------------------------------------------------------------------- overrides


def test_dotted_overrides():
    cfg = load_config(None, ["objective.eps_high=4e-4", "task.levels=[1,3]", "model=/x",
                             "steps=7", "task.chat_template=false", "objective.eps_low=1e-3",
                             "optim.lr=0.5", "objective.scale_rewards=batch"])
    assert cfg.objective.eps_high == pytest.approx(4e-4)
    assert isinstance(cfg.objective.eps_high, float)
    assert cfg.objective.eps_low == pytest.approx(1e-3)
    assert cfg.task.levels == [1, 3]
    assert cfg.model == "/x"
    assert cfg.steps == 7
    assert cfg.task.chat_template is False
    assert cfg.optim.lr == 0.5
    assert cfg.objective.scale_rewards == "batch"


def test_override_later_wins_and_int_becomes_float():
    cfg = load_config(None, ["steps=3", "steps=5", "optim.lr=1"])
    assert cfg.steps == 5
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)


def test_override_value_with_equals_and_empty_string():
    cfg = load_config(None, ["task.system_prompt=a=b", "run_name="])
    assert cfg.task.system_prompt == "a=b"
    assert cfg.run_name == ""


def test_numeric_looking_strings_stay_strings():
    cfg = load_config(None, ["run_name=123", "model=1.5"])
    assert cfg.run_name == "123" and cfg.model == "1.5"


@pytest.mark.parametrize("override, key, text", [
    ("run_name=0123", "run_name", "0123"),  # YAML 1.1: octal 83
    ("run_name=12:30", "run_name", "12:30"),  # YAML 1.1: sexagesimal 750
    ("run_name=1_000", "run_name", "1_000"),
    ("run_name=1.10", "run_name", "1.10"),
    ("model=2001-12-14", "model", "2001-12-14"),  # a date
    ("task.system_prompt=Answer after #### on its own line", "task.system_prompt",
     "Answer after #### on its own line"),  # cut at the comment
    ("task.system_prompt=#1 rule: be brief", "task.system_prompt", "#1 rule: be brief"),
    ("task.system_prompt=Reply: a number", "task.system_prompt", "Reply: a number"),  # mapping
    ("task.system_prompt=yes", "task.system_prompt", "yes"),  # a boolean
    ("task.system_prompt=- be brief", "task.system_prompt", "- be brief"),  # a list
    ("task.system_prompt=&a x", "task.system_prompt", "&a x"),  # an anchor
    ("task.prompt_template={problem} =", "task.prompt_template", "{problem} ="),
    ("run_name='0123'", "run_name", "0123"),  # one YAML-quoted string: unquoted
    ('task.system_prompt="a #b"', "task.system_prompt", "a #b"),
])
def test_string_overrides_keep_their_text(override, key, text):
    """A string field takes an override's text as written: YAML would turn it into another
    string (silently) or into a number, date, mapping or list (an error)."""
    assert getattr_dotted(load_config(None, [override]), key) == text


def test_parse_override_shapes():
    assert parse_override("a.b.c=1") == {"a": {"b": {"c": 1}}}
    assert parse_override("x=[1, 2]") == {"x": [1, 2]}
    assert parse_override("x=hello: [") == {"x": "hello: ["}  # invalid YAML: kept as text
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("steps")
    with pytest.raises(ConfigError, match="empty key"):
        parse_override("=3")
    with pytest.raises(ConfigError, match="empty key"):
        parse_override("task..levels=3")


@pytest.mark.parametrize("value", ["1e-3", "1E-3", "1e3", "0.5", ".5", "3", "+2e-2"])
def test_float_fields_accept_number_strings(value, tmp_path):
    assert load_config(None, [f"optim.lr={value}"]).optim.lr == pytest.approx(float(value))
    # YAML 1.1 reads 1e-3 (no dot) as a string; quoted strings must work too.
    p = tmp_path / "c.yaml"
    p.write_text(f"objective:\n  beta: '{value}'\n")
    beta = load_config(p).objective.beta
    assert beta == pytest.approx(float(value)) and isinstance(beta, float)


def test_float_from_unquoted_yaml_exponent(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  lr: 1e-3\nobjective:\n  eps_low: 3e-4\n  eps_high: 4.0e-4\n")
    cfg = load_config(p)
    assert cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.objective.eps_low == pytest.approx(3e-4)
    assert cfg.objective.eps_high == pytest.approx(4e-4)


# ----------------------------------------------------------------------------- YAML files


def test_yaml_then_overrides_precedence(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"steps": 11, "seed": 3, "task": {"levels": [2]},
                                 "objective": {"eps_high": 0.3, "eps_low": 0.2}}))
    cfg = load_config(p, ["steps=12", "objective.eps_high=0.5"])
    assert cfg.steps == 12  # override beats YAML
    assert cfg.seed == 3  # YAML beats default
    assert cfg.task.levels == [2]
    assert cfg.objective.eps_high == 0.5
    assert cfg.objective.eps_low == 0.2
    assert cfg.rollout.group_size == TrainConfig().rollout.group_size  # default kept
    assert load_config(str(p)).steps == 11  # str paths work


def test_empty_yaml_is_defaults(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("# nothing here\n")
    assert load_config(p) == TrainConfig()


def test_roundtrip_through_yaml(tmp_path):
    cfg = load_config(None, ["task.levels=[1,3]", "objective.name=grpo", "optim.lr=1e-5"])
    p = tmp_path / "dump.yaml"
    p.write_text(yaml.safe_dump(to_dict(cfg)))
    assert load_config(p) == cfg


def test_missing_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="not found") as e:
        load_config(tmp_path / "nope.yaml")
    assert "nope.yaml" in _one_line_error(e)


@pytest.mark.parametrize("text", ["steps: [1\n", "a: b: c\n", "\x00\x01", "- 1\n- 2\n", "3\n",
                                  "steps: !!python/object:os.system x\n",
                                  "model: 2001-13-45\n", "model: !!int nope\n"])
def test_bad_yaml_documents(tmp_path, text):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    _one_line_error(e)


# ----------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize("override, key", [
    ("stpes=3", "stpes"),
    ("objective.eps=0.1", "objective.eps"),
    ("task.levels.x=1", "task.levels"),
    ("nope.deeper=1", "nope"),
])
def test_unknown_key_override(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert key in _one_line_error(e)


def test_unknown_key_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("steps: 3\nrollout:\n  group_sise: 4\n")
    with pytest.raises(ConfigError, match=r"rollout\.group_sise") as e:
        load_config(p)
    msg = _one_line_error(e)
    assert "group_size" in msg  # lists the valid keys
    p.write_text("lerning_rate: 3\n")
    with pytest.raises(ConfigError, match="lerning_rate"):
        load_config(p)


def test_section_must_be_mapping():
    with pytest.raises(ConfigError, match="task") as e:
        load_config(None, ["task=3"])
    _one_line_error(e)


# ----------------------------------------------------------------------------- type mismatches


@pytest.mark.parametrize("override, field_name", [
    ("steps=abc", "steps"),
    ("rollout.group_size=2.5", "rollout.group_size"),
    ("steps=true", "steps"),
    ("eval_before=3", "eval_before"),
    ("progress=yes please", "progress"),
    ("task.levels=3", "task.levels"),
    ("task.levels=[1, x]", "task.levels[1]"),
    ("reward.weights=1.0", "reward.weights"),
    ("objective.scale_rewards=zscore", "objective.scale_rewards"),
    ("dtype=float16", "dtype"),
    ("optim.lr=fast", "optim.lr"),
    ("optim.lr=true", "optim.lr"),
    ("optim.lr=[1]", "optim.lr"),
    ("model=[a, b]", "model"),
    ("model={a: 1}", "model"),
    ("moe.routing_replay=r4", "moe.routing_replay"),
])
def test_type_mismatch_names_field(override, field_name):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert field_name in _one_line_error(e)


def test_literal_error_lists_choices():
    with pytest.raises(ConfigError, match=r"'group'.*'batch'.*'none'"):
        load_config(None, ["objective.scale_rewards=std"])


def test_huge_integer_for_float_field():
    with pytest.raises(ConfigError, match=r"optim\.lr") as e:
        load_config(None, ["optim.lr=" + "9" * 400])
    _one_line_error(e)


def test_user_text_with_line_breaks_stays_one_line(tmp_path):
    for item in ["mo\ndel=1", "steps\u2028=1", "a\rb"]:
        with pytest.raises(ConfigError) as e:
            load_config(None, [item])
        _one_line_error(e)
    p = tmp_path / "c.yaml"
    p.write_text('"bad\\nkey": 1\n')
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "bad\\nkey" in _one_line_error(e)


def test_yaml_timestamp_like_override_is_a_string_or_error():
    # PyYAML raises ValueError for impossible dates; the override falls back to the raw text.
    assert load_config(None, ["model=2001-13-45"]).model == "2001-13-45"
    assert load_config(None, ["run_name=!!bool maybe"]).run_name == "!!bool maybe"


# ----------------------------------------------------------------------------- cross-field


@pytest.mark.parametrize("overrides, needle", [
    (["rollout.group_size=1"], "rollout.group_size"),
    (["rollout.group_size=0"], "rollout.group_size"),
    (["rollout.group_size=2", "rollout.prompts_per_step=2", "objective.num_minibatches=5"],
     "objective.num_minibatches"),
    (["objective.num_minibatches=0"], "objective.num_minibatches"),
    (["task.levels=[1,2]", "task.level_weights=[1.0]"], "task.level_weights"),
    (["task.level_weights=[0, 0]"], "task.level_weights"),
    (["task.level_weights=[-1, 2]"], "task.level_weights"),
    (["task.name=jsonl"], "task.path"),
    (["task.levels=[]"], "task.levels"),
    (["task.levels=[5]"], "levels"),
    (["task.eval_levels=[0]"], "levels"),
    (["task.operations=['/']"], "task.operations"),
    (["task.operations=[]"], "task.operations"),
    (["rollout.temperature=0"], "rollout.temperature"),
    (["rollout.top_p=0"], "rollout.top_p"),
    (["rollout.top_p=1.5"], "rollout.top_p"),
    (["rollout.engine=sglang"], "rollout.engine"),
    (["objective.eps_low=1"], "objective.eps_low"),
    (["objective.beta=-0.1"], "objective.beta"),
    (["objective.epochs=0"], "objective.epochs"),
    (["optim.betas=[0.9]"], "optim.betas"),
    (["reward.functions=[a, b]", "reward.weights=[1.0]"], "reward.weights"),
    (["reward.functions=[]"], "reward.functions"),
    (["reward.max_unscorable_frac=1.5"], "reward.max_unscorable_frac"),
    (["steps=-1"], "steps"),
    (["keep_checkpoints=0"], "keep_checkpoints"),
    (["rollout.temperature=nan"], "rollout.temperature"),
    (["rollout.decode_matmul=blas", "rollout.fast_decode=false"], "rollout.decode_matmul=blas"),
    (["rollout.decode_matmul=onednn", "device=cuda:0"], "rollout.decode_matmul=onednn"),
    (["rollout.decode_matmul=mkl"], "rollout.decode_matmul"),
    (["compile_layers=true", "lean_forward=false"], "compile_layers=true"),
    (["lora.r=4", "rollout.engine=llamacpp"], "syncing LoRA weights into llamacpp"),
    # options the rest of the config leaves unused
    (["rollout.vllm_memory_fraction=0.5"], "rollout.vllm_memory_fraction is used only"),
    (["lora.alpha=32"], "lora.alpha is used only with lora.r > 0"),
    (["lora.target_modules=[q_proj]"], "lora.target_modules is used only"),
    (["guard.on_fault=stop", "guard.lr_factor=0.2"], "guard.lr_factor is used only"),
    (["guard.on_fault=stop", "guard.max_rollbacks=5"], "guard.max_rollbacks is unused"),
    (["guard.collapse_window=10"], "guard.collapse_window is the window"),
    (["guard.max_consecutive_faults=0", "guard.on_fault=stop"], "the guard watches nothing"),
    (["guard.on_fault=lower_lr"], "guard.on_fault=lower_lr reloads the last good checkpoint"),
    (["task.name=countdown", "task.levels=[3]"], "task.levels is used only by task.name="
                                                 "arithmetic (task.name=countdown)"),
    (["task.name=dataset", "task.path=x", "task.eval_path=y.jsonl"],
     "task.eval_path is used only by task.name=jsonl"),
    (["task.name=jsonl", "task.path=x", "task.split=test"], "task.split is used only"),
    (["task.countdown_numbers=4"], "task.countdown_numbers is used only"),
    (["task.name=jsonl", "task.path=x", "task.eval_path=y", "task.eval_size=5"],
     "task.eval_size sizes the problems held out"),
    (["task.chat_template=false", "task.system_prompt=Be brief."], "task.system_prompt goes"),
    (["task.eval_size=0", "task.eval_levels=[3]"], "task.eval_levels are the levels of the "
                                                   "held-out problems; task.eval_size=0"),
    # values that used to pass and fail late (or act oddly)
    (["num_threads=-1"], "num_threads must be >= 0"),
    (["rollout.eval_max_new_tokens=0"], "rollout.eval_max_new_tokens must be >= 1"),
    (["optim.betas=[0.9,1.5]"], "optim.betas must be two values in [0, 1)"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay"),
    (["optim.grad_clip=-1"], "optim.grad_clip"),
    (["optim.warmup_steps=-3"], "optim.warmup_steps"),
    (["save_every=-1"], "save_every must be >= 0"),
    (["eval_every=-2"], "eval_every must be >= 0"),
    (["logging.rollout_check_every=-1"], "logging.rollout_check_every must be >= 0"),
    (["moe.aux_loss_coef=-1"], "moe.aux_loss_coef"),
    (["objective.beta=inf"], "objective.beta must be a finite number"),
    # infinities that used to train on: uniform sampling, every update skipped (a non-finite
    # loss), or a traceback mid-run (an infinite LoRA scaling or router learning rate)
    (["rollout.temperature=inf"], "rollout.temperature must be a finite number"),
    (["moe.aux_loss_coef=inf"], "moe.aux_loss_coef must be a finite number"),
    (["moe.router_lr_scale=inf"], "moe.router_lr_scale must be > 0 and finite"),
    (["lora.r=4", "lora.alpha=inf"], "lora.alpha must be a finite number"),
    # the hf engine records log π, not the top-p/top-k truncated distribution it samples from
    (["rollout.top_p=0.9", "objective.old_logprobs=rollout"], "rollout.engine=hf records log π"),
    (["rollout.top_k=20", "objective.old_logprobs=decoupled", "objective.correction.name=tis"],
     "rollout.top_p/top_k truncate"),
])
def test_cross_field_checks(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in _one_line_error(e)


def test_truncated_sampling_is_accepted_where_nothing_takes_the_recorded_log_probs_for_it():
    assert load_config(None, ["rollout.top_p=0.9"]).rollout.top_p == 0.9  # π_old recomputed
    assert load_config(None, ["rollout.top_k=20", "rollout.engine=vllm",
                              "objective.old_logprobs=rollout"]).rollout.top_k == 20


def test_cross_field_accepts_edges():
    cfg = load_config(None, ["rollout.group_size=2", "rollout.prompts_per_step=2",
                             "objective.num_minibatches=4", "task.levels=[1,2,3]",
                             "task.level_weights=[1, 0, 2]", "objective.eps_low=0.2",
                             "objective.eps_high=0.27"])
    assert cfg.objective.num_minibatches == 4
    assert cfg.task.level_weights == [1.0, 0.0, 2.0]
    assert load_config(None, ["task.name=jsonl", "task.path=/some/file.jsonl"]).task.path
    # the packed decode takes a bf16 rollout copy and a bf16 policy too
    for extra in ("rollout.precision=bf16", "dtype=bfloat16"):
        assert load_config(None, ["rollout.decode_matmul=onednn", extra]).rollout.decode_matmul \
            == "onednn"


def test_validate_on_mutated_config():
    cfg = TrainConfig()
    cfg.rollout.group_size = 1
    with pytest.raises(ConfigError, match="group_size"):
        validate(cfg)


# ----------------------------------------------------------------------------- shipped presets


def _preset_files() -> list[Path]:
    from gspo.presets import preset_files  # the packaged presets (configs/ links to them)

    files = preset_files()
    assert files
    return files


def test_every_shipped_preset_validates():
    from gspo.analysis.spec import is_compare_file, load_spec

    files = _preset_files()
    for f in files:
        if is_compare_file(f):  # a `gspo compare` arms file: every arm's config must build
            assert load_spec(f, quick=True).arms, f
            continue
        cfg = load_config(f)
        assert isinstance(cfg, TrainConfig), f
    # Nothing to check when no preset exists yet; the list is still well-formed.
    assert all(f.suffix in (".yaml", ".yml") for f in files)


# ----------------------------------------------------------------------------- describe_fields


def _leaf_keys(cls: type = TrainConfig, prefix: str = "") -> set[str]:
    out: set[str] = set()
    inst = cls()
    for f in dataclasses.fields(cls):
        value = getattr(inst, f.name)
        if dataclasses.is_dataclass(value):
            out |= _leaf_keys(type(value), f"{prefix}{f.name}.")
        else:
            out.add(f"{prefix}{f.name}")
    return out


def test_describe_fields_covers_every_leaf_with_help():
    rows = describe_fields()
    keys = [k for k, _, _ in rows]
    assert len(keys) == len(set(keys))
    assert set(keys) == _leaf_keys()
    for key, default, help_text in rows:
        assert help_text.strip(), f"{key} has no help"
        assert "\n" not in help_text, key
        assert isinstance(default, str)
    assert ("objective.eps_high", repr(4e-4)) in {(k, d) for k, d, _ in rows}


def test_every_described_key_is_settable_by_override():
    cfg = TrainConfig()
    for key, _, _ in describe_fields():
        obj = cfg
        *parents, leaf = key.split(".")
        for part in parents:
            obj = getattr(obj, part)
        value = getattr(obj, leaf)
        text = yaml.safe_dump(value, default_flow_style=True).strip()
        if text.endswith("..."):
            text = text[: -len("...")].strip()
        assert getattr_dotted(load_config(None, [f"{key}={text}"]), key) == value, key


def getattr_dotted(obj, key):
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def test_a_key_given_twice_in_a_config_file_is_an_error(tmp_path):
    """YAML keeps the last of two equal keys: a section or a field written twice would
    silently lose the first."""
    p = tmp_path / "twice.yaml"
    p.write_text("steps: 3\nrollout:\n  group_size: 4\n  group_size: 8\n")
    with pytest.raises(ConfigError, match=r"'rollout.group_size' is given twice \(lines 3 and 4\)"):
        load_config(p)
    p.write_text("base: &b {steps: 3}\nrun:\n  <<: *b\n  steps: 4\n")  # merge keys are fine
    from gspo.config import read_yaml

    assert read_yaml(p)["run"]["steps"] == 4
