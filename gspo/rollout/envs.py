"""Environments for multi-turn rollouts: ``reset`` / ``step``, one instance per sampled row.

An environment reads each policy turn and answers with an observation (a tool's output, a
game's reply) or ends the episode. :func:`gspo.rollout.multiturn.multi_turn` appends the
observation to the context as a new turn and lets the policy continue, up to
``rollout.max_turns`` policy turns. Observation tokens are fed to the model but never trained
on (``Rollout.model_mask``); rewards score the whole transcript afterwards, so an environment
has no reward to return.

Writing one (select it with ``rollout.env=my_module:Guess``, or register a name)::

    class Guess:
        def reset(self, prompt: str, **columns) -> None:
            self.target = int(columns["answer"])
        def step(self, response: str) -> Step:
            said = extract_number(response)
            if said is None or said == self.target:
                return Step(done=True)
            return Step("higher" if said < self.target else "lower")

The shape follows OpenEnv's ``reset() / step(action)`` and verifiers' ``MultiTurnEnv``
(``env_response`` / ``is_completed``), with text in and text out: tokens, chat templates and
masks are the rollout loop's business.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from gspo.registry import Registry
from gspo.rewards.sandbox import run_python
from gspo.rewards.sandbox.process import _TAIL_BYTES
from gspo.rewards.transcript import OBS_CLOSE, OBS_OPEN


@dataclass(frozen=True)
class Step:
    """What an environment answers to one policy turn: ``observation`` becomes the next turn
    of the context; ``done`` (or no observation) ends the episode."""

    observation: str | None = None
    done: bool = False


class Env(Protocol):
    """One episode per instance: ``reset`` once with the row's prompt and dataset columns
    (``answer`` and every other column, as reward functions get them), then ``step`` on each
    policy turn (its decoded text, special tokens dropped). ``reset`` may return an initial
    observation (text, the same for every row of a prompt): the first turn sees it after the
    prompt, in the same user message (:class:`gspo.rollout.multiturn.TurnLoop`)."""

    def reset(self, prompt: str, **columns: Any) -> str | None: ...

    def step(self, response: str) -> Step: ...


ENVS: Registry[Any] = Registry("environment")  # name -> a class (or factory) of Env


class EnvError(ValueError):
    """An environment spec that names nothing usable."""


def resolve_env(spec: str) -> Any:
    """The factory registered as ``spec``, or ``'package.module:Name'``; called with no
    arguments, once per rollout row."""
    if ":" not in spec:
        return ENVS[spec]
    module, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as e:  # import errors, a missing attribute, a malformed spec
        raise EnvError(f"rollout.env={spec}: cannot import it ({type(e).__name__}: {e})") from e


_CALL = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def tool_call(text: str) -> str | None:
    """The code of the last complete ```` ```python ```` block of a turn, or None (no call)."""
    calls = _CALL.findall(text)
    return calls[-1] if calls else None


@ENVS.register("python")
class PythonTool:
    """The built-in tool: a turn holding a ```` ```python ```` block runs its last block in the
    sandbox (:func:`gspo.rewards.sandbox.run_python`, stdlib only, no network, the limits
    below); what it printed comes back as the observation ``<output>\\n...\\n</output>``:
    stdout cut to ``max_chars`` (its first characters, or its last ones, after ``...``, where
    the sandbox kept only the end of a long output), then, when the run did not complete, the
    last line of stderr (the exception) or the status (``timeout``, ``memory``,
    ``output_limit``), which the cut never drops. A turn without a block is the final answer
    and ends the episode."""

    max_chars = 400
    limits: ClassVar[dict[str, Any]] = {"wall_timeout_s": 5.0, "cpu_s": 2, "memory_mb": 256}

    def reset(self, prompt: str, **columns: Any) -> None:
        pass

    def step(self, response: str) -> Step:
        code = tool_call(response)
        if code is None:
            return Step(done=True)
        result = run_python(code, [], **self.limits)
        text = result.stdout_tail
        if len(text.encode()) >= _TAIL_BYTES:  # the sandbox kept only the output's end
            text = "..." + text[-self.max_chars:]
        elif len(text) > self.max_chars:
            text = text[:self.max_chars] + "..."
        if text and not text.endswith("\n"):
            text += "\n"
        if result.status not in ("ok", "failed"):
            last = result.stderr_tail.strip().splitlines()
            text += (last[-1][:self.max_chars] if last else result.status) + "\n"
        return Step(f"{OBS_OPEN}\n{text.rstrip()}\n{OBS_CLOSE}")
