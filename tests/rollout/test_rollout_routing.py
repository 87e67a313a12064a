"""Routing replay R3: the sampler records the experts it routed to, in the trainer's layout.

On unchanged weights the rollout's expert choices must equal the ones the trainer's
teacher-forced π_old forward over ``pad_batch`` records (R2) at every position the sampler fed
through the model: prompt tokens (left-padded prefill shared by a group) and every response token
but the last (decode steps, rows dropping out as they finish).
"""

import pytest
import torch

from gspo.models.logprobs import token_logprobs
from gspo.models.moe import capture_routing, routing_change
from gspo.models.tiny import build_tiny
from gspo.rollout import SamplingParams, generate, pad_batch
from gspo.rollout.sampler import _RoutingLog

PROMPTS = [[1, 40, 41, 42, 43, 44, 45, 46, 47], [1, 50, 51], [1, 60, 61, 62, 63, 64]]
EOS = list(range(100, 140))  # many "EOS" ids: rows finish at different steps
PARAMS = SamplingParams(max_new_tokens=10, temperature=1.0)


def _rollout(family: str, record: bool = True):
    model, _ = build_tiny(family, seed=3)
    gens = [torch.Generator().manual_seed(11 + i) for i in range(len(PROMPTS))]
    roll = generate(model, PROMPTS, group_size=3, params=PARAMS, eos=EOS, pad_id=0,
                    generator=gens, record_routing=record)
    return model, roll


def _teacher_forced(model, roll):
    batch = pad_batch(roll.prompt_ids, roll.response_ids, 0, roll.logprobs)
    with torch.no_grad(), capture_routing(model) as rec:
        token_logprobs(model, batch["input_ids"], batch["attention_mask"],
                       batch["response_mask"], temperature=PARAMS.temperature)
    return batch, rec.take()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_rollout_routing_equals_teacher_forced_routing(family):
    model, roll = _rollout(family)
    lengths = [len(r) for r in roll.response_ids]
    assert len(set(lengths)) > 1 and min(lengths) < PARAMS.max_new_tokens  # rows end apart
    assert any(roll.truncated) and not all(roll.truncated)
    batch, r2 = _teacher_forced(model, roll)
    assert roll.routing is not None and len(roll.routing) == len(r2) == 4
    # Known = every real position but each row's final token (never fed forward).
    expected = batch["attention_mask"].clone()
    for i, (p, r) in enumerate(zip(roll.prompt_ids, roll.response_ids)):
        expected[i, len(p) + len(r) - 1] = 0
    response = batch["response_mask"].reshape(-1).bool()
    for rolled, old in zip(roll.routing, r2):
        assert rolled.shape == old.shape and rolled.dtype == torch.long
        known = (rolled >= 0).all(-1)
        assert torch.equal(known, expected.reshape(-1).bool())
        assert ((rolled >= 0).all(-1) | (rolled == -1).all(-1)).all()
        assert torch.equal(rolled[known], old[known])
        assert (known & response).sum() > 20  # response tokens are compared, not only prompts
    res = routing_change(r2, [torch.where(r >= 0, r, o) for r, o in zip(roll.routing, r2)])
    print(f"{family}: rollout vs teacher-forced routing mismatch {float(res['overall']):.3g} "
          f"over {int(expected.sum())} known positions x {len(r2)} layers")
    assert float(res["overall"]) == 0.0


def test_recording_changes_nothing_else_and_costs_nothing_when_off(monkeypatch):
    _, on = _rollout("qwen3_moe", record=True)
    entered = []
    monkeypatch.setattr(_RoutingLog, "__init__", lambda *a, **k: entered.append(1))
    _, off = _rollout("qwen3_moe", record=False)
    assert not entered and off.routing is None
    assert off.response_ids == on.response_ids
    assert all(torch.equal(a, b) for a, b in zip(off.logprobs, on.logprobs))


def test_select_keeps_the_selected_rows_routing():
    model, roll = _rollout("qwen3_moe")
    idx = [1, 4, 8]
    sub = roll.select(idx)
    _, r2 = _teacher_forced(model, sub)
    for rolled, old in zip(sub.routing, r2):
        assert rolled.shape == old.shape
        known = (rolled >= 0).all(-1)
        assert known.any() and torch.equal(rolled[known], old[known])


def test_recording_a_dense_model_is_an_error():
    model, _ = build_tiny("llama")
    with pytest.raises(ValueError, match="not a Mixture-of-Experts"):
        generate(model, PROMPTS, group_size=2, params=PARAMS, eos=EOS, pad_id=0,
                 record_routing=True)


def test_join_replayed_is_the_one_rule_for_encoded_and_decoded_batches():
    """R3's replayed log-probs of joined batches, for merge_encoded (lists) and concat_rollouts
    (tensors) alike: a batch without them gives its trainer log-probs; none anywhere: None;
    replayed ones beside a batch with neither: an error (merge_encoded raised a TypeError)."""
    from gspo.rollout.async_engine import merge_encoded
    from gspo.rollout.batch import join_replayed

    assert join_replayed([[[0.5]], None], [[[0.1]], [[0.2], [0.3]]]) == [[0.5], [0.2], [0.3]]
    assert join_replayed([None, None], [[[0.1]], None]) is None
    rows = join_replayed([None, [torch.tensor([1.0])]], [[torch.tensor([2.0])], None])
    assert [r.tolist() for r in rows] == [[2.0], [1.0]]
    with pytest.raises(ValueError, match="no trainer_logprobs"):
        join_replayed([[[0.5]], None], [[[0.1]], None])
    share = {"prompt_ids": [[1]], "response_ids": [[2]], "logprobs": [[0.0]],
             "truncated": [False], "versions": [0], "group_size": 1, "routing": None,
             "trainer_routing": None, "generate_s": 0.0, "extras": {}}
    with pytest.raises(ValueError, match="no trainer_logprobs"):
        merge_encoded([{**share, "trainer_logprobs": [[0.1]], "replayed_logprobs": [[0.5]]},
                       {**share, "trainer_logprobs": None, "replayed_logprobs": None}])
