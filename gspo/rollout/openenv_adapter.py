"""Use an `openenv-core <https://pypi.org/project/openenv-core/>`_ environment in gspo rollouts.

OpenEnv splits an environment into a server (``openenv.core.env_server.Environment``:
``reset(seed=, episode_id=) -> Observation``, ``step(action) -> Observation`` with ``done`` and
``reward``) and an HTTP/WebSocket client, usually in a container. gspo samples its own tokens,
so it needs no server: :class:`OpenEnvAdapter` drives the ``Environment`` object in-process
(offline) and turns text into actions and observations into text with two functions you give.

    def make_env():  # rollout.env=my_module:make_env
        return OpenEnvAdapter(MyEnvironment(), action=lambda text: MyAction(text=text),
                              observe=lambda obs: obs.text)

The observation's ``reward`` is not used: rewards come from ``reward.functions`` on the whole
transcript. Nothing here imports ``openenv``; any object with that ``reset``/``step`` works.

Each episode is reset with ``seed=`` a stable hash of its prompt (where ``reset`` takes a
``seed``), so every row of a GRPO group starts from the same environment state, and a run
starts each prompt's episodes from the same states every time: a group's advantages compare
responses to one task, not to as many random starts as it has rows. The observation ``reset``
returns goes through ``observe`` too: where that gives text (a board, the task's statement),
the first turn shows it after the dataset prompt; empty text shows nothing.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from typing import Any

from gspo.rollout.envs import Step


def prompt_seed(prompt: str) -> int:
    """A seed that depends on the prompt's text only (63 bits, the same in every process)."""
    return int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "big") >> 1


class OpenEnvAdapter:
    """A gspo :class:`gspo.rollout.envs.Env` over an in-process OpenEnv ``Environment``."""

    def __init__(self, env: Any, *, action: Callable[[str], Any],
                 observe: Callable[[Any], str]) -> None:
        self.env, self.action, self.observe = env, action, observe
        self.episode = 0
        try:
            params = inspect.signature(env.reset).parameters
        except (TypeError, ValueError):  # a builtin or C callable: no seed passed
            params = {}  # type: ignore[assignment]
        self._takes_seed = "seed" in params or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def reset(self, prompt: str, **columns: Any) -> str | None:
        """Reset the environment; its observation's text (``observe``), or None if empty."""
        self.episode += 1
        kwargs: dict[str, Any] = {"episode_id": str(self.episode)}
        if self._takes_seed:
            kwargs["seed"] = prompt_seed(prompt)
        obs = self.env.reset(**kwargs)
        return (self.observe(obs) or None) if obs is not None else None

    def step(self, response: str) -> Step:
        obs = self.env.step(self.action(response))
        if getattr(obs, "done", False):
            return Step(done=True)
        return Step(self.observe(obs))
