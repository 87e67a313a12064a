"""Greedy evaluation on held-out prompts."""

from __future__ import annotations

from typing import Any

import torch

from gspo.data import format_prompt
from gspo.rollout import greedy_generate
from gspo.rollout.batch import policy_tokens
from gspo.rollout.multiturn import TurnLoop, greedy_sampler


@torch.no_grad()
def evaluate(model: Any, tokenizer: Any, examples: list[Any], scorer: Any, *,
             chat_template: bool, system_prompt: str, max_new_tokens: int, eos: list[int],
             pad_id: int, batch_size: int = 32, fast_decode: bool = True,
             decode_matmul: str = "auto",
             turns: TurnLoop | None = None) -> dict[str, float]:
    """Greedy responses scored by the run's reward functions (``turns``: greedy episodes of
    the run's multi-turn loop, scored on the whole transcript).

    ``accuracy`` is the share of prompts given full marks (reward equal to the sum of the
    positive reward weights: 1 from every function, 0 from every penalty, a function of negative
    weight); ``reward_mean`` the mean reward; unscorable responses count as wrong.
    """
    full = sum(w for w in scorer.weights if w > 0)
    rewards: list[float] = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        prompts = [format_prompt(tokenizer, ex.prompt, chat_template=chat_template,
                                 system_prompt=system_prompt) for ex in chunk]
        if turns is None:
            out = greedy_generate(model, prompts, max_new_tokens=max_new_tokens, eos=eos,
                                  pad_id=pad_id, fast_decode=fast_decode,
                                  decode_matmul=decode_matmul)
            mask = None
        else:
            sample = greedy_sampler(model, max_new_tokens=max_new_tokens, eos=eos,
                                    pad_id=pad_id, fast_decode=fast_decode,
                                    decode_matmul=decode_matmul)
            roll = turns.run(sample, chunk, prompts, [0] * len(chunk), 1)
            out, mask = roll.response_ids, roll.model_mask
        completions = tokenizer.batch_decode(out, skip_special_tokens=True)
        columns: dict[str, list] = {"answer": [ex.answer for ex in chunk]}
        for key in chunk[0].columns:
            columns[key] = [ex.columns.get(key) for ex in chunk]
        # the policy's tokens, EOS included, as training scores them (a reward function that
        # names response_tokens needs them)
        total, _ = scorer([ex.prompt for ex in chunk], completions, columns,
                          response_tokens=policy_tokens(out, mask))
        rewards += [0.0 if r != r else r for r in total]  # NaN (unscorable) counts as 0
    n = max(len(rewards), 1)
    return {"accuracy": sum(r >= full - 1e-9 for r in rewards) / n,
            "reward_mean": sum(rewards) / n, "n": float(len(rewards))}
