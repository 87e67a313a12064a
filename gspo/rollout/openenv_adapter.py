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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gspo.rollout.envs import Step


class OpenEnvAdapter:
    """A gspo :class:`gspo.rollout.envs.Env` over an in-process OpenEnv ``Environment``."""

    def __init__(self, env: Any, *, action: Callable[[str], Any],
                 observe: Callable[[Any], str]) -> None:
        self.env, self.action, self.observe = env, action, observe
        self.episode = 0

    def reset(self, prompt: str, **columns: Any) -> None:
        self.episode += 1
        self.env.reset(episode_id=str(self.episode))

    def step(self, response: str) -> Step:
        obs = self.env.step(self.action(response))
        if getattr(obs, "done", False):
            return Step(done=True)
        return Step(self.observe(obs))
