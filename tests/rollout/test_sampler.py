import torch

from gspo.data import format_prompt
from gspo.models.logprobs import token_logprobs
from gspo.models.tiny import build_tiny
from gspo.rollout import SamplingParams, generate, greedy_generate, pad_batch
from gspo.rollout.sampler import _filter


def _setup(seed=0):
    model, tok = build_tiny("llama", seed=seed)
    prompts = [format_prompt(tok, p) for p in ["What is 1+2?", "Hi", "What is 13+48? Answer."]]
    return model, tok, prompts


def test_sampled_logprobs_equal_trainer_recompute():
    model, tok, prompts = _setup()
    g = torch.Generator().manual_seed(0)
    roll = generate(model, prompts, group_size=4, eos=[tok.eos_token_id], pad_id=0,
                    params=SamplingParams(max_new_tokens=12, temperature=0.8), generator=g)
    assert len(roll) == 12 and roll.prompt_ids[0] == roll.prompt_ids[3] == prompts[0]
    batch = pad_batch(roll.prompt_ids, roll.response_ids, 0, roll.logprobs)
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"],
                               batch["response_mask"], temperature=0.8)
    mask = batch["response_mask"]
    gap = ((lp - batch["old_logprobs"]) * mask).sum(1) / mask.sum(1)
    assert gap.abs().max() < 3e-6


def test_sampling_is_reproducible_with_a_seeded_generator():
    model, _, prompts = _setup()
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    runs = [generate(model, prompts, group_size=3, params=params, eos=[1], pad_id=0,
                     generator=torch.Generator().manual_seed(5)).response_ids for _ in range(2)]
    assert runs[0] == runs[1]


def test_shared_prefill_and_row_dropping_match_one_prompt_at_a_time():
    """Greedy decoding of a batch (finished rows dropped) equals decoding each prompt alone."""
    model, _, prompts = _setup(seed=4)
    eos = list(range(1, 60))  # many EOS ids so rows finish at different steps
    batched = greedy_generate(model, prompts, max_new_tokens=10, eos=eos, pad_id=0)
    alone = [greedy_generate(model, [p], max_new_tokens=10, eos=eos, pad_id=0)[0]
             for p in prompts]
    assert batched == alone
    lengths = {len(r) for r in batched}
    roll = generate(model, prompts, group_size=3, params=SamplingParams(10), eos=eos, pad_id=0,
                    greedy=True)
    assert roll.response_ids == [r for r in batched for _ in range(3)]
    assert len(lengths) >= 1


def test_eos_ends_a_response_and_truncation_is_flagged():
    model, _, prompts = _setup()
    roll = generate(model, prompts, group_size=2, params=SamplingParams(3, 1.0), eos=[1],
                    pad_id=0, generator=torch.Generator().manual_seed(0))
    for ids, trunc in zip(roll.response_ids, roll.truncated):
        assert len(ids) <= 3
        assert trunc == (ids[-1] != 1)
        assert 1 not in ids[:-1]


def test_top_k_top_p_filter():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(_filter(logits, 2, 1.0)[0, 2:]).all()
    kept = ~torch.isinf(_filter(logits, 0, 0.7)[0])
    assert kept.tolist() == [True, True, False, False]
    assert torch.equal(_filter(logits, 0, 1.0), logits)
