"""Multi-turn rollouts: observation tokens are context, never trained on."""

import json
import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from engine_procs import gspo_engines

from gspo.config import ConfigError, load_config
from gspo.data import format_prompt
from gspo.models.logprobs import token_logprobs
from gspo.models.packing import shared_prefix_logprobs
from gspo.models.tiny import build_tiny
from gspo.objectives import OBJECTIVES
from gspo.rewards import final_numeric_match
from gspo.rollout import Rollout, SamplingParams, pad_batch
from gspo.rollout.engine import EngineOptions
from gspo.rollout.envs import PythonTool, Step, tool_call
from gspo.rollout.hf_engine import HFEngine
from gspo.rollout.multiturn import ObservationFormat, TurnLoop, engine_sampler, multi_turn
from gspo.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


class Scripted:
    """Answers every turn with the same observation (a test environment)."""

    def reset(self, prompt, **columns):
        self.answer = columns["answer"]

    def step(self, response):
        return Step(f"<output>\nsee {self.answer}\n</output>")


class FixedFormat:
    """Observation ids that are known in advance: [90, 91, 92]."""

    def tokens(self, observation, last_token):
        return [90, 91, 92]


def _scripted_sampler(turns):
    """A SampleFn that returns the given (ids, logprobs) per call, one row per context."""
    calls = iter(turns)

    def sample(contexts, group_size, seeds):
        rows = next(calls)
        assert len(rows) == len(contexts) * group_size
        return Rollout([c for c in contexts for _ in range(group_size)], [r[0] for r in rows],
                       [torch.tensor(r[1]) for r in rows], [False] * len(rows), group_size)
    return sample


def test_two_turn_rows_hold_observations_with_exact_masks():
    """Hand-built: turn 1 [5, 6, 1], observation [90, 91, 92], turn 2 [7, 1]."""
    env = Scripted()
    env.reset("q", answer="3")
    done = type("Done", (), {"step": lambda self, r: Step(done=True)})()
    sample = _scripted_sampler([
        [([5, 6, 1], [-0.5, -0.25, -0.125]), ([8, 1], [-1.0, -2.0])],  # turn 1, group of 2
        [([7, 1], [-0.75, -0.5])],  # turn 2, only row 0 continues
    ])
    roll = multi_turn(sample, [[2, 3]], [env, done], group_size=2, seeds=[0], max_turns=2,
                      fmt=FixedFormat(), decode=str)
    assert roll.response_ids == [[5, 6, 1, 90, 91, 92, 7, 1], [8, 1]]
    assert roll.model_mask == [[True] * 3 + [False] * 3 + [True] * 2, [True, True]]
    assert roll.logprobs[0].tolist() == [-0.5, -0.25, -0.125, 0.0, 0.0, 0.0, -0.75, -0.5]
    assert roll.extras["rollout/turns_mean"] == 1.5  # the env is not called on the last turn
    padded = pad_batch(roll.prompt_ids, roll.response_ids, 0, roll.logprobs, roll.model_mask)
    assert padded["response_mask"].tolist() == [
        [0, 0, 1, 1, 1, 0, 0, 0, 1, 1], [0, 0, 1, 1, 0, 0, 0, 0, 0, 0]]
    assert padded["input_ids"][0].tolist() == [2, 3, 5, 6, 1, 90, 91, 92, 7, 1]
    assert padded["old_logprobs"][0, 5:8].tolist() == [0.0, 0.0, 0.0]


def test_a_transcript_past_the_models_positions_is_warned_of_once():
    """The trainer warns of a prompt + max_new_tokens past max_position_embeddings, but later
    turns read the whole transcript: one of 11 tokens under a limit of 8 (prompt + one turn is
    5) was sampled and trained on without a word."""
    _, tok = build_tiny("llama")
    loop = TurnLoop(Scripted, tok, max_turns=2, chat_template=False, context_limit=8)
    loop.fmt = FixedFormat()
    ex = SimpleNamespace(prompt="q", answer="3", columns={})
    turn = ([5, 6, 1], [-0.5, -0.25, -0.125])
    sample = _scripted_sampler([[turn], [turn], [turn], [turn]])
    with pytest.warns(UserWarning, match="is 11 tokens, past the model's "
                                         "max_position_embeddings=8"):
        roll = loop.run(sample, [ex], [[2, 3]], [0], 1)
    assert len(roll.prompt_ids[0]) + len(roll.response_ids[0]) == 11
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        loop.run(sample, [ex], [[2, 3]], [0], 1)  # once a run
        TurnLoop(Scripted, tok, max_turns=2, chat_template=False, context_limit=None).run(
            _scripted_sampler([[turn], [turn]]), [ex], [[2, 3]], [0], 1)


def test_gspo_length_normalisation_counts_model_tokens_only():
    """s_i = exp(mean log-ratio over the policy's tokens): 5 model tokens, 3 observation tokens
    whose (meaningless) log-ratio must not enter, arXiv:2507.18071 v2, Eq. (7)."""
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 1, 1]], dtype=torch.float32)
    old = torch.full((1, 8), -1.0)
    delta = 1e-4  # inside GSPO's clip band, so the loss is −s_i Â_i
    new = torch.where(mask > 0, old + delta, old + 5.0).requires_grad_(True)
    loss, _ = OBJECTIVES["gspo"](new, old, torch.ones(1), mask, eps_low=3e-4, eps_high=4e-4)
    assert float(loss.detach()) == pytest.approx(-math.exp(delta), rel=1e-7)
    loss.backward()  # d(−s)/d logp_t = −s/|y|, |y| = 5, and nothing on observation tokens
    assert torch.allclose(new.grad[0, mask[0] > 0], torch.full((5,), -math.exp(delta) / 5))
    assert new.grad[0, mask[0] == 0].abs().max() == 0


def test_trainer_logprobs_equal_sampler_logprobs_over_three_turns():
    """A tiny fp32 policy: the π_old passes (plain and shared-prompt) over the padded
    transcript reproduce the sampler's log-probs on every model token of every turn."""
    model, tok = build_tiny("llama", seed=3)
    prompts = [format_prompt(tok, p) for p in ["What is 1+2?", "Hi there"]]
    engine = HFEngine(model, tok, EngineOptions())
    params = SamplingParams(max_new_tokens=6, temperature=0.9)
    envs = [Scripted() for _ in range(6)]
    for e in envs:
        e.reset("q", answer="7")
    fmt = ObservationFormat(tok, chat_template=True)
    roll = multi_turn(engine_sampler(engine, params), prompts, envs, group_size=3,
                      seeds=[11, 12], max_turns=3, fmt=fmt, decode=tok.decode)
    obs = fmt.tokens("<output>\nsee 7\n</output>", None)
    assert all(m.count(False) >= 2 * (len(obs) - 1) for m in roll.model_mask)  # 2 observations
    assert roll.extras["rollout/turns_mean"] == 3
    b = pad_batch(roll.prompt_ids, roll.response_ids, tok.pad_token_id, roll.logprobs,
                  roll.model_mask)
    mask = b["response_mask"]
    assert mask.sum() == sum(sum(m) for m in roll.model_mask)
    for fn in (token_logprobs, shared_prefix_logprobs):
        with torch.no_grad():
            lp, _ = fn(model, b["input_ids"], b["attention_mask"], mask, temperature=0.9)
        assert ((lp - b["old_logprobs"]).abs() * mask).max() < 3e-6
        assert (lp * (1 - mask)).abs().max() == 0  # nothing scored on observations


def test_observation_format_follows_the_chat_template():
    _, tok = build_tiny("llama")
    fmt = ObservationFormat(tok, chat_template=True)  # tiny template: "role: content\n"
    assert (fmt.before, fmt.after) == ("\nuser: ", "\nassistant:")
    ids = fmt.tokens("out", last_token=None)
    assert tok.decode(ids) == "\nuser: out\nassistant:"
    assert fmt.tokens("out", last_token=ids[0]) == ids[1:]  # the policy already ended its turn
    plain = ObservationFormat(tok, chat_template=False)
    assert tok.decode(plain.tokens("out", None)) == "\nout\n"


LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
    "[INST] {{ m['content'] }} [/INST]{% else %} {{ m['content'] }} {{ eos_token }}"
    "{% endif %}{% endfor %}")


def _sentencepiece_tokenizer(kind):
    """A character-level SentencePiece-style tokenizer built offline: spaces become "▁" and
    a "▁" opens the text, by a ``Prepend`` normaliser (Llama 2's legacy tokenizer.json) or a
    ``Metaspace`` pre-tokenizer (prepend_scheme="first"); other bytes fall back to <0xNN>."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    chars = ["\u2581", *"abcdefghijklmnopqrstuvwxyz[]/INST0123456789"]
    vocab = {t: i for i, t in enumerate(
        specials + [f"<0x{b:02X}>" for b in range(256)] + list(dict.fromkeys(chars)))}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(specials)
    if kind == "prepend":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                               normalizers.Replace(" ", "\u2581")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", pad_token="<unk>")
    out.chat_template = LLAMA2_TEMPLATE
    return out


@pytest.mark.parametrize("kind", ["prepend", "metaspace"])
def test_observation_ids_are_the_transcripts_own_with_sentencepiece_tokenizers(kind):
    """An observation is tokenised as the text continuing the turn: no "▁" the whole
    transcript's tokenisation lacks, and after a turn ended with EOS the template's " </s>"
    adds neither a space token nor a second EOS (Llama 2's template)."""
    tok = _sentencepiece_tokenizer(kind)

    def ids(s):
        return tok(s, add_special_tokens=False)["input_ids"]

    plain = ObservationFormat(tok, chat_template=False)
    turn = ids("the answer is 42")
    assert turn + plain.tokens("out 7", turn[-1]) == ids("the answer is 42\nout 7\n")
    fmt = ObservationFormat(tok, chat_template=True)
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "no"},
            {"role": "user", "content": "out 7"}]
    full = ids(tok.apply_chat_template(msgs, tokenize=False))
    after_eos = full[full.index(tok.eos_token_id) + 1:]  # the rendering after the turn's EOS
    assert fmt.tokens("out 7", tok.eos_token_id) == after_eos


def test_python_tool_runs_the_last_block_and_a_plain_turn_ends_the_episode():
    env = PythonTool()
    env.reset("q")
    step = env.step("try\n```python\nprint(1)\n```\nthen\n```python\nprint(37*48)\n```")
    assert step.observation == "<output>\n1776\n</output>" and not step.done
    assert "ZeroDivisionError" in env.step("```python\n1/0\n```").observation
    assert env.step("The answer is 1776.").done
    assert tool_call("```python\nprint(1)") is None  # an unclosed block is not a call


def test_python_tool_keeps_the_error_and_marks_an_output_it_cut():
    """The observation was cut to max_chars after the error line was added (a program that
    printed 300 lines and then raised came back without the exception), and an output past
    the sandbox's 4 KiB tail showed a chunk from its middle as if it were the start."""
    env = PythonTool()
    obs = env.step("```python\nfor i in range(300): print(i)\n1/0\n```").observation
    assert obs.startswith("<output>\n0\n1\n") and "...\nZeroDivisionError" in obs
    assert len(obs) < 2 * PythonTool.max_chars
    obs = env.step("```python\nfor i in range(2000): print(i)\n```").observation
    assert obs.startswith("<output>\n...") and obs.endswith("\n1999\n</output>")
    obs = env.step("```python\nprint('a' * 200000)\n```").observation
    assert obs.startswith("<output>\n...aaa") and obs.endswith("a\noutput_limit\n</output>")
    obs = env.step("```python\nprint(6 * 7, end='')\n1/0\n```").observation
    assert obs == "<output>\n42\nZeroDivisionError: division by zero\n</output>"


def test_final_numeric_match_ignores_numbers_only_the_tool_printed():
    tool_only = "```python\nprint(6*7)\n```user: <output>\n42\n</output>\nassistant: done"
    said = tool_only.replace("done", "It is 42.")
    assert final_numeric_match(["q"] * 3, [tool_only, said, "42"], answer=["42"] * 3) == [
        0.0, 1.0, 1.0]


def test_config_checks_max_turns_and_env_together(tmp_path):
    with pytest.raises(ConfigError, match="go together"):
        load_config(None, ["rollout.max_turns=2"])
    with pytest.raises(ConfigError, match="go together"):
        load_config(None, ["rollout.env=python"])
    with pytest.raises(ConfigError, match="r3"):
        load_config(None, ["rollout.max_turns=2", "rollout.env=python",
                           "moe.routing_replay=r3"])
    cfg = load_config(None, ["model=tiny:llama", f"output_dir={tmp_path}",
                             "rollout.max_turns=2", "rollout.env=nope"])
    with pytest.raises(ConfigError, match=r"rollout\.env"):
        Trainer(cfg).setup()
    assert TurnLoop.from_config(load_config(None, []).rollout, load_config(None, []).task,
                                None) is None  # the default: single-turn, no loop


def test_single_turn_rollouts_pad_exactly_as_before():
    """Feature off (model_mask None) and an all-True mask give the same tensors."""
    p, r = [[2, 3], [4]], [[5, 6, 1], [7]]
    lps = [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-0.5])]
    a = pad_batch(p, r, 0, lps)
    b = pad_batch(p, r, 0, lps, [[True] * 3, [True]])
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_trainer_runs_two_turn_episodes(tmp_path):
    cfg = load_config(None, [
        "model=tiny:llama", f"output_dir={tmp_path}", "run_name=mt", "progress=false",
        "steps=2", "rollout.max_new_tokens=5", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "rollout.temperature=1.0", "task.eval_size=4",
        "objective.num_minibatches=2", "rollout.max_turns=2",
        f"rollout.env={__name__}:Scripted", "reward.functions=[final_numeric_match]",
        "logging.samples_every=1"])
    trainer = Trainer(cfg).setup()
    out = trainer.train()
    rows = [json.loads(x) for x in open(trainer.run_dir / "metrics.jsonl")]
    step = [r for r in rows if "reward/mean" in r][-1]
    assert step["rollout/turns_mean"] == 2  # the scripted env always answers turn 1
    assert step["rollout/observation_tokens_mean"] > 0
    assert step["rollout/logprob_gap_abs_max"] < 3e-5  # π_old saw the sampler's tokens
    assert step["rollout/model_tokens_mean"] <= 2 * 5
    assert out["after"]["n"] == 4  # evaluation ran the same two-turn loop, greedily


def test_openenv_adapter_drives_an_in_process_environment():
    """A real openenv-core Environment subclass (skipped where openenv-core is not installed)."""
    types = pytest.importorskip("openenv.core.env_server.types")
    interfaces = pytest.importorskip("openenv.core.env_server.interfaces")
    from gspo.rollout.openenv_adapter import OpenEnvAdapter

    class Say(types.Action):
        text: str

    class Heard(types.Observation):
        text: str = ""

    class Echo(interfaces.Environment):
        def reset(self, seed=None, episode_id=None, **kw):
            self.n = 0
            return Heard()

        def step(self, action, timeout_s=None, **kw):
            self.n += 1
            return Heard(text=f"heard {action.text}", done=self.n >= 2)

        @property
        def state(self):
            return types.State(step_count=self.n)

    env = OpenEnvAdapter(Echo(), action=lambda t: Say(text=t), observe=lambda o: o.text)
    env.reset("q")
    assert env.step("hi") == Step("heard hi")
    assert env.step("again").done


def _two_turn_run(tmp_path, name, *extra):
    cfg = load_config(None, [
        "model=tiny:llama", f"output_dir={tmp_path}", f"run_name={name}", "progress=false",
        "tensorboard=false", "steps=3", "rollout.max_new_tokens=5", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "rollout.temperature=1.0", "task.eval_size=0",
        "eval_before=false", "objective.num_minibatches=2", "rollout.max_turns=2",
        f"rollout.env={__name__}:Scripted", "reward.functions=[final_numeric_match]",
        "optim.lr=3e-3", "logging.samples_every=0", *extra])
    trainer = Trainer(cfg).setup()
    try:
        trainer.train()
    finally:
        trainer.cleanup()
    rows = [json.loads(x) for x in open(trainer.run_dir / "metrics.jsonl")]
    return trainer, [r for r in rows if "train/loss" in r]


def flat_first_prompt(prompts, completions, **_):
    """No signal in the first prompt's group, some in the others: dynamic sampling drops a group
    and joins rows from another draw every step."""
    return [0.0 if p == prompts[0] else float(sum(map(ord, c)) % 7)
            for p, c in zip(prompts, completions)]


def test_dynamic_sampling_trains_multi_turn_rows_on_the_policys_tokens_only(tmp_path,
                                                                          monkeypatch):
    """``rollout.dynamic_sampling`` joins groups from several draws; each joined row keeps its
    observation mask, so the update's response mask covers exactly the policy's tokens (the
    joined batch once came back without masks: the environment's tokens were trained on)."""
    seen = []
    plain = Trainer.update_batch

    def update_batch(self, roll, adv, plan):
        batch, old = plain(self, roll, adv, plan)
        seen.append((roll.model_mask, batch.response_mask.sum(-1).tolist()))
        return batch, old
    monkeypatch.setattr(Trainer, "update_batch", update_batch)
    cfg = load_config(None, [
        "model=tiny:llama", f"output_dir={tmp_path}", "run_name=dyn", "progress=false",
        "tensorboard=false", "steps=2", "rollout.max_new_tokens=5", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "rollout.temperature=1.0", "task.eval_size=0",
        "eval_before=false", "objective.num_minibatches=2", "rollout.max_turns=2",
        f"rollout.env={__name__}:Scripted", "rollout.dynamic_sampling=true",
        "logging.samples_every=0"])
    trainer = Trainer(cfg, reward_fns=[flat_first_prompt]).setup()
    try:
        trainer.train()
    finally:
        trainer.cleanup()
    rows = [json.loads(x) for x in open(trainer.run_dir / "metrics.jsonl")
            if "train/loss" in x]
    assert all(r["dynamic/extra_batches"] >= 1 for r in rows)  # rows were joined every step
    for mask, counted in seen:
        assert mask is not None
        assert counted == [sum(m) for m in mask]  # the policy's tokens, none of the observation
        assert any(not all(m) for m in mask)
    assert all(r["rollout/observation_tokens_mean"] > 0 and r["rollout/turns_mean"] == 2
               for r in rows)
    for r in rows:  # tokens/s counts what the policy sampled, not the environment's tokens
        assert r["dynamic/response_tokens_sampled"] == pytest.approx(
            r["perf/rollout_tokens_per_s"] * r["time/rollout_s"])


def test_length_buckets_span_every_turns_tokens(tmp_path, monkeypatch):
    """``diag/clip_frac_len_q*`` divide the policy's token cap of an episode, max_new_tokens ×
    max_turns (they divided one turn's cap, so every two-turn episode past it fell in q4)."""
    import gspo.trainer.trainer as trainer_module

    spans = []

    class Recording(trainer_module.StepDiagnostics):
        def __init__(self, objective, max_new_tokens):
            spans.append(max_new_tokens)
            super().__init__(objective, max_new_tokens)
    monkeypatch.setattr(trainer_module, "StepDiagnostics", Recording)
    _two_turn_run(tmp_path, "buckets", "steps=1")
    assert spans == [5 * 2]


def test_rollout_tokens_per_s_counts_the_policys_tokens_only(tmp_path):
    """In a multi-turn run ``perf/rollout_tokens_per_s`` divides the policy's sampled tokens
    by the rollout time; the observation tokens were written by the environment."""
    _, rows = _two_turn_run(tmp_path, "tps")
    n_rows = 2 * 4
    for r in rows:
        assert r["rollout/observation_tokens_mean"] > 0
        assert r["perf/rollout_tokens_per_s"] * r["time/rollout_s"] == pytest.approx(
            r["rollout/model_tokens_mean"] * n_rows)


def test_async_steps_run_multi_turn_episodes_in_the_engine_process(tmp_path, monkeypatch):
    """``rollout.async_steps`` with ``rollout.max_turns=2``: the engine process resets each
    row's environment with its example and runs the episodes. With zero staleness (the
    pipeline at k = 0) it gives the synchronous loop's weights bit for bit; at k = 1 its
    log-probs are the trainer's on the same version at every step, observation tokens masked."""
    from safetensors.torch import load_file

    sync, rows_sync = _two_turn_run(tmp_path, "sync", "objective.old_logprobs=rollout")
    monkeypatch.setattr(Trainer, "_async_rollout", lambda self, k: self._pipeline(0))
    pipe, rows_pipe = _two_turn_run(tmp_path, "pipe", "objective.old_logprobs=rollout")
    monkeypatch.undo()
    wa, wb = (load_file(t.run_dir / "checkpoints/step_000003/model.safetensors")
              for t in (sync, pipe))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [r["train/loss"] for r in rows_pipe] == [r["train/loss"] for r in rows_sync]
    for a, b in zip(rows_sync, rows_pipe):  # the episodes' own metrics came through
        for key in ("rollout/turns_mean", "rollout/observation_tokens_mean"):
            assert b[key] == a[key], key
    assert rows_pipe[-1]["rollout/turns_mean"] == 2

    _, rows = _two_turn_run(tmp_path, "k1", "rollout.async_steps=1",
                            "logging.rollout_check_every=1")
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1]
    assert all(r["rollout/observation_tokens_mean"] > 0 for r in rows)
    assert all(r["async/engine_mismatch_abs_max"] < 3e-5 for r in rows)


@pytest.mark.slow
def test_a_gspo_engine_runs_lora_multi_turn_episodes_as_the_spawned_engine_does(tmp_path):
    """The remote engine gets the turn loop over its link: k = 1 with a LoRA policy and
    two-turn episodes, sampled by a ``gspo engine`` process, gives the spawned engine's run
    (losses, episode metrics) exactly."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    extra = ["rollout.async_steps=1", "lora.r=4", "optim.lr=1e-2",
             "logging.rollout_check_every=1"]
    _, local = _two_turn_run(tmp_path, "local", *extra)
    with gspo_engines([address]):
        _, remote = _two_turn_run(tmp_path, "remote", *extra, f"rollout.async_address={address}")
    for key in ("train/loss", "rollout/turns_mean", "rollout/observation_tokens_mean"):
        assert [r[key] for r in remote] == [r[key] for r in local], key
    assert all(r["async/engine_mismatch_abs_max"] < 3e-5 for r in remote)


def test_openenv_adapter_seeds_every_row_of_a_group_alike():
    """Rows of one group (one prompt) reset with one seed, another prompt with another, and an
    environment whose reset takes no seed is reset without one."""
    from gspo.rollout.openenv_adapter import OpenEnvAdapter

    class Random:
        def __init__(self):
            self.seeds = []

        def reset(self, seed=None, episode_id=None):
            self.seeds.append(seed)

        def step(self, action):
            raise AssertionError("not stepped here")

    class NoSeed:
        def reset(self, episode_id=None):
            self.episode_id = episode_id

    inner = Random()
    env = OpenEnvAdapter(inner, action=str, observe=str)
    for prompt in ("What is 2+3?", "What is 2+3?", "What is 4+4?"):
        env.reset(prompt, answer="5")
    assert inner.seeds[0] == inner.seeds[1] != inner.seeds[2]
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in inner.seeds)
    plain = NoSeed()
    OpenEnvAdapter(plain, action=str, observe=str).reset("q")
    assert plain.episode_id == "1"


def test_the_initial_observation_reset_returns_is_shown_on_the_first_turn():
    """An OpenEnv environment's ``reset`` observation (here a board that depends on the seed)
    reaches the first turn, after the dataset prompt in the user message, for every row of the
    group; an empty one leaves the prompt as it was; rows of a group that start from different
    states are refused rather than sampled from one prompt."""
    from types import SimpleNamespace

    from gspo.rollout.openenv_adapter import OpenEnvAdapter, prompt_seed

    class Board:
        def __init__(self, text=None):
            self.text = text

        def reset(self, seed=None, episode_id=None):
            board = f"board {seed % 97}" if self.text is None else self.text
            return SimpleNamespace(text=board, done=False)

        def step(self, action):
            return SimpleNamespace(text="", done=True)

    _, tok = build_tiny("llama")
    contexts = []

    def sample(ctx, group_size, seeds):
        contexts.append(ctx)
        n = len(ctx) * group_size
        return Rollout([c for c in ctx for _ in range(group_size)], [[5, 1]] * n,
                       [torch.zeros(2)] * n, [False] * n, group_size)

    def run(make_board):
        loop = TurnLoop(lambda: OpenEnvAdapter(make_board(), action=str,
                                               observe=lambda o: o.text),
                        tok, max_turns=2, chat_template=True, system_prompt="Be brief.")
        exs = [SimpleNamespace(prompt=q, answer="", columns={}) for q in ("Play.", "Go.")]
        prompts = [format_prompt(tok, ex.prompt, system_prompt="Be brief.") for ex in exs]
        return loop.run(sample, exs, prompts, [0, 1], 2), prompts

    roll, _ = run(Board)
    want = [format_prompt(tok, f"{q}\n\nboard {prompt_seed(q) % 97}", system_prompt="Be brief.")
            for q in ("Play.", "Go.")]
    assert contexts[0] == want and roll.prompt_ids == [want[0]] * 2 + [want[1]] * 2
    roll, prompts = run(lambda: Board(""))
    assert contexts[-1] == prompts
    boards = iter(range(100))
    with pytest.raises(ValueError, match="different initial observations"):
        run(lambda: Board(f"board {next(boards)}"))
