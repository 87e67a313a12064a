"""The cold-start supervised stage: answer format, loss mask, learning, cache reuse."""

import os

import pytest

import gspo.trainer.sft as sft
from gspo.config import ConfigError, SFTConfig, load_sft_config
from gspo.data import ArithmeticTask
from gspo.models import load_model
from gspo.models.loading import resolve_model
from gspo.models.tiny import byte_tokenizer
from gspo.trainer.sft import cold_start, config_hash, read_info, response_text, sft_batch, sft_dir

# A few seconds: the small test MoE on one-digit sums (held-out problems never seen in training).
QUICK = ["base=tiny:qwen3_moe", "levels=[1]", "steps=80", "batch_size=16", "lr=5e-3",
         "warmup_steps=5", "eval_size=20"]


def test_answer_text_and_loss_mask_cover_only_the_response():
    task = ArithmeticTask([2], [], ["+", "-", "*"], [], 0, seed=3)
    examples = task.sample(4)
    for ex in examples:
        expr = ex.prompt.removeprefix("What is ").split("?")[0]
        assert response_text(ex) == f"{expr}={ex.answer}"
    tok = byte_tokenizer()
    cfg = SFTConfig()
    batch = sft_batch(tok, examples, cfg, eos_id=tok.eos_token_id)
    for i, ex in enumerate(examples):
        picked = batch["input_ids"][i][batch["response_mask"][i].bool()].tolist()
        assert picked[-1] == tok.eos_token_id
        assert tok.decode(picked[:-1]) == response_text(ex)


def test_cache_key_ignores_eval_size_only():
    """eval_size picks the problems evaluated, not the weights; num_threads changes the
    weights (CPU kernels split their sums by thread), so another count is cached apart."""
    base = SFTConfig()
    assert config_hash(base) == config_hash(SFTConfig(eval_size=7))
    assert config_hash(base) == config_hash(SFTConfig(num_threads=1, eval_size=7))
    assert config_hash(base) != config_hash(SFTConfig(num_threads=2))
    assert config_hash(SFTConfig(num_threads=0)) != config_hash(SFTConfig(num_threads=2))
    assert config_hash(base) != config_hash(SFTConfig(steps=base.steps + 1))
    assert config_hash(base) != config_hash(SFTConfig(system_prompt="Be brief."))


def test_the_unread_fused_key_is_refused_and_cache_keys_stay():
    """``fused`` was an SFT key that nothing read (the AdamW of the recipe was never the fused
    kernel): gone, refused like any unknown key, with the cache key of existing cold starts
    unchanged (the value every cache was keyed with stays in it)."""
    with pytest.raises(ConfigError, match="unknown config key 'fused'"):
        load_sft_config(None, ["fused=false"])
    assert config_hash(SFTConfig()) == "aaa0c43ab9905890"
    assert config_hash(SFTConfig(base="tiny:deep_moe", steps=700)) == "81ae6a50a0f61e93"


def test_sft_system_prompt_without_chat_template_is_refused():
    """The system prompt goes into the chat template only: with chat_template=false it was
    accepted and silently dropped (the prompts were the same token ids)."""
    with pytest.raises(ConfigError, match=r"^sft\.system_prompt goes into the chat template"):
        load_sft_config(None, ["chat_template=false", "system_prompt=Answer briefly."])
    assert load_sft_config(None, ["chat_template=false"]).system_prompt == ""
    assert load_sft_config(None, ["system_prompt=Answer briefly."]).chat_template


def test_bad_sft_config_is_one_line_error():
    with pytest.raises(ConfigError, match=r"sft\.levels"):
        load_sft_config(None, ["levels=[9]"])
    with pytest.raises(ConfigError, match="unknown config key 'stepz'"):
        load_sft_config(None, ["stepz=3"])


@pytest.mark.parametrize("option,needle", [
    ("lr=inf", "lr a finite number >= 0"),
    ("weight_decay=-1", "sft.weight_decay must be a number >= 0"),
    ("weight_decay=nan", "sft.weight_decay must be a number >= 0"),
    ("grad_clip=-1", "sft.grad_clip must be a number >= 0"),
    ("grad_clip=nan", "sft.grad_clip must be a number >= 0"),
])
def test_bad_sft_numbers_are_one_line_errors(option, needle):
    """Each of these trained and cached a model (lr=inf: NaN weights; a negative or NaN
    grad_clip: clipping silently off) or died in AdamW with a traceback (weight_decay < 0)."""
    with pytest.raises(ConfigError, match=needle):
        load_sft_config(None, [option])


def test_validate_checks_the_sft_sources_options(capsys):
    """`gspo validate` refuses the options of ``model=sft:<name>?...`` that train refuses (it
    said "ok", and a compare arm with a typo failed only when its turn came), and trains
    nothing to do so."""
    from gspo.cli import main

    assert main(["validate", "model=sft:tiny_moe?stepz=3"]) == 2
    assert "unknown config key 'stepz'" in capsys.readouterr().err
    assert main(["validate", "model=sft:tiny_moe?lr=inf"]) == 2
    assert "lr a finite number" in capsys.readouterr().err
    assert main(["validate", "model=sft:tiny_moe?base=tiny:llama"]) == 2
    assert "drop base=" in capsys.readouterr().err
    assert main(["validate", "model=sft:tiny_moe?steps=700&seed=1"]) == 0
    capsys.readouterr()


def test_gspo_sft_says_a_cached_cold_starts_accuracy_is_not_of_this_eval_size(
        tmp_path, monkeypatch, capsys):
    """eval_size is not in the cache key: `gspo sft eval_size=5` on a cold start built with
    100 printed the 100-problem accuracies as if measured on 5. It says how many problems,
    and that another eval_size applies to a rebuild."""
    import json

    from gspo.cli import main

    (tmp_path / "sft.json").write_text(json.dumps({
        "config": {"eval_size": 100}, "accuracy_before": 0.0, "accuracy_after": 0.42,
        "n_eval": 100}))
    monkeypatch.setattr(sft, "cold_start", lambda cfg, force=False: tmp_path)
    assert main(["sft", "eval_size=5"]) == 0
    out = capsys.readouterr().out
    assert "0.0% -> 42.0% on 100 problems; measured when it was built: eval_size=5" in out
    assert main(["sft", "eval_size=100"]) == 0
    out = capsys.readouterr().out
    assert "42.0% on 100 problems)" in out and "eval_size=" not in out


def test_sft_improves_held_out_accuracy_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("GSPO_CACHE", str(tmp_path))
    cfg = load_sft_config(None, QUICK)
    lines = []
    folder = cold_start(cfg, log=lines.append)
    info = read_info(folder)
    assert info["accuracy_before"] == 0.0 and info["n_eval"] >= 10
    assert info["accuracy_after"] > info["accuracy_before"], lines
    assert folder == sft_dir(cfg) and (folder / "config.json").is_file()
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temp folder left

    def no_training(*args, **kwargs):
        raise AssertionError("the cached cold start was trained again")

    monkeypatch.setattr(sft, "train_sft", no_training)
    assert cold_start(cfg) == folder
    # model: sft:<tiny name> resolves to the cached default cold start of that model
    monkeypatch.setattr(sft, "SFTConfig", lambda base: load_sft_config(None, [*QUICK,
                                                                             f"base={base}"]))
    assert resolve_model("sft:qwen3_moe") == folder
    model, tok = load_model("sft:qwen3_moe")
    assert tok.decode(tok("7+2=9")["input_ids"]) == "7+2=9" and tok.pad_token_id == 0
    assert type(model).__name__ == "Qwen3MoeForCausalLM"


def test_sft_source_takes_options_after_a_question_mark(monkeypatch):
    """``sft:<name>?steps=700`` is the cold start of that SFT config (cached by its hash); the
    base comes from the name, never from the options; bad options are config errors."""
    seen = []
    monkeypatch.setattr(sft, "cold_start", lambda cfg: seen.append(cfg) or "folder")
    assert resolve_model("sft:deep_moe?steps=700&lr=0.001") == "folder"
    assert (seen[-1].base, seen[-1].steps, seen[-1].lr) == ("tiny:deep_moe", 700, 0.001)
    assert config_hash(seen[-1]) != config_hash(SFTConfig(base="tiny:deep_moe"))
    resolve_model("sft:deep_moe")
    assert seen[-1] == SFTConfig(base="tiny:deep_moe")
    with pytest.raises(ConfigError, match="drop base="):
        resolve_model("sft:deep_moe?base=tiny:llama")
    with pytest.raises(ConfigError, match="unknown config key 'stepz'"):
        resolve_model("sft:deep_moe?stepz=3")


def test_cache_key_follows_a_folder_base(tmp_path, monkeypatch):
    """A base given as a folder keys the cache by that folder, not by how it is named: the
    same relative name in another directory, or the folder saved again, is another key."""
    model, tok = load_model("tiny:llama", seed=0)
    keys = []
    for i, where in enumerate(["a", "b", "b"]):
        (tmp_path / where).mkdir(exist_ok=True)
        model.save_pretrained(tmp_path / where / "base")
        tok.save_pretrained(tmp_path / where / "base")
        weights = tmp_path / where / "base" / "model.safetensors"  # the timestamp's resolution
        os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + i * 10**9))
        monkeypatch.chdir(tmp_path / where)
        keys.append(config_hash(SFTConfig(base="base")))
    assert len(set(keys)) == 3


def test_sft_answers_end_with_the_tokenizers_eos(tmp_path, monkeypatch):
    """A Llama-3-like base (the tokenizer's EOS ends a chat turn, the generation config also
    stops at a lower id) is taught to end its answers with the tokenizer's EOS."""
    model, tok = load_model("tiny:llama", seed=0)
    tok.add_special_tokens({"additional_special_tokens": ["<|eot|>"]})
    tok.eos_token = "<|eot|>"
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    model.generation_config.eos_token_id = [1, tok.eos_token_id]
    model.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    seen = []
    batch = sft.sft_batch
    monkeypatch.setattr(sft, "sft_batch", lambda t, ex, cfg, eos_id: seen.append(eos_id)
                        or batch(t, ex, cfg, eos_id))
    cfg = load_sft_config(None, [f"base={tmp_path / 'base'}", "steps=1", "batch_size=2",
                                 "eval_size=0", "levels=[1]"])
    sft.train_sft(cfg, log=lambda line: None)
    assert seen == [tok.eos_token_id]
