"""rollout.async_steps: the k-step pipeline (gspo.trainer.async_rollout) and its engine
process (gspo.rollout.async_engine).

Fast lane: the pieces in this process (weight slots, the pipeline's order and checkpoint
state with an in-process engine, the drift metrics, config errors, k = 0 untouched). Slow
lane: real engine processes (each one imports torch and transformers: ~10 s here).
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_procs import gspo_engines
from safetensors.torch import load_file

from gspo.config import ConfigError, load_config
from gspo.models import load_model
from gspo.rollout import SamplingParams, build_engine
from gspo.rollout.async_engine import (
    AsyncEngine,
    Request,
    _encode,
    _layout,
    _materialize,
    _named_tensors,
    _skeleton,
    _views,
    decode,
)
from gspo.rollout.batch import Rollout
from gspo.rollout.engine import EngineOptions
from gspo.trainer import Trainer
from gspo.trainer.async_rollout import (
    AsyncRollout,
    behaviour_version,
    drift_metrics,
    staleness_routing_metrics,
)


def char_codes(prompts, completions, **_):
    """A reward that differs within almost every group: every step moves the weights."""
    return [float(sum(map(ord, c)) % 97) for c in completions]


def _cfg(tmp_path, name, *extra):
    return load_config(None, [
        "model=tiny:llama", f"output_dir={tmp_path}", f"run_name={name}", "progress=false",
        "tensorboard=false", "num_threads=1", "rollout.max_new_tokens=5",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.temperature=1.0",
        "objective.num_minibatches=2", "task.eval_size=0", "optim.lr=3e-3", "steps=2",
        "eval_before=false", "logging.samples_every=0", *extra])


def _rows(trainer):
    return [json.loads(x) for x in open(trainer.run_dir / "metrics.jsonl")
            if "train/loss" in x]


# ----------------------------------------------------------------------------- fast lane


def test_k0_is_the_synchronous_loop_with_pinned_losses(tmp_path):
    """Pinned on the commit before async existed (same weights bit for bit there, checked
    with a direct comparison of the step-2 checkpoints)."""
    trainer = Trainer(_cfg(tmp_path, "k0"), reward_fns=[char_codes]).setup()
    assert trainer.async_rollout is None
    trainer.train()
    rows = _rows(trainer)
    assert [r["train/loss"] for r in rows] == pytest.approx(
        [0.027391117066144943, 0.0067110806703567505], rel=1e-5)
    assert [r["reward/mean"] for r in rows] == [63.0, 52.0]
    assert not any(k.startswith("async/") for r in rows for k in r)


def test_config_errors():
    with pytest.raises(ConfigError, match="async_threads is used only"):
        load_config(None, ["rollout.async_threads=2"])
    with pytest.raises(ConfigError, match=r"runs rollout\.engine=hf or vllm, not llamacpp"):
        load_config(None, ["rollout.async_steps=1", "rollout.engine=llamacpp"])
    load_config(None, ["rollout.async_steps=1", "rollout.engine=vllm"])  # checked, not started
    with pytest.raises(ConfigError, match="async_steps must be >= 0"):
        load_config(None, ["rollout.async_steps=-1"])
    with pytest.raises(ConfigError, match="async_address is used only"):
        load_config(None, ["rollout.async_address=tcp://127.0.0.1:29500"])
    with pytest.raises(ConfigError, match="tcp://HOST:PORT or file:///path, got 'host:1'"):
        load_config(None, ["rollout.async_steps=1", "rollout.async_address=host:1"])
    with pytest.raises(ConfigError, match="async_engines is used only"):
        load_config(None, ["rollout.async_engines=2"])
    dyn = ["rollout.async_steps=1", "rollout.dynamic_sampling=true"]
    load_config(None, dyn)
    load_config(None, [*dyn, "rollout.engine=vllm"])  # extra draws from the engine process




def test_engine_counts_are_checked_against_addresses_and_prompts(tmp_path):
    with pytest.raises(ConfigError, match=r"1 address\(es\) for 1 trainer process\(es\) x 2 "):
        Trainer(_cfg(tmp_path, "a", "rollout.async_steps=1", "rollout.async_engines=2",
                     "rollout.async_address=tcp://127.0.0.1:1")).setup()
    with pytest.raises(ConfigError, match="each engine needs a prompt, but a trainer process "
                                          "has 2"):
        Trainer(_cfg(tmp_path, "b", "rollout.async_steps=1", "rollout.async_engines=3")).setup()


def test_gspo_engine_refuses_an_address_it_cannot_join(capsys):
    from gspo.cli import main

    assert main(["engine", "127.0.0.1:29500"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("gspo engine: error: address must be tcp://HOST:PORT or file:///path, got "
                   "'127.0.0.1:29500'")


def test_behaviour_version_bounds_staleness():
    for k in range(4):
        lags = [t - behaviour_version(t, k) for t in range(10)]
        assert lags == [min(t, k) for t in range(10)]


def test_a_slot_rebuilds_the_policy_exactly_and_follows_publish():
    model, _ = load_model("tiny:llama", seed=0)
    entries, sizes = _layout(model)
    slot = {k: torch.empty(n, dtype=getattr(torch, k)) for k, n in sizes.items()}
    n_params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    assert sizes["float32"] >= n_params
    copy = _materialize(_skeleton(model), entries, slot)
    with torch.no_grad():  # publish by hand: what AsyncEngine.publish does
        for v, (*_, t) in zip(_views(entries, slot), _named_tensors(model)):
            v.copy_(t)
    ids = torch.randint(0, 100, (2, 7))
    assert torch.equal(model(ids).logits, copy(ids).logits)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.5)  # tied to the output layer
        for v, (*_, t) in zip(_views(entries, slot), _named_tensors(model)):
            v.copy_(t)
    assert torch.equal(model(ids).logits, copy(ids).logits)
    assert copy.lm_head.weight.data_ptr() == copy.model.embed_tokens.weight.data_ptr()


def test_a_lora_publish_after_the_first_copies_only_the_adapter():
    """A slot that holds a LoRA policy's base weights gets only the adapter's tensors (the
    trainable ones) on later publishes, in place or packed for the broadcast; a policy without
    an adapter is copied whole."""
    from gspo.config import LoRAConfig
    from gspo.models.lora import apply_lora
    from gspo.rollout.async_engine import (
        changing,
        distinct,
        entry_bytes,
        fill_slot,
        pack,
        packed_buffers,
        unpack,
    )

    plain, _ = load_model("tiny:llama", seed=0)
    entries, _ = _layout(plain)
    assert changing(plain, distinct(entries)) is None
    model = apply_lora(plain, LoRAConfig(r=4, alpha=8))
    entries, sizes = _layout(model)
    unique = distinct(entries)
    only = changing(model, unique)
    names = [f"{e.module}.{e.attr}" for e in entries]
    assert only and all("lora_" in names[i] for i in only)
    assert {names[i] for i in only} == {n for n, p in model.named_parameters() if p.requires_grad}
    assert entry_bytes(entries, only) < entry_bytes(entries, unique) / 10
    slot = {k: torch.empty(n, dtype=getattr(torch, k)) for k, n in sizes.items()}
    fill_slot(slot, entries, unique, model)
    base = next(i for i in unique if "lora_" not in names[i] and entries[i].is_param)
    src = dict(zip(names, (t for *_, t in _named_tensors(model))))
    before = src[names[base]].detach().clone()
    with torch.no_grad():  # an update moves the adapter; the frozen base never moves (here it
        for i in only:     # does, to show the publish leaves it alone)
            src[names[i]].add_(0.25)
        src[names[base]].add_(1.0)
    packed = packed_buffers(entries, only)
    received = {k: v.clone() for k, v in slot.items()}
    pack(entries, only, model, packed)
    unpack(entries, only, packed, received)  # what the engine's receiving thread does
    fill_slot(slot, entries, unique, model, only=only)
    for got in (slot, received):
        views = _views(entries, got)
        assert all(torch.equal(views[i], src[names[i]]) for i in only)
        assert torch.equal(views[base], before)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_the_gpu_engines_model_loads_only_a_lora_policys_adapter_after_the_first(device):
    """The engine process's one device model (``_DeviceModel``, the GPU path; its logic on any
    device) holds each slot's version exactly: a whole copy first, then for a LoRA policy only
    the adapter's tensors, whose bytes it counts; without ``changing``, every load whole."""
    from gspo.config import LoRAConfig
    from gspo.models.lora import apply_lora
    from gspo.rollout.async_engine import _DeviceModel, changing, distinct, entry_bytes, fill_slot

    model = apply_lora(load_model("tiny:llama", seed=0)[0], LoRAConfig(r=4, alpha=8))
    entries, sizes = _layout(model)
    unique = distinct(entries)
    only = changing(model, unique)
    slots = [{k: torch.empty(n, dtype=getattr(torch, k)) for k, n in sizes.items()}
             for _ in range(2)]
    fill_slot(slots[0], entries, unique, model)  # version 0
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))
    fill_slot(slots[1], entries, unique, model)  # version 1: another adapter, the same base
    ids = torch.randint(0, 100, (2, 7))
    want = []
    for slot in slots:
        ref = _materialize(_skeleton(model), entries, slot)
        want.append(ref(ids).logits)
    whole = sum(b.numel() * b.element_size() for b in slots[0].values())
    for only_ in (only, None):
        held = _DeviceModel(_skeleton(model), entries, sizes, torch.device(device), only_)
        for i, version in enumerate((0, 1, 0, 1)):
            assert held.load(slots[version], version) >= 0.0
            assert held.last_bytes == (whole if only_ is None or i == 0
                                       else entry_bytes(entries, only))
            got = held.model(ids.to(device)).logits.cpu()
            assert torch.allclose(got, want[version], atol=1e-5) if device != "cpu" else \
                torch.equal(got, want[version])
        assert held.load(slots[1], 1) == 0.0  # held already: nothing copied
    assert entry_bytes(entries, only) < whole / 10


class InlineEngine:
    """AsyncEngine's contract in this process: one model per slot, batches on take()."""

    def __init__(self, model, tokenizer, k):
        self.k, self.model, self.tokenizer = k, model, tokenizer
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.asked: list[Request] = []
        self.queue: list[Request] = []

    def publish(self, model, version):
        self.versions[version] = {k: v.clone() for k, v in model.state_dict().items()}
        return 0.0

    def submit(self, req):
        assert req.version in self.versions, "asked for a version not published yet"
        self.asked.append(req)
        self.queue.append(req)

    def take(self):
        req = self.queue.pop(0)
        m, _ = load_model("tiny:llama", seed=0)
        m.load_state_dict(self.versions[req.version])
        eng = build_engine("hf", m, self.tokenizer, EngineOptions())
        roll = eng.generate(req.prompts, group_size=req.group_size, params=req.params,
                            seeds=req.seeds)
        return req.step, _encode(roll, None, None, req.version, 0.0)

    def close(self):
        pass


def _pipeline(model, tok, k, total, draws):
    def draw(step):
        draws.append(step)
        return [], Request(step, step, [[1, 2, 3 + step]], 2, SamplingParams(3, 1.0), [step],
                           False)
    pipe = AsyncRollout(k=k, total_steps=total, draw=draw, check=lambda s: False,
                        engine="hf", opts=EngineOptions(), threads=1, logprob_fn=None,
                        temperature=1.0, chunk=8, pad_id=0)
    pipe.engine = InlineEngine(model, tok, k)
    pipe.publish(model, 0)
    return pipe


def test_pipeline_asks_ahead_in_order_and_checkpoints_its_inflight_batches():
    model, tok = load_model("tiny:llama", seed=0)
    draws: list[int] = []
    pipe = _pipeline(model, tok, k=2, total=5, draws=draws)
    got = {}
    for step in range(3):
        _, roll = pipe.next(step)
        got[step] = roll
        assert roll.versions == [behaviour_version(step, 2)] * len(roll)
        assert roll.extras["async/staleness_max"] == min(step, 2)
        fracs = [roll.extras[f"async/staleness_frac_{s}"] for s in range(3)]
        assert fracs == [float(s == min(step, 2)) for s in range(3)]  # every row at one lag
        with torch.no_grad():
            next(model.parameters()).add_(0.1)
        pipe.publish(model, step + 1)
    assert draws == [0, 1, 2, 3, 4]  # never past the last step, each once, in order
    assert [r.step for r in pipe.engine.asked] == [0, 1, 2, 3, 4]
    state = json.loads(json.dumps(pipe.state_dict()))  # what state.json holds
    assert sorted(state["ready"]) == ["3", "4"] and state["submitted"] == 5
    resumed = _pipeline(model, tok, k=2, total=5, draws=[])
    resumed.load_state_dict(state)
    for step in (3, 4):
        _, a = resumed.next(step)
        _, b = pipe.next(step)
        assert a.response_ids == b.response_ids and a.versions == b.versions
        assert all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs))
    with pytest.raises(ValueError, match="async_steps=2, not 1"):
        _pipeline(model, tok, k=1, total=5, draws=[]).load_state_dict(state)


def test_a_rollback_republishes_and_resamples_the_batches_of_discarded_versions():
    """After step 3 (k = 2) the trainer's weights go back to version 2's: they are published
    as version 4 at once; of the batches in flight, step 4's (version 2) is kept and step 5's
    (version 3, discarded) is asked for again from version 4, with its request rebuilt (same
    prompts and seeds, nothing drawn anew)."""
    model, tok = load_model("tiny:llama", seed=0)
    draws: list[int] = []
    pipe = _pipeline(model, tok, k=2, total=7, draws=draws)
    saved = {}
    for step in range(4):
        if pipe.published < step:  # as Trainer.publish: this step's weights first
            pipe.publish(model, step)
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
        pipe.next(step)
        with torch.no_grad():
            next(model.parameters()).add_(0.1)
    model.load_state_dict(saved[2])  # the guard's rollback to step 2's checkpoint

    def request_for(examples, step):
        return Request(step, step, [[1, 2, 3 + step]], 2, SamplingParams(3, 1.0), [step], False)

    assert pipe.rolled_back(model, version=4, kept=2, request_for=request_for) == 1
    assert pipe.published == 4 and sorted(pipe.engine.versions) == [0, 1, 2, 3, 4]
    assert all(torch.equal(pipe.engine.versions[4][k], saved[2][k]) for k in saved[2])
    again = pipe.engine.asked[-1]
    first = next(r for r in pipe.engine.asked if r.step == 5)
    assert (again.step, again.version, first.version) == (5, 4, 3)
    assert (again.prompts, again.seeds) == (first.prompts, first.seeds)
    _, kept = pipe.next(4)
    _, redone = pipe.next(5)
    assert kept.versions == [2, 2] and redone.versions == [4, 4]
    assert draws == [0, 1, 2, 3, 4, 5, 6]  # each once: 5 was not drawn again (6 by next(4))
    pipe.next(6)  # asked for from version 4 as well (6 - k = 4): the pipeline goes on
    assert pipe.engine.asked[-1].version == 4


def test_a_request_split_over_engines_samples_what_one_engine_does():
    """rollout.async_engines: the request's prompts split over two engines (3 prompts: 2 + 1,
    each with its own seeds), their batches merged back in order: the same responses as one
    engine (sampling is seeded per prompt), log-probs to fp32 rounding (other batch sizes)."""
    from gspo.rollout.async_engine import merge_encoded, split_request
    from gspo.trainer.async_rollout import _Engines

    model, tok = load_model("tiny:llama", seed=0)
    req = Request(0, 0, [[1, 2, 3], [4, 5], [6, 7, 8, 9]], 2, SamplingParams(4, 1.0),
                  [11, 12, 13], False)
    shares = split_request(req, 2)
    assert [len(r.prompts) for r in shares] == [2, 1]
    assert [r.seeds for r in shares] == [[11, 12], [13]]
    one, two = InlineEngine(model, tok, 1), _Engines([InlineEngine(model, tok, 1)
                                                      for _ in range(2)])
    for engine in (one, two):
        engine.publish(model, 0)
        engine.submit(req)
    (s1, a), (s2, b) = one.take(), two.take()
    assert s1 == s2 == 0 and b["versions"] == [0] * 6 and b["group_size"] == 2
    assert a["prompt_ids"] == b["prompt_ids"] and a["response_ids"] == b["response_ids"]
    assert all(torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)
               for x, y in zip(a["logprobs"], b["logprobs"]))
    with pytest.raises(ValueError, match="some shares have routing and some do not"):
        merge_encoded([{**a, "routing": [[1, [0, 1]]]}, a])


def test_routing_records_of_row_blocks_join_as_one_batchs():
    """MoE routing (pad_batch layout, per layer [rows × T, k], T the block's longest row):
    blocks sampled apart (two engines' shares, dynamic sampling's draws) join into the record
    of all their rows, re-padded with -1 (unknown); selecting a block's rows gives it back."""
    from gspo.rollout.batch import join_routing

    def block(lens, start):  # rows of these lengths (prompt + response), experts numbered
        t = max(lens)
        r = torch.full((len(lens), t, 2), -1, dtype=torch.long)
        for i, n in enumerate(lens):
            r[i, :n] = torch.arange(start + 100 * i, start + 100 * i + 2 * n).view(n, 2)
        return r

    a, b = block([3, 5], 0), block([2], 1000)
    rolls = [Rollout([[1]] * 2, [[1, 1], [1, 1, 1, 1]], [torch.zeros(2), torch.zeros(4)],
                     [False] * 2, 2, [a.reshape(-1, 2)] * 2),
             Rollout([[1]], [[1]], [torch.zeros(1)], [False], 1, [b.reshape(-1, 2)] * 2)]
    joined = join_routing([r.routing for r in rolls], [2, 1])
    assert len(joined) == 2 and joined[0].shape == (3 * 5, 2)
    want = torch.cat([a, torch.cat([b, torch.full((1, 3, 2), -1)], dim=1)])
    assert torch.equal(joined[1].view(3, 5, 2), want)
    # a trainer pass's record holds every position: its new padding gets valid experts
    full = join_routing([r.routing for r in rolls], [2, 1], complete=True)[0].view(3, 5, 2)
    assert torch.equal(full[2, 2:], torch.tensor([[0, 1]] * 3)) and torch.equal(full[:2], a)
    whole = Rollout([[1]] * 3, [[1, 1], [1, 1, 1, 1], [1]], [torch.zeros(1)] * 3, [False] * 3,
                    1, joined)
    assert torch.equal(whole.select([2]).routing[0], b.reshape(-1, 2))
    assert torch.equal(whole.select([0, 1]).routing[0], a.reshape(-1, 2))
    enc = [{"prompt_ids": r.prompt_ids, "response_ids": r.response_ids,
            "logprobs": [x.tolist() for x in r.logprobs], "truncated": r.truncated,
            "versions": [0] * len(r), "trainer_logprobs": None, "model_mask": None,
            "extras": {}, "group_size": 1, "generate_s": 0.0,
            "routing": [[2, x.reshape(-1).tolist()] for x in r.routing],
            "trainer_routing": None} for r in rolls]
    from gspo.rollout.async_engine import merge_encoded

    merged = decode(merge_encoded(enc))
    assert all(torch.equal(x, y) for x, y in zip(merged.routing, joined))


def test_multi_turn_batches_travel_with_their_masks_and_metrics():
    """A multi-turn batch (observation tokens masked, per-row episode metrics) survives the
    engine's encoding (also what checkpoints store), and two engines' shares merge into one
    batch: masks in row order, the metrics' row-weighted mean. A split request gives each
    share its own prompts' examples."""
    from gspo.rollout.async_engine import merge_encoded, split_request

    def roll(rows, turns):
        return Rollout([[1]] * rows, [[5, 6, 7]] * rows,
                       [torch.tensor([-0.5, 0.0, -0.25])] * rows, [False] * rows, 1,
                       extras={"rollout/turns_mean": turns},
                       model_mask=[[True, False, True]] * rows)

    a, b = (_encode(roll(n, t), None, None, 0, 0.1) for n, t in ((3, 2.0), (1, 1.0)))
    back = decode(a)
    assert back.model_mask == [[True, False, True]] * 3
    assert back.extras == {"rollout/turns_mean": 2.0}
    merged = decode(merge_encoded([a, b]))
    assert merged.model_mask == [[True, False, True]] * 4
    assert merged.extras == {"rollout/turns_mean": (3 * 2.0 + 1 * 1.0) / 4}
    single = decode(merge_encoded([_encode(Rollout([[1]], [[5]], [torch.zeros(1)], [False], 1),
                                           None, None, 0, 0.1)] * 2))
    assert single.model_mask is None and single.extras == {}
    req = Request(0, 0, [[1], [2], [3]], 2, SamplingParams(3, 1.0), [7, 8, 9], False,
                  examples=["x", "y", "z"])
    assert [r.examples for r in split_request(req, 2)] == [["x", "y"], ["z"]]


def test_drift_metrics_on_a_hand_case():
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    engine = torch.tensor([[0.0, -1.0, -2.0], [0.0, -1.0, 0.0]])
    behaviour = engine + torch.tensor([[0.0, 1e-6, 1e-6], [0.0, 0.0, 0.0]])
    current = behaviour - torch.tensor([[0.0, 0.2, 0.4], [0.0, -0.1, 9.0]])  # 9: padding
    m = drift_metrics(engine, behaviour, current, mask)
    assert m["async/staleness_drift_mean"] == pytest.approx((0.3 - 0.1) / 2)
    assert m["async/staleness_drift_abs_max"] == pytest.approx(0.3)
    assert m["async/engine_mismatch_abs_max"] == pytest.approx(1e-6, rel=0.05)
    assert "async/staleness_drift_mean" not in drift_metrics(engine, None, current, mask)


def test_moe_routing_travels_from_the_engine_and_through_checkpoints():
    """The rollout's routing (R3) and the behaviour pass's (R2) survive the transport and a
    checkpoint's JSON exactly, and row selection re-cuts both."""
    g = torch.Generator().manual_seed(0)
    prompts, responses = [[1, 2], [3]], [[4, 5, 6], [7]]
    width, k = 5, 2  # max(len(prompt) + len(response))
    routing = [torch.randint(-1, 8, (2 * width, k), generator=g) for _ in range(3)]
    behaviour = [torch.randint(0, 8, (2 * width, k), generator=g) for _ in range(3)]
    roll = Rollout(prompts, responses, [torch.zeros(3), torch.zeros(1)], [False, True], 2,
                   routing)
    enc = json.loads(json.dumps(_encode(roll, [[0.0] * 3, [0.0]], behaviour, 4, 0.5)))
    back = decode(enc)
    assert all(torch.equal(a, b) for a, b in zip(back.routing, routing))
    assert all(torch.equal(a, b) for a, b in zip(back.trainer_routing, behaviour))
    assert back.versions == [4, 4]
    one = back.select([1])  # row 1 alone: its own padded length, 2
    assert one.trainer_routing[0].shape == (2, k)
    assert torch.equal(one.trainer_routing[2], behaviour[2].view(2, width, k)[1, :2])
    assert torch.equal(one.routing[0], routing[0].view(2, width, k)[1, :2])
    dense = decode(json.loads(json.dumps(_encode(roll, None, None, 0, 0.0))))
    assert dense.trainer_routing is None


def test_the_behaviour_pass_reruns_under_the_rollouts_experts_for_r3():
    """R3 with ``old_logprobs=recompute``: the engine process's pass on the behaviour weights
    records its own experts and log-probs (the metrics'), and where the rollout's experts
    merged with its own (what the update replays) differ from them, its log-probs under the
    merged experts, the loss's π_old: exactly a pass under ``replay_routing(merged)``. Where
    they do not differ, no second pass. They travel through the transport and row selection."""
    from gspo.models.logprobs import token_logprobs
    from gspo.models.moe import merge_rollout_routing, replay_routing
    from gspo.rollout import pad_batch
    from gspo.rollout.async_engine import Recompute, trainer_pass

    model, tok = load_model("tiny:qwen3_moe", seed=0)
    model.eval()
    eng = build_engine("hf", model, tok, EngineOptions(record_routing=True))
    roll = eng.generate([[1, 2, 3], [4, 5]], group_size=2, params=SamplingParams(4, 1.0),
                        seeds=[1, 2])
    rc = Recompute(token_logprobs, 1.0, 8, 0, routing=True, replay=True)
    lp, own, replayed = trainer_pass(model, roll, rc)
    assert replayed is None  # fp32 HF sampler: it routed as the pass does
    assert merge_rollout_routing(roll, own)[1] == 0
    roll.routing = [torch.where(r >= 0, (r + 1) % 8, r) for r in roll.routing]  # shifted
    lp2, own2, replayed = trainer_pass(model, roll, rc)
    assert lp2 == lp and all(torch.equal(a, b) for a, b in zip(own, own2))  # its own routing
    merged = merge_rollout_routing(roll, own)[0]
    batch = pad_batch(roll.prompt_ids, roll.response_ids, 0)
    with replay_routing(model, merged), torch.no_grad():
        want = token_logprobs(model, batch["input_ids"], batch["attention_mask"],
                              batch["response_mask"], chunk=8)[0]
    assert replayed == [want[i, len(p):len(p) + len(r)].tolist()
                        for i, (p, r) in enumerate(zip(roll.prompt_ids, roll.response_ids))]
    assert replayed != lp
    assert trainer_pass(model, roll, Recompute(token_logprobs, 1.0, 8, 0, routing=True))[2] is None
    back = decode(json.loads(json.dumps(_encode(roll, lp, own, 0, 0.0, replayed_lp=replayed))))
    assert [x.tolist() for x in back.replayed_logprobs] == replayed
    assert [x.tolist() for x in back.select([2]).replayed_logprobs] == [replayed[2]]
    assert decode(_encode(roll, lp, own, 0, 0.0)).replayed_logprobs is None
    # joined with a batch whose pass needed no rerun: that one's rows are its trainer's
    from gspo.rollout.async_engine import merge_encoded
    from gspo.trainer.dynamic_sampling import concat_rollouts

    plain = _encode(roll, lp, own, 0, 0.0)
    joined = merge_encoded([_encode(roll, lp, own, 0, 0.0, replayed_lp=replayed), plain])
    assert joined["replayed_logprobs"] == replayed + lp
    assert merge_encoded([plain, plain])["replayed_logprobs"] is None
    both = concat_rollouts([back, decode(plain)])
    assert [x.tolist() for x in both.replayed_logprobs] == replayed + lp
    assert concat_rollouts([decode(plain)] * 2).replayed_logprobs is None


def test_staleness_routing_metrics_on_a_hand_case():
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])  # 3 response tokens
    behaviour = [torch.tensor([[0, 1], [0, 1], [2, 3], [0, 1], [4, 5], [6, 7]])]
    current = [torch.tensor([[5, 6], [1, 0], [2, 7], [0, 1], [0, 1], [0, 1]])]
    m = staleness_routing_metrics(behaviour, current, mask)
    # response tokens 1 (same set, reordered), 2 (one of two replaced), 4 (both replaced);
    # tokens 0, 3 and 5 are prompt or padding
    assert m["async/staleness_routing_change"] == pytest.approx(2 / 3)
    assert m["async/staleness_expert_change"] == pytest.approx((0 + 0.5 + 1) / 3)
    assert staleness_routing_metrics(None, current, mask) == {}


# ----------------------------------------------------------------------------- slow lane


@pytest.mark.slow
def test_zero_staleness_pipeline_matches_the_sync_loop_bit_for_bit(tmp_path, monkeypatch):
    """The engine process, its shared weights and the result transport change nothing: with
    k = 0 (not reachable from the config, which runs the plain loop then) the weights after
    3 steps equal the synchronous loop's exactly. π_old = the rollout's log-probs in both, so
    no trainer pass whose batch shape differs between the two enters the update."""
    _, rows_pipe = _sync_and_zero_staleness_pipeline(
        tmp_path, monkeypatch, "objective.old_logprobs=rollout")
    assert all(r["async/staleness_max"] == 0 for r in rows_pipe)


def test_an_engine_with_its_own_bf16_copy_follows_the_published_weights(tmp_path,
                                                                        monkeypatch):
    """``rollout.precision=bf16``: the engine process samples from a bfloat16 copy, which it
    must sync from the slot of every new version (it once kept the copies it made at start,
    one per slot, and sampled stale or never-published weights). At k = 0 the pipeline gives
    the synchronous loop's run bit for bit; at k = 1 the engine's log-probs stay within bf16
    rounding of the trainer's pass on the same version at every step."""
    _sync_and_zero_staleness_pipeline(tmp_path, monkeypatch, "rollout.precision=bf16",
                                      "objective.old_logprobs=rollout")
    monkeypatch.undo()
    rows = _rows(_trained(_cfg(tmp_path, "k1-bf16", "steps=4", "rollout.async_steps=1",
                               "rollout.precision=bf16", "logging.rollout_check_every=1")))
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1, 1]
    assert rows[-1]["async/staleness_drift_abs_max"] > 1e-2  # versions far apart
    for r in rows:  # the same version, bf16 against fp32 (it was 0.2 from step 2 on)
        assert r["async/engine_mismatch_abs_max"] < 3e-3, r["async/engine_mismatch_abs_max"]


def test_a_lora_policy_runs_async(tmp_path, monkeypatch):
    """``lora.r > 0``: the engine process samples the PEFT-wrapped policy from the slots (base
    weights and adapter, all published). At k = 0 the pipeline gives the synchronous loop's
    adapter bit for bit; at k = 1 the engine's log-probs are the trainer's on the same
    version, and the run is bounded stale."""
    _sync_and_zero_staleness_pipeline(tmp_path, monkeypatch, "lora.r=4",
                                      "objective.old_logprobs=rollout")
    monkeypatch.undo()
    rows = _rows(_trained(_cfg(tmp_path, "k1-lora", "steps=3", "lora.r=4",
                               "rollout.async_steps=1", "logging.rollout_check_every=1")))
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1]
    assert rows[-1]["async/staleness_drift_abs_max"] > 1e-4  # the adapter moved
    assert all(r["async/engine_mismatch_abs_max"] < 3e-5 for r in rows)


def test_decoupled_async_logs_the_entropy_of_its_every_step_pass_for_the_guard(tmp_path):
    """``old_logprobs=decoupled`` at k = 1: π_old is this step's weights, recomputed every
    step, so ``train/entropy`` is logged every step and the guard's entropy floor (accepted
    for this run) acts, also on steps without the behaviour pass
    (``logging.rollout_check_every=0``: no engine gap). Both were dropped with the gap, so
    the floor never fired."""
    from gspo.trainer.guard import GuardStop

    trainer = Trainer(_cfg(tmp_path, "dec", "rollout.async_steps=1",
                           "objective.old_logprobs=decoupled", "objective.correction.name=tis",
                           "logging.rollout_check_every=0", "guard.on_fault=stop",
                           "guard.collapse_entropy_floor=1000"),
                      reward_fns=[char_codes]).setup()
    try:
        with pytest.raises(GuardStop, match="entropy"):
            trainer.train()
    finally:
        trainer.cleanup()
    rows = _rows(trainer)
    assert len(rows) == 1 and rows[0]["train/entropy"] > 0
    assert "rollout/logprob_gap_abs_max" not in rows[0]  # no pass on the behaviour weights


def test_async_rollout_throughput_divides_by_the_engines_time(tmp_path):
    """At k = 1 ``time/rollout_s`` is the trainer's wait for a batch sampled while it
    trained; ``perf/rollout_tokens_per_s`` divides the batch's tokens by the engine's own
    sampling time (it divided by the wait, inflating it by orders of magnitude)."""
    trainer = _trained(_cfg(tmp_path, "tps", "rollout.async_steps=1", "steps=3"))
    for r in _rows(trainer):
        tokens = r["rollout/response_len_mean"] * 2 * 4
        assert r["perf/rollout_tokens_per_s"] * r["time/rollout_engine_s"] == pytest.approx(
            tokens)


@pytest.mark.slow
def test_a_lora_async_run_resumes_bit_for_bit(tmp_path):
    """A k = 1 LoRA run cut after its step-2 checkpoint (adapter, optimizer, the in-flight
    batch) resumes to the uninterrupted run's adapter and losses bit for bit."""
    extra = ["steps=3", "lora.r=4", "rollout.async_steps=1", "save_every=1"]
    whole = _trained(_cfg(tmp_path, "whole", *extra))
    crashed = _cut_after_step_2(whole.run_dir, tmp_path / "crashed")
    resumed = _trained(_cfg(tmp_path, "crashed", *extra, f"resume={crashed}"))
    _assert_same_run(whole, resumed, step=3)


@pytest.mark.parametrize("dynamic", [False, True])
def test_r3_async_pi_old_routes_like_the_update_so_the_ratio_is_one_at_theta_old(
        tmp_path, monkeypatch, dynamic):
    """R3 at k = 1 with ``old_logprobs=recompute``, the engine process sampling from a bf16
    copy: the rollout routes some positions (prompt tokens here) to other experts than the
    behaviour pass in fp32 on the same weights. The update replays the rollout's experts, so
    the loss's π_old must be that pass under the same experts (the engine process reruns it:
    ``Rollout.replayed_logprobs``), else the ratio is not 1 at θ = θ_old (lr 0: every version
    holds the same weights, so the staleness changes nothing; it was 0.25 clipped at step 0).
    The engine mismatch keeps measuring the pass on its own experts. ``dynamic``: with extra
    draws every step, sampled and passed in the trainer's process and joined with the
    pipeline's rows (their token log-ratio was up to 0.011)."""
    replayed = []
    real = Trainer.update_batch

    def update_batch(self, roll, adv, plan):
        replayed.append(getattr(roll, "replayed_logprobs", None) is not None)
        return real(self, roll, adv, plan)

    monkeypatch.setattr(Trainer, "update_batch", update_batch)
    extra = (["rollout.dynamic_sampling=true", "objective.name=grpo", "objective.eps_low=0.2",
              "objective.eps_high=0.27"] if dynamic else [])
    rows = _rows(_trained(_cfg(tmp_path, "r3-bf16", "model=tiny:qwen3_moe", "optim.lr=0",
                               "moe.routing_replay=r3", "rollout.async_steps=1",
                               "rollout.precision=bf16", "rollout.max_new_tokens=6", *extra),
                          reward=flat_first_group if dynamic else char_codes))
    assert not dynamic or all(r["dynamic/extra_batches"] >= 1 for r in rows)
    assert [r["async/staleness_max"] for r in rows] == [0, 1]
    for r in rows:
        assert r["objective/seq_ratio_min"] == pytest.approx(1.0, abs=1e-6)
        assert r["objective/seq_ratio_max"] == pytest.approx(1.0, abs=1e-6)
        assert r["objective/token_log_ratio_abs_max"] < 1e-6
        assert r["objective/clip_frac_tokens"] == r["objective/clip_frac_seqs"] == 0.0
        assert 0 < r["async/engine_mismatch_abs_max"] < 3e-3  # bf16 sampler vs fp32 pass
    assert any(replayed)  # the routings differed (else this tests nothing): the pass reran


def test_dynamic_sampling_with_an_moe_policy_joins_the_extra_draws_experts(tmp_path):
    """An MoE policy under R3 at k = 1 with extra draws every step: the extra draw's rows
    carry the experts its sampler chose and those of the trainer's pass on this step's
    weights (in the draw's own layout), joined with the pipeline's rows; every sampled expert
    is the behaviour pass's (mismatch 0), which a misaligned join would break."""
    rows = _rows(_trained(_cfg(tmp_path, "moe", "steps=3", "model=tiny:qwen3_moe",
                               "moe.routing_replay=r3", "objective.name=grpo",
                               "objective.eps_low=0.2", "objective.eps_high=0.27",
                               "rollout.async_steps=1", "rollout.dynamic_sampling=true"),
                          reward=flat_first_group))
    assert all(r["dynamic/extra_batches"] >= 1 for r in rows)
    assert [r["async/staleness_min"] for r in rows] == [0, 0, 0]
    assert rows[-1]["async/staleness_max"] == 1
    assert all(r["moe/rollout_routing_mismatch"] == 0.0 for r in rows)
    assert all(r["async/engine_mismatch_abs_max"] < 3e-5 for r in rows)


@pytest.mark.slow
def test_an_async_run_with_dynamic_sampling_resumes_bit_for_bit(tmp_path):
    """k = 1 with extra draws every step, cut after its step-2 checkpoint (the in-flight
    batch, the task's stream after the step's extra draws) resumes to the uninterrupted run's
    weights and losses bit for bit."""
    extra = ["steps=3", "rollout.dynamic_sampling=true", "rollout.async_steps=1",
             "save_every=1"]
    whole = _trained(_cfg(tmp_path, "whole", *extra), reward=flat_first_group)
    assert all(r["dynamic/extra_batches"] >= 1 for r in _rows(whole))
    crashed = _cut_after_step_2(whole.run_dir, tmp_path / "crashed")
    resumed = _trained(_cfg(tmp_path, "crashed", *extra, f"resume={crashed}"),
                       reward=flat_first_group)
    _assert_same_run(whole, resumed, step=3)


def flat_first_group(prompts, completions, **_):
    """No reward variance in a batch's first group, char codes elsewhere: dynamic sampling
    drops one group of every draw and draws again."""
    return [0.0 if p == prompts[0] else float(sum(map(ord, c)) % 97)
            for p, c in zip(prompts, completions)]


def test_dynamic_sampling_draws_its_extra_groups_on_the_steps_own_weights(tmp_path,
                                                                        monkeypatch):
    """``rollout.dynamic_sampling`` with ``async_steps``: the pipeline's batch comes from the
    engine process, the extra draws from this process's engine on this step's weights. At
    k = 0 the run is the synchronous loop's bit for bit (extra draws, joined rows and all);
    at k = 1 the rows kept from extra draws have staleness 0 beside the pipeline's 1, and
    their trainer pass (π_old for recompute) agrees with the engine that sampled them."""
    dyn = ["steps=3", "rollout.dynamic_sampling=true", "objective.old_logprobs=rollout",
           "logging.rollout_check_every=0"]
    sync = _trained(_cfg(tmp_path, "sync", *dyn), reward=flat_first_group)
    monkeypatch.setattr(Trainer, "_async_rollout", lambda self, k: self._pipeline(0))
    pipe = _trained(_cfg(tmp_path, "pipe", *dyn), reward=flat_first_group)
    monkeypatch.undo()
    _assert_same_run(sync, pipe, step=3)
    rows = _rows(pipe)
    assert all(r["dynamic/extra_batches"] >= 1 for r in rows)
    assert [r["dynamic/groups_kept"] for r in rows] == [r["dynamic/groups_kept"]
                                                         for r in _rows(sync)]

    rows = _rows(_trained(_cfg(tmp_path, "k1", "steps=3", "rollout.dynamic_sampling=true",
                               "rollout.async_steps=1", "objective.old_logprobs=recompute"),
                          reward=flat_first_group))
    assert all(r["dynamic/extra_batches"] >= 1 and r["dynamic/groups_kept"] == 2 for r in rows)
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1]
    assert [r["async/staleness_min"] for r in rows] == [0, 0, 0]  # the extra draw's rows
    assert rows[-1]["async/staleness_mean"] == 0.5  # one group of each
    for r in rows:  # every row's behaviour pass is the trainer's on the weights that sampled it
        assert r["async/engine_mismatch_abs_max"] < 3e-5
        assert r["time/rollout_engine_s"] > 0  # the pipeline's timings survive the join
    # an engine with its own bf16 copy here too: synced to this step's weights before it
    # samples (a copy left on the first weights would be ~0.1 off by step 3)
    rows = _rows(_trained(_cfg(tmp_path, "k1-bf16", "steps=3", "rollout.dynamic_sampling=true",
                               "rollout.async_steps=1", "rollout.precision=bf16",
                               "logging.rollout_check_every=1"), reward=flat_first_group))
    assert [r["async/staleness_min"] for r in rows] == [0, 0, 0]
    assert all(r["async/engine_mismatch_abs_max"] < 3e-3 for r in rows)


def test_extra_draws_can_come_from_the_engine_process(tmp_path, monkeypatch):
    """The path vLLM takes (a second vLLM cannot start in the trainer process), here with the
    ``hf`` engine: each extra draw is asked of the engine process, on this step's weights
    (the newest version published), after the batches already asked for. At k = 0 the run is
    the synchronous loop's bit for bit; at k = 1 the extra rows have staleness 0 and carry
    the engine process's pass on that version, which agrees with their sampler."""
    monkeypatch.setattr(Trainer, "_extra_draws_here", lambda self: False)
    dyn = ["steps=3", "rollout.dynamic_sampling=true", "objective.old_logprobs=rollout",
           "logging.rollout_check_every=0"]
    sync = _trained(_cfg(tmp_path, "sync", *dyn), reward=flat_first_group)
    with monkeypatch.context() as m:
        m.setattr(Trainer, "_async_rollout", lambda self, k: self._pipeline(0))
        pipe = _trained(_cfg(tmp_path, "pipe", *dyn), reward=flat_first_group)
    _assert_same_run(sync, pipe, step=3)
    assert all(r["dynamic/extra_batches"] >= 1 for r in _rows(pipe))
    t = Trainer(_cfg(tmp_path, "k1", "steps=3", "rollout.dynamic_sampling=true",
                     "rollout.async_steps=1", "objective.old_logprobs=recompute"),
                reward_fns=[flat_first_group]).setup()
    try:
        assert t.engine is None  # no engine in the trainer process: every draw is the pipeline's
        t.train()
    finally:
        t.cleanup()
    rows = _rows(t)
    assert all(r["dynamic/extra_batches"] >= 1 and r["dynamic/groups_kept"] == 2 for r in rows)
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1]
    assert [r["async/staleness_min"] for r in rows] == [0, 0, 0]  # the extra draw's rows
    assert all(r["async/engine_mismatch_abs_max"] < 3e-5 for r in rows)


def _cut_after_step_2(run_dir, dest):
    """A copy of a 3-step run (``save_every=1``) as a kill after its step-2 checkpoint leaves
    it: no step-3 checkpoint, two metrics rows."""
    import shutil

    shutil.copytree(run_dir, dest)
    shutil.rmtree(dest / "checkpoints" / "step_000003")
    (dest / "checkpoints" / "latest").write_text("step_000002")
    lines = (dest / "metrics.jsonl").read_text().splitlines(keepends=True)
    (dest / "metrics.jsonl").write_text("".join(lines[:2]))
    return dest


def _sync_and_zero_staleness_pipeline(tmp_path, monkeypatch, *extra):
    """3 steps of the synchronous loop and of the engine-process pipeline at k = 0 (not
    reachable from the config, which runs the plain loop then); asserts equal weights and
    losses, returns both runs' metrics rows."""
    # no measuring pass in the pipeline (its batch shapes differ from the loop's); the loop
    # recomputes π_old on every step unless it is the rollout's (the option is unused then)
    check = ["logging.rollout_check_every=0"]
    sync = _trained(_cfg(tmp_path, "sync", "steps=3", *extra,
                         *(check if "objective.old_logprobs=rollout" in extra else ())))
    monkeypatch.setattr(Trainer, "_async_rollout", lambda self, k: self._pipeline(0))
    pipe = _trained(_cfg(tmp_path, "pipe", "steps=3", *extra, *check))
    _assert_same_run(sync, pipe, step=3)
    return _rows(sync), _rows(pipe)


def _trained(cfg, reward=char_codes):
    trainer = Trainer(cfg, reward_fns=[reward]).setup()
    try:
        trainer.train()
    finally:
        trainer.cleanup()
    return trainer


def _assert_same_run(a, b, *, step):
    """The same weights at ``step`` (a LoRA run's: its adapter's), bit for bit, and the same
    losses on the way."""
    def weights(t):
        folder = t.run_dir / f"checkpoints/step_{step:06d}"
        lora = folder / "adapter_model.safetensors"
        return load_file(lora if lora.is_file() else folder / "model.safetensors")

    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [r["train/loss"] for r in _rows(a)] == [r["train/loss"] for r in _rows(b)]


@pytest.mark.slow
def test_zero_staleness_moe_pipeline_with_r2_matches_the_sync_loop_bit_for_bit(tmp_path,
                                                                              monkeypatch):
    """An MoE policy with Routing Replay R2: π_old and the experts it chose come from the
    engine process's pass on the behaviour weights; with zero staleness that pass must give
    what the synchronous loop's own π_old pass gives, so the weights agree bit for bit."""
    # the pipeline's trainer takes π_old's experts from the engine (k = 0 would not)
    monkeypatch.setattr(Trainer, "_behaviour_routing", lambda self: self.hooks.active and (
        getattr(self, "async_rollout", None) is not None))
    rows_sync, rows_pipe = _sync_and_zero_staleness_pipeline(
        tmp_path, monkeypatch, "model=tiny:qwen3_moe", "moe.routing_replay=r2",
        "objective.name=grpo", "objective.eps_low=0.2", "objective.eps_high=0.27")
    assert [r["moe/routing_change"] for r in rows_sync] == [
        r["moe/routing_change"] for r in rows_pipe]
    assert any(r["moe/routing_change"] > 0 for r in rows_pipe)  # the weights did move


@pytest.mark.slow
def test_k2_moe_run_replays_the_behaviour_policys_experts(tmp_path):
    """R3 under staleness: the engine process records the sampled rows' experts and the
    behaviour pass's; the same fp32 code on the same weights chose the same experts
    (mismatch 0), while the current policy's experts have moved away from them."""
    trainer = Trainer(_cfg(tmp_path, "k2-moe", "model=tiny:qwen3_moe", "steps=4",
                           "rollout.async_steps=2", "moe.routing_replay=r3",
                           "objective.name=grpo", "objective.eps_low=0.2",
                           "objective.eps_high=0.27"), reward_fns=[char_codes]).setup()
    try:
        trainer.train()
    finally:
        trainer.cleanup()
    rows = _rows(trainer)
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 2, 2]
    assert all(r["moe/rollout_routing_mismatch"] == 0.0 for r in rows)
    assert rows[0]["async/staleness_routing_change"] == 0.0  # version 0 sampled step 0
    assert rows[-1]["async/staleness_routing_change"] > 0
    assert all("moe/routing_change_layer0" in r for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("old", ["recompute", "rollout"])
def test_k2_run_is_bounded_stale_and_logs_the_drifts_apart(tmp_path, old):
    trainer = Trainer(_cfg(tmp_path, f"k2-{old}", "steps=5", "rollout.async_steps=2",
                           f"objective.old_logprobs={old}", "logging.drift_every=1"),
                      reward_fns=[char_codes]).setup()
    try:
        trainer.train()
    finally:
        trainer.cleanup()
    rows = _rows(trainer)
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 2, 2, 2]
    for r in rows:  # same weights, same fp32 code: the engine agrees with the trainer
        assert r["async/engine_mismatch_abs_max"] < 3e-5
    assert rows[0]["async/staleness_drift_abs_max"] == 0.0  # version 0 sampled step 0
    assert rows[-1]["async/staleness_drift_abs_max"] > 1e-3  # two updates behind
    # the update's own drift (π_θ after it vs the weights it started from), apart from staleness
    assert all(r["drift/seq_log_ratio_abs_max"] > 0 for r in rows)


@pytest.mark.slow
def test_after_a_rollback_no_batch_comes_from_the_discarded_weights(tmp_path, monkeypatch):
    """k = 2, checkpoints every 2 steps, the guard rolls back after step 6 to step_000004.
    Version 6 (the batches of step 8 on) is the restored weights, published once, never the
    discarded ones of updates 5 and 6. Of the batches in flight, step 6's came from version 4
    (kept: the restored weights themselves, so its staleness drift is exactly 0) and step 7's
    from version 5, which the rollback discarded: it is sampled again from version 6, with
    the same prompts."""
    from gspo.trainer.async_rollout import AsyncRollout

    published: dict[int, list[dict[str, torch.Tensor]]] = {}
    real_publish = AsyncRollout.publish

    def publish(self, model, version):
        published.setdefault(version, []).append(
            {k: v.detach().clone() for k, v in model.state_dict().items()})
        return real_publish(self, model, version)

    monkeypatch.setattr(AsyncRollout, "publish", publish)
    trainer = Trainer(_cfg(tmp_path, "rb", "steps=8", "rollout.async_steps=2", "save_every=2",
                           "keep_checkpoints=8",
                           "objective.old_logprobs=recompute"),
                      reward_fns=[char_codes]).setup()
    guard = trainer.reliability.guard
    real_observe = guard.observe
    monkeypatch.setattr(guard, "observe", lambda m: "injected" if trainer.step == 6
                        else real_observe(m))
    prompts: dict[int, list] = {}
    real_next = trainer.async_rollout.next

    def next_batch(step):
        examples, roll = real_next(step)
        prompts[step] = [e.prompt for e in examples]
        return examples, roll

    monkeypatch.setattr(trainer.async_rollout, "next", next_batch)
    drawn = []
    real_draw = trainer.async_rollout.draw
    trainer.async_rollout.draw = lambda b: drawn.append(b) or real_draw(b)
    try:
        trainer.train()
    finally:
        trainer.cleanup()
    rows = {r["step"]: r for r in _rows(trainer)}
    assert [rows[s]["guard/rollbacks"] for s in range(1, 9)] == [0] * 5 + [1] * 3
    assert rows[6]["guard/resampled_batches"] == 1
    assert "guard/resampled_batches" not in rows[5] and "guard/resampled_batches" not in rows[7]
    # rows[s] trains the batch of step s - 1; its staleness is s - 1 minus its version
    assert [rows[s]["async/staleness_max"] for s in range(1, 9)] == [0, 1, 2, 2, 2, 2, 2, 1]
    assert rows[7]["async/staleness_drift_abs_max"] == 0.0  # version 4: the restored weights
    assert rows[8]["async/staleness_drift_abs_max"] > 0  # version 6: one update behind
    assert sorted(published) == list(range(1, 8)) and all(
        len(v) == 1 for v in published.values())  # each version once (0: at the start)
    restored = load_file(trainer.run_dir / "checkpoints/step_000004/model.safetensors")
    assert all(torch.equal(published[6][0][k], restored[k]) for k in restored)
    assert drawn == list(range(8))  # the batch sampled again kept its prompts: none drawn anew
    assert len(prompts) == 8
    # killed after the step-6 checkpoint (written after the rollback, with the batch sampled
    # again and step 8's in flight): the resumed run ends on the same weights, bit for bit
    import shutil

    monkeypatch.undo()
    crashed = tmp_path / "crashed"
    shutil.copytree(trainer.run_dir, crashed)
    shutil.rmtree(crashed / "checkpoints" / "step_000008")
    (crashed / "checkpoints" / "latest").write_text("step_000006")
    resumed = _trained(_cfg(tmp_path, "rb2", "steps=8", "rollout.async_steps=2", "save_every=2",
                            "keep_checkpoints=8", "objective.old_logprobs=recompute",
                            f"resume={crashed}"))
    _assert_same_run(trainer, resumed, step=8)


@pytest.mark.slow
def test_a_dead_engine_process_is_a_clear_error():
    model, tok = load_model("tiny:llama", seed=0)
    from gspo.models import token_logprobs
    from gspo.rollout.async_engine import Recompute

    eng = AsyncEngine(model, tok, engine="hf", opts=EngineOptions(), steps_ahead=1, threads=1,
                      recompute=Recompute(token_logprobs, 1.0, 8, 0))
    try:
        eng.submit(Request(0, 3, [[1, 2]], 2, SamplingParams(3, 1.0), [0], False))
        with pytest.raises(RuntimeError, match="needs policy version 3"):
            eng.take(timeout_s=120)
    finally:
        eng.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_publish_to_an_engine_elsewhere_sends_in_the_background(tmp_path, monkeypatch):
    """The weights' broadcast to a `gspo engine` runs in a thread of its own, so the trainer
    trains on while they cross the network: with every broadcast slowed by 0.2 s (a slow
    link), `publish` returns before the first one ends and `published` waits for the last.
    A batch asked at that version samples from its weights (the batch of an engine here on the
    same weights, bit for bit). A failed broadcast is raised by the next publish."""
    import subprocess
    import sys
    import time

    from gspo.models import token_logprobs
    from gspo.rollout import remote_engine
    from gspo.rollout.async_engine import Recompute

    address = f"file://{tmp_path}/store"
    engine = subprocess.Popen([sys.executable, "-m", "gspo", "engine", address,
                               "--timeout", "60"], stderr=subprocess.PIPE, text=True)
    model, tok = load_model("tiny:llama", seed=0)
    eng = remote_engine.RemoteEngine(
        model, tok, address=address, engine="hf", opts=EngineOptions(), steps_ahead=1,
        threads=1, recompute=Recompute(token_logprobs, 1.0, 8, 0), timeout_s=60)
    try:
        eng.published()
        plain = remote_engine._broadcast

        def slow(group, t):
            time.sleep(0.2)
            plain(group, t)

        monkeypatch.setattr(remote_engine, "_broadcast", slow)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        start = time.perf_counter()
        assert eng.publish(model, 1) < 0.2  # returned while the header was still on its way
        eng.published()
        assert time.perf_counter() - start >= 0.4 and eng.last_send_s >= 0.4  # header + 1 dtype
        req = Request(0, 1, [[1, 2, 3]], 2, SamplingParams(4, 1.0), [5], False)
        eng.submit(req)
        here = InlineEngine(model, tok, 1)
        here.publish(model, 1)
        here.submit(req)
        (_, there), (_, mine) = eng.take(), here.take()
        assert there["versions"] == [1, 1] and there["response_ids"] == mine["response_ids"]
        assert there["logprobs"] == mine["logprobs"]
        engine.kill()
        engine.wait(timeout=30)
        with pytest.raises(RuntimeError, match="sending weights to the rollout engine failed"):
            for version in (2, 3):  # the first send may still fit in the socket's buffers
                eng.publish(model, version)
                eng.published()
    finally:
        eng.close()
        engine.kill()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "lora"])
def test_an_engine_started_elsewhere_gives_the_local_engines_run_bit_for_bit(tmp_path, policy):
    """`gspo engine ADDRESS` in another process (standing in for an inference machine): the
    weights go by torch.distributed broadcast, requests and batches over the same link, and
    k = 2 trains to the weights of the local engine process exactly, staleness included. A
    LoRA policy at k = 1: from version 2 on, a slot the engine filled before gets only the
    adapter (step 4 samples from one)."""

    k = 2 if policy == "full" else 1
    extra = ["steps=4", f"rollout.async_steps={k}", "logging.rollout_check_every=1",
             *(["lora.r=4"] if policy == "lora" else [])]
    local = _trained(_cfg(tmp_path, "local", *extra))
    address = f"tcp://127.0.0.1:{_free_port()}"
    with gspo_engines([address]):
        remote = _trained(_cfg(tmp_path, "remote", *extra, f"rollout.async_address={address}"))
    _assert_same_run(local, remote, step=4)
    rows_remote = _rows(remote)
    assert [r["async/staleness_max"] for r in rows_remote] == [min(t, k) for t in range(4)]
    assert all(r["async/engine_mismatch_abs_max"] < 3e-5 for r in rows_remote)
    # version 0 went with the set-up; each later step publishes its own weights first, after
    # waiting for the previous publish's broadcast, and reports how long that took
    assert "time/weight_sync_s" not in rows_remote[0]
    assert all(r["time/weight_sync_s"] > 0 for r in rows_remote[1:])
    assert all(r["time/publish_send_s"] > 0 for r in rows_remote[1:])
    assert "time/publish_send_s" not in _rows(local)[0]


@pytest.mark.slow
def test_extra_draws_from_an_engine_elsewhere_or_two_engines_train_as_the_spawned_one(
        tmp_path, monkeypatch):
    """Dynamic sampling's extra draws asked of the engine (vLLM's path, here with ``hf``):
    a `gspo engine` started elsewhere gives the spawned engine's run bit for bit (the
    ``(step, draw)`` keys travel over its link), and two engines, each with its share of every
    draw, the same rewards and losses."""

    monkeypatch.setattr(Trainer, "_extra_draws_here", lambda self: False)
    extra = ["steps=3", "rollout.async_steps=1", "rollout.dynamic_sampling=true",
             "logging.rollout_check_every=1"]
    local = _trained(_cfg(tmp_path, "local", *extra), reward=flat_first_group)
    address = f"tcp://127.0.0.1:{_free_port()}"
    with gspo_engines([address]):
        remote = _trained(_cfg(tmp_path, "remote", *extra, f"rollout.async_address={address}"),
                          reward=flat_first_group)
    _assert_same_run(local, remote, step=3)
    two = _trained(_cfg(tmp_path, "two", *extra, "rollout.async_engines=2"),
                   reward=flat_first_group)
    for a, b in zip(_rows(local), _rows(two)):
        assert a["dynamic/extra_batches"] >= 1 and a["async/staleness_min"] == 0
        assert b["reward/mean"] == a["reward/mean"]
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-6)


@pytest.mark.slow
def test_an_engine_started_elsewhere_reports_its_failure_to_the_trainer(tmp_path):
    """A request for a version the trainer never published: the engine waits for it (here
    3 s; its wait for the next publish times out as well), then the trainer's take raises
    with the engine's own error."""

    from gspo.models import token_logprobs
    from gspo.rollout.async_engine import Recompute
    from gspo.rollout.remote_engine import RemoteEngine

    address = f"file://{tmp_path}/store"
    with gspo_engines([address], timeout_s=3):
        model, tok = load_model("tiny:llama", seed=0)
        eng = RemoteEngine(model, tok, address=address, engine="hf", opts=EngineOptions(),
                           steps_ahead=1, threads=1,
                           recompute=Recompute(token_logprobs, 1.0, 8, 0), timeout_s=120)
        try:
            eng.submit(Request(0, 3, [[1, 2]], 2, SamplingParams(3, 1.0), [0], False))
            with pytest.raises(RuntimeError, match=r"needs policy version 3, but slot 1 holds|"
                               r"receiving weights from the trainer failed: .*Timed out"):
                eng.take()
        finally:
            eng.close()


@pytest.mark.slow
def test_a_finished_run_resumed_with_more_steps_samples_its_next_batches_from_its_weights(
        tmp_path):
    """A run that ended never drew the batches of its last k steps, and the versions they
    would come from are gone: resumed with more steps, those come from the weights it resumes
    with (staleness 0, then k again), instead of a request for a version no slot holds."""
    _trained(_cfg(tmp_path, "ext", "rollout.async_steps=2", "steps=2"))
    extended = _trained(_cfg(tmp_path, "ext", "rollout.async_steps=2", "steps=5",
                             f"resume={tmp_path / 'ext'}"))
    assert [r["async/staleness_max"] for r in _rows(extended)] == [0, 1, 0, 1, 2]


@pytest.mark.slow
def test_two_engines_join_an_moe_policys_routing_records(tmp_path):
    """rollout.async_engines=2 with an MoE policy under R3: each engine records the experts
    its rows were sampled with and those of the behaviour pass, in its own batch's layout; the
    shares' records, joined, are the whole batch's (every sampled expert is the one the
    behaviour pass chose: mismatch 0), and the run samples what one engine does."""
    extra = ["steps=3", "model=tiny:qwen3_moe", "rollout.async_steps=1", "optim.lr=1e-4",
             "moe.routing_replay=r3", "objective.name=grpo", "objective.eps_low=0.2",
             "objective.eps_high=0.27"]
    one = _rows(_trained(_cfg(tmp_path, "one", *extra)))
    two = _rows(_trained(_cfg(tmp_path, "two", *extra, "rollout.async_engines=2")))
    assert [r["async/staleness_max"] for r in two] == [0, 1, 1]
    assert all(r["moe/rollout_routing_mismatch"] == 0.0 for r in one + two)
    assert [r["reward/mean"] for r in one] == [r["reward/mean"] for r in two]


@pytest.mark.slow
def test_two_engines_for_one_trainer_sample_and_train_as_one(tmp_path):
    """rollout.async_engines=2: each engine process samples half of the prompts; the run
    trains to the one-engine run's weights (< 1e-5 at lr 1e-4: the engines' batches of 4
    rows instead of 8 round differently, which AdamW turns into ~lr x noise on weights whose
    gradient is near 0), with the same rewards. Two `gspo engine`s in its place give the
    spawned engines' run bit for bit."""

    extra = ["steps=3", "rollout.async_steps=1", "optim.lr=1e-4", "save_every=1"]
    one = _trained(_cfg(tmp_path, "one", *extra))
    two = _trained(_cfg(tmp_path, "two", *extra, "rollout.async_engines=2"))
    w1, w2 = (load_file(t.run_dir / "checkpoints/step_000003/model.safetensors")
              for t in (one, two))
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-5
    assert [r["reward/mean"] for r in _rows(one)] == [r["reward/mean"] for r in _rows(two)]
    assert [r["async/staleness_max"] for r in _rows(two)] == [0, 1, 1]
    addresses = [f"tcp://127.0.0.1:{_free_port()}" for _ in range(2)]
    with gspo_engines(addresses):
        remote = _trained(_cfg(tmp_path, "remote", *extra, "rollout.async_engines=2",
                               f"rollout.async_address={','.join(addresses)}"))
    _assert_same_run(two, remote, step=3)


def test_lend_threads_config_errors():
    with pytest.raises(ConfigError, match="async_lend_threads is used only with"):
        load_config(None, ["rollout.async_lend_threads=true"])
    with pytest.raises(ConfigError, match="async_lend_threads: engines started with"):
        load_config(None, ["rollout.async_steps=1", "rollout.async_lend_threads=true",
                           "rollout.async_address=tcp://127.0.0.1:29500"])
    load_config(None, ["rollout.async_steps=1", "rollout.async_lend_threads=true"])


def test_thread_lending_follows_the_engine_and_counts_its_time(monkeypatch):
    """ThreadLending: own + lent threads while the engine is idle, own while it samples; a
    change only when the wanted count changes; the time on lent threads accounted; restore
    gives the own threads back."""
    from gspo.rollout import async_engine

    calls: list[int] = []
    monkeypatch.setattr(async_engine.torch, "set_num_threads", calls.append)
    clock = iter([0.0, 1.0, 3.5, 4.0, 6.0, 7.0, 8.0])
    monkeypatch.setattr(async_engine.time, "perf_counter", lambda: next(clock))
    idle = [False]
    lend = async_engine.ThreadLending(1, 2, lambda: idle[0])  # t = 0
    lend.poll()
    assert calls == []  # busy engine, own threads already
    idle[0] = True
    lend.poll()  # t = 1: the engine is done
    lend.poll()
    assert calls == [3]
    idle[0] = False
    lend.poll()  # t = 3.5: it samples again
    assert calls == [3, 1]
    assert lend.take_lent_s() == 2.5  # t = 4
    idle[0] = True
    lend.poll()  # t = 6
    assert lend.take_lent_s() == 1.0  # t = 7: still lent, counted up to now
    lend.restore()  # t = 8: t 7..8 on lent threads, accounted
    assert calls == [3, 1, 3, 1] and lend.current == 1
    assert lend.lent_s == 1.0


def test_an_async_engine_counts_its_finished_requests():
    """AsyncEngine.idle: the trainer's count of requests asked against the engine process's
    shared count of those it finished (a batch or an error)."""
    engine = AsyncEngine.__new__(AsyncEngine)  # its counts only, no process
    engine.submitted, engine.finished = 0, torch.zeros(1, dtype=torch.long).share_memory_()

    class Q:
        def put(self, item):
            pass

    engine.requests = Q()
    assert engine.idle()
    engine.submit(None)
    engine.submit(None)
    assert not engine.idle()
    engine.finished.add_(2)  # what the engine process does as it puts each result
    assert engine.idle()


@pytest.mark.parametrize("fails", [False, True])
def test_take_says_the_trainer_waits_while_it_waits(fails):
    """With thread lending the engine process borrows the trainer's threads while take()
    waits for a batch: the shared flag is 1 during the wait and 0 after it, also when the
    wait ends in an error."""
    engine = AsyncEngine.__new__(AsyncEngine)  # the flag and take() only, no process
    engine.waiting = torch.zeros(1, dtype=torch.long).share_memory_()
    seen = []

    def get(timeout_s):
        seen.append(int(engine.waiting))
        if fails:
            raise TimeoutError("no batch")
        return "batch", (0, {})

    engine._get = get
    if fails:
        with pytest.raises(TimeoutError):
            engine.take()
    else:
        assert engine.take() == (0, {})
    assert seen == [1] and int(engine.waiting) == 0


def _trained_on_lent_threads(cfg):
    """``_trained`` with rollout.async_lend_threads, each side's lending arranged rather than
    left to the timing (on a loaded machine either could miss it: the engine could finish
    batch 0 before the trainer reached take(), or still sample batch t + 1 when the update of
    step t ended). The engine is told the trainer waits from the start, so it samples batch 0
    on the trainer's thread; the reward returns once the engine has sampled every batch asked
    of it, so each step's update runs on the engine's thread. The batches, rewards and update
    are the plain run's: only when the threads change is fixed."""
    import time

    trainer = None

    def char_codes_once_the_engine_is_idle(prompts, completions, **kw):
        deadline = time.monotonic() + 50  # within reward.timeout_s (60 s)
        while not trainer.async_rollout.engine.idle():
            assert time.monotonic() < deadline, "the engine sampled one batch for 50 s"
            time.sleep(0.005)
        return char_codes(prompts, completions, **kw)

    trainer = Trainer(cfg, reward_fns=[char_codes_once_the_engine_is_idle]).setup()
    trainer.async_rollout.engine.waiting.fill_(1)  # take() sets it, and clears it after batch 0
    try:
        trainer.train()
    finally:
        trainer.cleanup()
    return trainer


def _check_a_run_on_lent_threads(tmp_path):
    extra = ["steps=3", "rollout.async_steps=1", "save_every=1", "num_threads=1"]
    own = _trained(_cfg(tmp_path, "own", *extra))
    lent = _trained_on_lent_threads(_cfg(tmp_path, "lent", *extra,
                                         "rollout.async_lend_threads=true"))
    _assert_same_run(own, lent, step=3)
    rows = _rows(lent)
    assert all(r["async/lent_threads_s"] > 0 for r in rows)
    # the engine borrowed the trainer's thread while the trainer waited for batch 0
    assert rows[0]["async/engine_borrowed_s"] > 0
    assert torch.get_num_threads() == 1  # given back when the pipeline closed
    assert not any("async/lent_threads_s" in r for r in _rows(own))


@pytest.mark.slow
def test_a_run_on_lent_threads_trains_to_the_same_weights(tmp_path):
    """rollout.async_lend_threads: the trainer runs on 2 threads while the engine process
    waits, the engine on 2 while the trainer waits (both logged), and, on this machine type's
    kernels, the run trains to the same weights bit for bit as on their own threads."""
    _check_a_run_on_lent_threads(tmp_path)


@pytest.mark.slow
def test_a_run_on_lent_threads_checks_the_same_when_the_trainer_is_late_and_the_engine_stalls(
        tmp_path, monkeypatch):
    """The timing a loaded machine can give the test above (it failed once in 15 runs there):
    the trainer reaches take() only once the engine has sampled batch 0, and the engine is
    then descheduled for 3 s while it samples batch 1, during the trainer's first update. The
    same weights and the same lending, which the test arranges rather than leaves to chance."""
    import os
    import signal
    import threading
    import time

    take, stalled = AsyncEngine.take, []

    def late_take(self, timeout_s=3600.0):
        if self.waiting is None or stalled:  # the lent run's first take only: batch 0
            return take(self, timeout_s)
        while int(self.finished) < 1 or self.results.empty():
            time.sleep(0.005)
        os.kill(self.proc.pid, signal.SIGSTOP)
        stalled.append(threading.Timer(3.0, os.kill, (self.proc.pid, signal.SIGCONT)))
        stalled[0].start()
        return take(self, timeout_s)

    monkeypatch.setattr(AsyncEngine, "take", late_take)
    try:
        _check_a_run_on_lent_threads(tmp_path)
    finally:
        for timer in stalled:
            timer.join()
    assert stalled  # the disturbance ran


@pytest.mark.slow
def test_the_engine_process_outlives_a_ctrl_c_or_sigterm_to_the_process_group():
    """A Ctrl-C in a terminal sends SIGINT to the whole process group, a batch scheduler
    SIGTERM to every process of a job: the trainer then finishes its step and checkpoints
    (GracefulStop), which waits for the engine's batches in flight. So the engine process
    ignores both (the trainer stops it) and still samples what it is asked."""
    import os
    import signal
    import time

    from gspo.models import token_logprobs
    from gspo.rollout.async_engine import Recompute

    model, tok = load_model("tiny:llama", seed=0)
    eng = AsyncEngine(model, tok, engine="hf", opts=EngineOptions(), steps_ahead=1, threads=1,
                      recompute=Recompute(token_logprobs, 1.0, 8, 0))
    try:
        os.kill(eng.proc.pid, signal.SIGINT)
        os.kill(eng.proc.pid, signal.SIGTERM)
        time.sleep(1.0)  # the signals arrive while the engine waits for a request
        eng.submit(Request(0, 0, [[1, 2]], 2, SamplingParams(3, 1.0), [0], False))
        step, enc = eng.take(timeout_s=120)
        assert step == 0 and len(enc["response_ids"]) == 2
        assert eng.proc.is_alive()
    finally:
        eng.close()
    assert not eng.proc.is_alive()


ENGINE_LEFT_UNREAD = '''
import os, signal, sys, time
from gspo.models import load_model, token_logprobs
from gspo.rollout import SamplingParams
from gspo.rollout.async_engine import AsyncEngine, Recompute, Request
from gspo.rollout.engine import EngineOptions

if __name__ == "__main__":
    model, tok = load_model("tiny:llama", seed=0)
    eng = AsyncEngine(model, tok, engine="hf", opts=EngineOptions(), steps_ahead=1, threads=1,
                      recompute=Recompute(token_logprobs, 1.0, 8, 0))
    print(eng.proc.pid, flush=True)
    for step in range(2):  # > 64 KiB of results, more than a pipe holds
        eng.submit(Request(step, 0, [[200] * 400] * 4, 16, SamplingParams(4, 1.0),
                           [0, 1, 2, 3], False))
    while not eng.idle():  # both sampled: the engine now waits to push them into the pipe
        time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGKILL)  # the trainer dies without reading them
'''


ENGINE_NEVER_CLOSED = '''
from gspo.models import load_model, token_logprobs
from gspo.rollout.async_engine import AsyncEngine, Recompute
from gspo.rollout.engine import EngineOptions

if __name__ == "__main__":
    model, tok = load_model("tiny:llama", seed=0)
    eng = AsyncEngine(model, tok, engine="hf", opts=EngineOptions(), steps_ahead=1, threads=1,
                      recompute=Recompute(token_logprobs, 1.0, 8, 0))
'''


@pytest.mark.slow
def test_a_trainer_that_never_closes_its_engine_still_exits(tmp_path):
    """The engine process ignores SIGTERM, multiprocessing's way to end a daemon process at
    exit: the engine is closed at exit before that, so the interpreter does not wait for it
    forever."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "trainer.py"
    script.write_text(ENGINE_NEVER_CLOSED)
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(script)], timeout=120,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    assert proc.returncode == 0


@pytest.mark.slow
def test_an_engine_process_exits_when_its_trainer_is_killed_with_batches_unread(tmp_path):
    """A SIGKILLed trainer leaves batches unread; the engine process must still exit (it
    holds k + 1 copies of the policy), not wait forever to push them into a pipe no one
    reads."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = tmp_path / "trainer.py"
    script.write_text(ENGINE_LEFT_UNREAD)
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(repo)})
    pid = int(proc.stdout.readline())
    assert proc.wait(timeout=300) == -9
    end = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < end:
        time.sleep(0.2)
    alive = os.path.exists(f"/proc/{pid}")
    if alive:
        os.kill(pid, 9)
    assert not alive, "the engine process outlived its killed trainer"


def test_the_staleness_distribution_has_one_share_per_lag_up_to_the_bound():
    from gspo.trainer.async_rollout import staleness_metrics

    m = staleness_metrics(5, [5, 4, 4, 3], k=3)
    assert [m[f"async/staleness_frac_{s}"] for s in range(4)] == [0.25, 0.5, 0.25, 0.0]
    assert (m["async/staleness_min"], m["async/staleness_mean"], m["async/staleness_max"]) == (
        0.0, 1.0, 2.0)


def test_a_resume_under_other_sampling_settings_samples_the_inflight_batches_again():
    """The checkpoint's in-flight batches carry the settings they were sampled under. A resume
    with the same ones keeps them (bit for bit); one with another ``rollout.temperature``
    samples them again, with the same prompts and seeds and the new temperature, from the
    version it resumes with, and says so. Kept, their log-probs at the old temperature
    trained as π_old against π_θ at the new one."""
    model, tok = load_model("tiny:llama", seed=0)

    def pipeline(temperature):
        def request_for(examples, step):
            return Request(step, step, [[1, 2, 3 + step]], 2,
                           SamplingParams(3, temperature), [step], False)

        pipe = AsyncRollout(k=2, total_steps=5, draw=lambda s: ([], request_for([], s)),
                            check=lambda s: False, engine="hf", opts=EngineOptions(),
                            threads=1, logprob_fn=None, temperature=temperature, chunk=8,
                            pad_id=0, sampled_under={"rollout.temperature": temperature},
                            request_for=request_for)
        pipe.engine = InlineEngine(model, tok, 2)
        return pipe

    pipe = pipeline(1.0)
    pipe.publish(model, 0)
    for step in range(3):
        pipe.next(step)
        pipe.publish(model, step + 1)
    state = json.loads(json.dumps(pipe.state_dict()))
    assert state["sampled_under"] == {"rollout.temperature": 1.0}
    same = pipeline(1.0)
    same.load_state_dict(state)
    same.floor = same.published = 3  # as start(version=3)
    assert [same.next(s)[1].versions for s in (3, 4)] == [[1, 1], [2, 2]]
    assert same.engine.asked == []  # nothing sampled again
    other = pipeline(0.5)
    with pytest.warns(UserWarning, match=r"rollout.temperature=1.0 \(now 0.5\)"):
        other.load_state_dict(state)
    other.publish(model, 3)
    other.floor = 3
    assert [other.next(s)[1].versions for s in (3, 4)] == [[3, 3], [3, 3]]
    assert [(r.step, r.version, r.params.temperature) for r in other.engine.asked] == [
        (3, 3, 0.5), (4, 3, 0.5)]


@pytest.mark.slow
def test_an_async_run_resumed_with_recompute_samples_its_inflight_batch_again(tmp_path):
    """k = 1 with ``old_logprobs=rollout`` cut after its step-2 checkpoint, resumed with
    ``recompute``: the in-flight batch never had the behaviour pass that π_old now is (the
    loss crashed on a None π_old); it is sampled again from the resumed weights, with it."""
    extra = ["steps=3", "rollout.async_steps=1", "save_every=1",
             "logging.rollout_check_every=0"]
    whole = _trained(_cfg(tmp_path, "whole", *extra, "objective.old_logprobs=rollout"))
    crashed = _cut_after_step_2(whole.run_dir, tmp_path / "crashed")
    with pytest.warns(UserWarning, match="objective.old_logprobs=rollout"):
        resumed = _trained(_cfg(tmp_path, "crashed", *extra, "objective.old_logprobs=recompute",
                                f"resume={crashed}"))
    last = _rows(resumed)[-1]
    assert last["async/staleness_max"] == 0  # from the weights it resumed with
    assert last["async/engine_mismatch_abs_max"] < 3e-5  # the behaviour pass is there


def test_decoupled_async_moe_logs_how_far_staleness_moved_the_routing(tmp_path):
    """``old_logprobs=decoupled`` with an MoE policy at k = 1: π_old's experts are this
    step's, but on the measuring steps the engine process's pass records the behaviour
    policy's, so ``async/staleness_{routing,expert}_change`` is logged as for ``rollout``
    (it was never logged under ``decoupled``)."""
    rows = _rows(_trained(_cfg(tmp_path, "dec-moe", "model=tiny:qwen3_moe",
                               "rollout.async_steps=1", "objective.old_logprobs=decoupled",
                               "objective.correction.name=tis",
                               "logging.rollout_check_every=1")))
    assert rows[0]["async/staleness_routing_change"] == 0.0  # version 0 sampled step 0
    assert rows[1]["async/staleness_routing_change"] > 0  # one update behind
    assert 0 < rows[1]["async/staleness_expert_change"] <= rows[1][
        "async/staleness_routing_change"]
