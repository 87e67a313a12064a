"""Reward shaping: DAPO's soft overlong punishment.

arXiv:2503.14476 v1, §3.4 ("Soft Overlong Punishment"): with a length budget ``L_max`` and a
buffer ``L_cache``, a response of ``|y|`` tokens gets

    R_length(y) = 0                                    if |y| <= L_max - L_cache
                  ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                  -1                                   if |y| > L_max

added to its task reward. Here ``L_max`` is ``rollout.max_new_tokens`` and ``L_cache`` is
``reward.overlong_buffer``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from gspo.rewards.scoring import RewardScorer


def soft_overlong_penalty(length: int, *, max_tokens: int, buffer_tokens: int) -> float:
    """R_length for a response of ``length`` tokens, in [-1, 0] (see the module docstring)."""
    expected = max_tokens - buffer_tokens
    if length <= expected:
        return 0.0
    if length > max_tokens:
        return -1.0
    return (expected - length) / buffer_tokens


def overlong_reward(*, max_tokens: int, buffer_tokens: int,
                    tokenizer: Any = None) -> Callable[..., list[float | None]]:
    """A reward function worth ``1 + R_length``: 1 within budget, falling to 0 at ``L_max``.

    The +1 shift keeps full marks reachable for evaluation's accuracy (which counts responses
    scoring the sum of the positive weights); it cancels in group-relative advantages, so
    training sees exactly DAPO's penalty. Token counts come from the ``response_tokens``
    column when the caller passes it (exact: the sampled ids); otherwise the decoded text is
    re-encoded with ``tokenizer``, which can differ from the sampled ids by a token or so at
    the edges.
    """
    if not 0 < buffer_tokens <= max_tokens:
        raise ValueError(f"need 0 < buffer_tokens <= max_tokens, got {buffer_tokens}, "
                         f"{max_tokens}")

    def overlong(prompts: list[str], completions: list[str], *,
                 response_tokens: list[int] | None = None, **_: Any) -> list[float | None]:
        if response_tokens is None:
            if tokenizer is None:
                raise ValueError("overlong: no response_tokens column and no tokenizer")
            ids = tokenizer(list(completions), add_special_tokens=False)["input_ids"]
            response_tokens = [len(x) for x in ids]
        return [1.0 + soft_overlong_penalty(int(n), max_tokens=max_tokens,
                                            buffer_tokens=buffer_tokens)
                for n in response_tokens]

    return overlong


OVERLONG = "overlong"  # the term's name: logged as reward/overlong


def add_overlong(scorer: RewardScorer, *, max_tokens: int, buffer_tokens: int,
                 tokenizer: Any = None) -> RewardScorer:
    """``scorer`` plus the overlong term (weight 1, logged as ``reward/overlong``). The
    trainer passes the sampled token counts (``RewardScorer(..., response_tokens=)``): the
    decoded text re-encoded can differ (EOS is dropped from the text, a byte that is not
    UTF-8 decodes to U+FFFD, which encodes as several tokens). A reward function of
    ``scorer`` already called ``overlong`` is a ValueError: the two would share one name."""
    if OVERLONG in scorer.names:
        raise ValueError(f"a reward function is named '{OVERLONG}', the name of the "
                         "reward.overlong_buffer term; rename the function")
    fn = overlong_reward(max_tokens=max_tokens, buffer_tokens=buffer_tokens, tokenizer=tokenizer)
    return RewardScorer([*scorer.functions, fn], [*scorer.names, OVERLONG],
                        [*scorer.weights, 1.0])


def without_overlong(scorer: RewardScorer) -> RewardScorer:
    """``scorer`` less the overlong term, sharing its timeout, reward processes and failure
    counts: evaluation's. The term is a training-time penalty on the sampling budget
    (``rollout.max_new_tokens``); evaluation decodes to its own budget and scores the task."""
    if OVERLONG not in scorer.names:
        return scorer
    keep = [i for i, n in enumerate(scorer.names) if n != OVERLONG]
    out = copy.copy(scorer)  # the same failure counts, error reports, processes, timeout
    out.functions = [scorer.functions[i] for i in keep]
    out.names = [scorer.names[i] for i in keep]
    out.weights = [scorer.weights[i] for i in keep]
    return out
