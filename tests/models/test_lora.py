"""LoRA through PEFT on a tiny model: trainable adapter only, reference = adapter disabled,
adapter-only checkpoints, resume, merged export loadable with from_pretrained."""

from __future__ import annotations

import json

import pytest
import torch

from gspo.cli.export import export_merged
from gspo.config import ConfigError, LoRAConfig, load_config
from gspo.models.logprobs import token_logprobs
from gspo.models.lora import apply_lora, reference_logprobs, unwrap
from gspo.models.tiny import build_tiny
from gspo.trainer import Trainer

pytest.importorskip("peft")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 250, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    target = torch.zeros_like(ids)
    target[:, 7:] = 1
    return ids, mask, target


def perturb(model, seed: int = 0) -> None:
    """LoRA starts as the identity (B = 0): give the adapter an effect."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def lora_model():
    model, tok = build_tiny("llama", seed=0)
    return apply_lora(model, LoRAConfig(r=4, alpha=8)), tok


def full_logprobs(model, ids, mask, target):
    """The definition, from whole logits, for comparison."""
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0)) * target


def peft_logprobs_supported(model) -> bool:
    try:
        token_logprobs(model, *batch())
    except AttributeError:
        return False
    return True


def test_only_the_adapter_trains_and_reference_is_the_base_model():
    pm, _ = lora_model()
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("lm_head" in n or "embed" in n for n in trainable)  # all-linear skips them
    base, _ = build_tiny("llama", seed=0)
    ids, mask, target = batch()
    with torch.no_grad():
        want_ref, _ = token_logprobs(base, ids, mask, target)
        perturb(pm)
        policy, _ = token_logprobs(unwrap(pm), ids, mask, target)
        assert torch.allclose(policy, full_logprobs(pm, ids, mask, target), atol=1e-5)
    assert (policy - want_ref).abs().max() > 1e-3  # the adapter changes the policy ...
    ref = reference_logprobs(pm, ids, mask, target)
    assert torch.allclose(ref, want_ref, atol=1e-6)  # ... and disabling it gives the base back
    assert not ref.requires_grad and pm.training  # mode restored


def _cfg(tmp_path, name, *extra):
    return load_config(None, [
        "model=tiny:llama", f"output_dir={tmp_path}", f"run_name={name}", "progress=false",
        "tensorboard=false", "num_threads=1", "rollout.max_new_tokens=4",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "task.eval_size=2",
        "objective.num_minibatches=2",
        "rollout.eval_max_new_tokens=4", "lora.r=4", "lora.alpha=8", *extra])


def test_adapter_checkpoint_resume_and_merged_export(tmp_path):
    trainer = Trainer(_cfg(tmp_path, "a", "steps=0", "objective.beta=0.1")).setup()
    assert trainer.ref_model is None  # no deep copy: the reference is the adapter switched off
    perturb(trainer.model)
    trainer.train()
    ckpt = trainer.run_dir / "checkpoints" / "step_000000"
    files = {p.name for p in ckpt.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files
    assert "model.safetensors" not in files  # adapter only
    adapter = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
               if "lora_" in n}

    # the adapter's shape comes from the checkpoint: another one in the config is refused
    for other in ("lora.r=8", "lora.alpha=16", "lora.dropout=0.1", "lora.target_modules=[q_proj]"):
        extra = ["disable_dropout=false"] if other.startswith("lora.dropout") else []
        with pytest.raises(ConfigError, match=f"resume: {other.split('=')[0]}="):
            Trainer(_cfg(tmp_path, "c", "steps=0", f"resume={trainer.run_dir}", other,
                         *extra)).setup()
    resumed = Trainer(_cfg(tmp_path, "b", "steps=0", f"resume={trainer.run_dir}")).setup()
    got = dict(resumed.model.named_parameters())
    for name, value in adapter.items():
        assert torch.equal(got[name], value), name
        assert got[name].requires_grad, name

    from transformers import AutoModelForCausalLM

    from gspo.cli import main

    assert main(["export", str(trainer.run_dir), "--merged", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids, mask, target = batch(1)
    with torch.no_grad():
        want = full_logprobs(trainer.model, ids, mask, target)
        assert torch.allclose(full_logprobs(merged, ids, mask, target), want, atol=1e-5)
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["model_type"] == "llama"
    assert (export_merged(trainer.run_dir, tmp_path / "again") / "tokenizer.json").is_file()


def test_lora_training_updates_only_the_adapter(tmp_path):
    trainer = Trainer(_cfg(tmp_path, "t", "steps=2", "optim.lr=1e-2", "eval_before=false",
                           "objective.name=grpo", "objective.eps_low=0.2",
                           "objective.eps_high=0.27")).setup()
    if not peft_logprobs_supported(trainer.model):
        pytest.xfail("gspo.models.logprobs._split does not unwrap PeftModel yet")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    perturb(trainer.model)  # with B = 0 the gradient reaches B only; make A move too
    trainer.train()
    after = dict(trainer.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all("lora_" in n for n in changed)


def test_merged_weights_are_merge_and_unloads_and_leave_the_policy_alone():
    """What a vLLM engine is synced with: every adapted weight W + ΔW under its Hugging Face
    name, bit for bit what PEFT's merge_and_unload gives, computed without touching the policy
    (merging in place and unmerging would not give its weights back bit for bit)."""
    import copy

    from gspo.models.lora import merged_weights

    model, _ = lora_model()
    perturb(model)  # lora_B starts at zero: ΔW = 0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = dict(merged_weights(model))
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == want.keys()
    assert all(torch.equal(merged[k], want[k]) for k in want)
    base = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], before[base])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())



def test_every_target_module_name_must_match_and_all_linear_stands_alone():
    """PEFT refuses a target list only when none of its names matches: a misspelt name beside
    a good one, or 'all-linear' beside a name, would silently adapt fewer layers."""
    from gspo.models.loading import ModelError

    model, _ = build_tiny("llama", seed=0)
    with pytest.raises(ModelError, match=r"\['v_prj'\] match no module"):
        apply_lora(model, LoRAConfig(r=4, target_modules=["q_proj", "v_prj"]))
    assert not any("lora_" in n for n, _ in model.named_parameters())  # left as it was
    with pytest.raises(ConfigError, match="'all-linear' stands alone"):
        load_config(None, ["lora.r=4", "lora.target_modules=[all-linear,lm_head]"])
    model, _ = build_tiny("llama", seed=0)
    adapted = apply_lora(model, LoRAConfig(r=4, target_modules=["q_proj", "self_attn.v_proj"]))
    assert {n.rpartition(".")[2] for n in adapted.targeted_module_names} == {"q_proj", "v_proj"}


def test_an_adapted_output_layer_counts_in_the_logprobs_and_trains():
    """lora.target_modules may name an untied output layer: its adapter is part of π (the
    fast head path, which reads the head's weight, would use the base weight alone) and gets a
    gradient; a tied one (tiny llama's) is refused, since merging would change the
    embeddings."""
    from gspo.models.loading import ModelError

    tied, _ = build_tiny("llama", seed=0)
    with pytest.raises(ModelError, match="shares with the input embeddings"):
        apply_lora(tied, LoRAConfig(r=4, target_modules=["q_proj", "lm_head"]))
    model, _ = build_tiny("qwen3_moe", seed=0)
    assert not model.config.tie_word_embeddings
    model = apply_lora(model, LoRAConfig(r=4, target_modules=["q_proj", "lm_head"]))
    perturb(model)
    ids, mask, target = batch()
    lp, _ = token_logprobs(model, ids, mask, target)
    with torch.no_grad():
        want = full_logprobs(model, ids, mask, target)
    assert float((lp - want).abs().max()) < 1e-5
    (-lp.sum()).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "lm_head.lora_" in n}
    assert len(grads) == 2 and all(g is not None and bool(g.abs().sum() > 0)
                                   for g in grads.values())


def test_adapting_tied_input_embeddings_is_refused():
    """Tied input embeddings (tiny llama's) were adapted: the policy's output layer reads the
    base weight only, but merging the adapter (gspo export, merged_weights for vLLM) changed
    the shared weight, so the output layer too: the exported model's logits were 15 away from
    the trained policy's. Refused, as an adapted tied output layer is; untied ones merge."""
    from gspo.models.loading import ModelError
    from gspo.models.lora import merged_weights

    tied, _ = build_tiny("llama", seed=0)
    with pytest.raises(ModelError, match=r"adapts the input embeddings model\.embed_tokens"):
        apply_lora(tied, LoRAConfig(r=4, target_modules=["q_proj", "embed_tokens"]))
    model, _ = build_tiny("qwen3_moe", seed=0)
    model = apply_lora(model, LoRAConfig(r=4, target_modules=["q_proj", "embed_tokens"]))
    perturb(model)
    for name, p in model.named_parameters():  # an embedding adapter starts with A = 0
        if "embed_tokens.lora_embedding_A" in name:
            with torch.no_grad():
                p.normal_()
    plain, _ = build_tiny("qwen3_moe", seed=0)
    plain.load_state_dict(dict(merged_weights(model)))
    ids, mask, _ = batch()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        assert torch.allclose(plain(input_ids=ids, attention_mask=mask).logits, want, atol=1e-4)


def test_merged_weights_fold_in_the_adapters_of_an_moe_routers_and_fused_experts():
    """lora.target_modules=all-linear on a Qwen3-MoE adapts its routers and fused experts
    (transformers 5 keeps them as parameters: PEFT wraps each in a ParamWrapper, the experts'
    two nested). merged_weights named those expert weights ``experts.base_layer.gate_up_proj``
    and left their adapter out, so a vLLM engine got no expert weights under their names."""
    import copy

    from gspo.models.lora import merged_weights

    model = apply_lora(build_tiny("qwen3_moe", seed=0)[0], LoRAConfig(r=4, alpha=8))
    assert {"gate_up_proj", "down_proj", "gate.weight"} <= set(
        model.peft_config["default"].target_parameters)
    perturb(model)
    merged = dict(merged_weights(model))
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == want.keys()
    assert all(torch.equal(merged[k], want[k]) for k in want)
    plain, _ = build_tiny("qwen3_moe", seed=0)
    plain.load_state_dict(merged)
    ids, mask, _ = batch()
    with torch.no_grad():
        got = plain(input_ids=ids, attention_mask=mask).logits
        adapted = model(input_ids=ids, attention_mask=mask).logits
        base = build_tiny("qwen3_moe", seed=0)[0](input_ids=ids, attention_mask=mask).logits
    assert float((adapted - base).abs().max()) > 1e-2  # the experts' adapters count ...
    assert torch.allclose(got, adapted, atol=1e-4)  # ... and are in the merged weights


def test_a_resume_compares_the_targets_peft_recorded(tmp_path):
    """The saved adapter records its targets as PEFT resolved them, not as given: an MoE
    router (``gate``) as a target *parameter*, all-linear as the names it chose. A run that
    adapted a Qwen3-MoE's router could not be resumed with its own config (its targets were
    compared with the saved target_modules alone), and resuming a [q_proj, v_proj] run with
    all-linear silently kept the two (all-linear was not compared at all)."""
    from gspo.models.lora import apply_lora as wrap

    saved = wrap(build_tiny("qwen3_moe", seed=0)[0],
                 LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "gate"]))
    saved.save_pretrained(tmp_path / "moe")
    resumed = wrap(build_tiny("qwen3_moe", seed=0)[0],
                   LoRAConfig(r=4, alpha=8, target_modules=["gate", "q_proj"]),
                   adapter_dir=tmp_path / "moe")
    assert resumed.peft_config["default"].target_parameters == {"gate.weight"}
    with pytest.raises(ConfigError, match=r"resume: lora\.target_modules=\['q_proj'\]"):
        wrap(build_tiny("qwen3_moe", seed=0)[0],
             LoRAConfig(r=4, alpha=8, target_modules=["q_proj"]), adapter_dir=tmp_path / "moe")

    two = wrap(build_tiny("llama", seed=0)[0],
               LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    two.save_pretrained(tmp_path / "two")
    with pytest.raises(ConfigError, match=r"lora\.target_modules=\['all-linear'\] .* but the "
                       r"checkpoint's adapter has modules \['q_proj', 'v_proj'\]"):
        wrap(build_tiny("llama", seed=0)[0], LoRAConfig(r=4, alpha=8),
             adapter_dir=tmp_path / "two")
    every = wrap(build_tiny("llama", seed=0)[0], LoRAConfig(r=4, alpha=8))
    every.save_pretrained(tmp_path / "every")
    wrap(build_tiny("llama", seed=0)[0], LoRAConfig(r=4, alpha=8), adapter_dir=tmp_path / "every")


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_merged_weights_of_a_bf16_policy_are_bf16_as_merge_and_unload_leaves_them(family):
    """PEFT keeps a bf16 model's adapter in fp32, so W + ΔW was an fp32 tensor: merged_weights
    gave every adapted weight of a bf16 policy in fp32 (the vLLM engine's start folder held
    them so, and each sync sent twice their bytes), where merge_and_unload and gspo export
    keep bf16. Same values, the policy's dtype."""
    import copy

    from gspo.models.lora import merged_weights

    model = apply_lora(build_tiny(family, seed=0, dtype=torch.bfloat16)[0],
                       LoRAConfig(r=4, alpha=8))
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    perturb(model)
    merged = dict(merged_weights(model))
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == want.keys()
    assert {v.dtype for v in merged.values()} == {torch.bfloat16}
    assert all(torch.equal(merged[k], want[k]) for k in want)


@pytest.mark.parametrize("model, lora, needle", [
    ("tiny:qwen3_moe", ["lora.dropout=0.1", "disable_dropout=false"],
     "lora: lora.ParamWrapper does not work with lora_dropout != 0. (the MoE routers"),
    ("tiny:llama", ["lora.target_modules=[q_proj,mlp]"],
     "lora: Target module LlamaMLP is not supported. Currently, only"),
])
@pytest.mark.parametrize("cmd", ["validate", "train"])
def test_what_peft_cannot_adapt_is_refused_by_validate_as_by_train(capsys, tmp_path, model,
                                                                   lora, needle, cmd):
    """gspo validate checked lora.target_modules' names only: a name of a module PEFT cannot
    adapt (an MLP block) and lora.dropout on an MoE model's all-linear adapter (PEFT adapts its
    routers and fused experts as parameters, without dropout) passed validate (and gspo
    compare's up-front checks) and failed gspo train after the weights were loaded, with the
    first line of PEFT's message ("lora: Target module LlamaMLP(")."""
    from gspo.cli import main

    code = main([cmd, f"model={model}", "lora.r=4", *lora, f"output_dir={tmp_path / 'runs'}",
                 "steps=1", "progress=false"])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    (line,) = err.splitlines()
    assert line.startswith(f"gspo {cmd}: error: {needle}"), line


def test_the_fast_paths_refuse_a_lora_policy_saying_so():
    """compile_layers / matmul=onednn with LoRA: refused as a LoRA policy (the reason said "not
    a causal-LM wrapper around a decoder with plain embeddings")."""
    from gspo.models.decode import unsupported

    model, _ = build_tiny("llama")
    assert unsupported(model) is None
    peft_model = apply_lora(model, LoRAConfig(r=4))
    assert unsupported(peft_model) == ("a LoRA (PEFT) policy, whose adapted layers are not "
                                       "plain nn.Linear")
