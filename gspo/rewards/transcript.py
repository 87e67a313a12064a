"""Rewards on multi-turn transcripts (``rollout.max_turns > 1``, :mod:`gspo.rollout.multiturn`).

A multi-turn completion is the whole transcript: the policy's turns with the observations
(tool output) between them. Built-in tools wrap every observation in :data:`OBS_OPEN` ...
:data:`OBS_CLOSE`, so a reward can tell the policy's final turn from what a tool printed:
``numeric_match`` on the transcript would credit an answer that only the tool produced.
"""

from __future__ import annotations

from typing import Any

from gspo.rewards.functions import numeric_match, register_reward

OBS_OPEN = "<output>"  # how built-in environments open an observation
OBS_CLOSE = "</output>"  # ... and close it


def final_turn(transcript: str) -> str:
    """The text after the last observation (the whole text when there is none)."""
    cut = transcript.rfind(OBS_CLOSE)
    return transcript if cut < 0 else transcript[cut + len(OBS_CLOSE):]


@register_reward("final_numeric_match")
def final_numeric_match(prompts: list[str], completions: list[str], *, answer: list[str],
                        **_: Any) -> list[float | None]:
    """1.0 when the last number of the policy's *final* turn (:func:`final_turn`) equals the
    reference, else 0.0; a number that appears only in a tool's output scores 0. A reference
    that is not a number makes the row unscorable (None)."""
    return numeric_match(prompts, [final_turn(c) for c in completions], answer=answer)
